"""The core: config, CLI, the trainer (driver), the trajectory record and store, GRPO, the learner."""

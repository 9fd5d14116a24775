"""Training, over rollout/: the run's config, the trainer (the driver: schedules, syncs, faults),
the learner (GRPO, PPO, milestone credit, chunked log-probs, routing replay, several ranks), the
trajectory store and checkpoints, held-out evaluation, the supervised warm start, and the starting
policies (the packaged pretrained model, tiny random ones). The command-line tools sit above, in
longhorizon/."""

"""Training, over rollout/, one idea per folder: loop/ (the driver, the RL loop on one page, and
its parts), learner/ (GRPO, PPO, milestone credit, chunked log-probs, routing replay, several
ranks), weight_sync/ (the learner's weights to the engines), start/ (starting policies and the
warm start); beside them the run's config (config.py) and the trajectory store (store.py). The
command-line tools sit above, in longhorizon/."""

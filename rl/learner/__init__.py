"""The learner: a Ray actor holding the policy's trainable weights and optimiser (learner.py), its
losses (GRPO, PPO, milestone credit), the batches it trains on, chunked log-probs, routing replay
and router balancing, LoRA, and a group of ranks acting as one (learner_group.py, shares.py)."""

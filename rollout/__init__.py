"""Rollout, over envs/ and policy/: the engines (vLLM with its plugin and in-place reload, the
native engine), the token-level chat format, the agent loop, the Ray rollout worker, and the
records rl/ consumes: the trajectory and the sync's wire format (rollout/weights.py)."""

"""Rollout: the vLLM engine, the token-level chat format, the agent loop and the Ray rollout worker."""

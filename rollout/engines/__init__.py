"""Rollout engines behind one protocol: `generate(prompts, *, max_tokens, temperature, top_p,
stop_token_ids, seeds, min_tokens) -> [Generation]` (rollout/engines/base.py), `score(token_ids)`, `load_weights(named
tensors, version)` and `version`.

- `vllm`: rollout/engines/vllm_engine.py, Hugging Face architectures through vLLM, and the `policy/` model
  through the project's vLLM plugin (rollout/engines/vllm_plugin.py).
- `native`: rollout/engines/native.py, the project's `policy/` model in plain PyTorch, recording
  routed experts.
"""

from __future__ import annotations

from policy.checkpoint import is_policy_checkpoint


def make_engine(
    kind: str,
    policy_path: str,
    *,
    seed: int,
    max_model_len: int,
    dtype: str = "float32",
    kv_cache_gib: float = 1.0,
    enforce_eager: bool = True,
    max_batch: int = 32,
    gpu_memory_utilization: float = 0.0,
):
    """The engine `kind` serving `policy_path`; a checkpoint the engine cannot serve is refused by name."""
    if kind == "native":
        if not is_policy_checkpoint(policy_path):
            raise ValueError(
                f"rollout.engine=native serves the project's policy/ model only; {policy_path} is a "
                "Hugging Face checkpoint (use rollout.engine=vllm)"
            )
        from rollout.engines.native import NativeEngine

        return NativeEngine(
            policy_path, seed=seed, max_model_len=max_model_len, dtype=dtype, max_batch=max_batch
        )
    if kind == "vllm":
        from rollout.engines.vllm_engine import VLLMEngine

        return VLLMEngine(
            policy_path,
            seed=seed,
            max_model_len=max_model_len,
            kv_cache_gib=kv_cache_gib,
            dtype=dtype,
            enforce_eager=enforce_eager,
            gpu_memory_utilization=gpu_memory_utilization,
        )
    raise ValueError(f"unknown rollout engine {kind!r}: vllm or native")

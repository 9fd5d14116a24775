"""Rollout routing replay for Hugging Face MoE checkpoints.

The project's own `policy/` model takes recorded expert ids as an argument (`routing=`). A Hugging
Face MoE model has no such argument, so this module puts a forward hook on each MoE layer's router
(`gate`, the `*TopKRouter` modules of Qwen3-MoE/Qwen2-MoE-style models, which return
`(router_logits, routing_weights, selected_experts)`) and, while a replay is set, swaps the
router's selection for the recorded one: the weights are recomputed from the current router
logits (softmax over all experts, gathered at the recorded ids, renormalised when the model
renormalises), so the router still gets gradients. Rows of -1 keep the router's own choice.

Not covered: routers of another shape (Mixtral's plain `nn.Linear` gate, DeepSeek-V3's grouped
sigmoid router): `HFRoutingReplay.supported` is False for them and the learner trains without
replay, saying so in its metrics (no `routing_replay_decisions`).
"""

from __future__ import annotations

import torch

from policy.moe import replay_selection


def _is_topk_router(module: torch.nn.Module) -> bool:
    return type(module).__name__.endswith("TopKRouter") and hasattr(module, "top_k") and hasattr(module, "weight")


class HFRoutingReplay:
    def __init__(self, model: torch.nn.Module):
        self.gates = [m for m in model.modules() if _is_topk_router(m)]  # in layer order
        self.replay: list[torch.Tensor] | None = None  # per layer, N × k
        self.counts = [0, 0]
        self.model = model
        self.seen: list[torch.Tensor] | None = None  # the routers' own choices, while `own_choice` runs
        for layer, gate in enumerate(self.gates):
            gate.register_forward_hook(lambda mod, inp, out, layer=layer: self._hook(layer, mod, out))

    @property
    def supported(self) -> bool:
        return bool(self.gates)

    @property
    def top_k(self) -> int:
        return int(self.gates[0].top_k)

    def set(self, routing_LBTk: torch.Tensor | None) -> None:
        """Recorded ids for the next forward (L × B × T × k, -1 where none), or None for no replay."""
        self.replay = None if routing_LBTk is None else [r.reshape(-1, r.shape[-1]) for r in routing_LBTk]
        self.counts = [0, 0]

    @torch.no_grad()
    def own_choice(self, input_ids_BT: torch.Tensor) -> torch.Tensor:
        """The expert ids the routers pick on their own for `input_ids` (L × B × T × k)."""
        self.seen, self.replay = [], None
        try:
            self.model.model(input_ids=input_ids_BT)
            B, T = input_ids_BT.shape
            return torch.stack([s.view(B, T, -1) for s in self.seen])
        finally:
            self.seen = None

    def _hook(self, layer: int, gate, out):
        logits, _, own = out
        if self.seen is not None:
            self.seen.append(own.detach())
        if self.replay is None:
            return out
        idx, (n, differ) = replay_selection(own, self.replay[layer])
        self.counts[0] += n
        self.counts[1] += differ
        weights = torch.softmax(logits, dim=-1, dtype=torch.float).gather(1, idx)
        if getattr(gate, "norm_topk_prob", False):
            weights = weights / weights.sum(-1, keepdim=True)
        return logits, weights.to(logits.dtype), idx

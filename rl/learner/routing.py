"""Rollout routing replay for Hugging Face MoE checkpoints.

The project's own `policy/` model takes recorded expert ids as an argument (`routing=`). A Hugging
Face MoE model has no such argument, so this module puts a forward hook on each MoE layer's router
(`gate`, the `*TopKRouter` modules of Qwen3-MoE/Qwen2-MoE-style models, which return
`(router_logits, routing_weights, selected_experts)`) and, while a replay is set, swaps the
router's selection for the recorded one: the weights are recomputed from the current router
logits (softmax over all experts, gathered at the recorded ids, renormalised when the model
renormalises), so the router still gets gradients. Rows of -1 keep the router's own choice.

The same hooks measure and balance expert load while the learner trains (`capture`): each router's
logits and chosen experts are kept for the forward, `balance_terms` turns them into the Switch
Transformer load-balancing loss (E · Σ_e f_e · P_e, 1.0 at perfect balance; f_e the share of
assignments to expert e, P_e its mean router probability) and the per-layer loads behind the
`router_load_max_over_mean` metric. An upcycled model needs it: its experts start identical and
its top-k weights are renormalised, so with top-1 the policy loss gives the router no gradient at
all and nothing but this term keeps tokens from collapsing onto one expert once the experts differ.

Not covered: routers of another shape (DeepSeek-V3's grouped sigmoid router): `HFRoutingReplay.supported`
is False for them and the learner trains without replay or balancing, saying so in its metrics (no
`routing_replay_decisions`, no `router_load_max_over_mean`).
"""

from __future__ import annotations

import torch

from policy.moe import replay_selection


def _is_topk_router(module: torch.nn.Module) -> bool:
    return (
        type(module).__name__.endswith("TopKRouter")
        and hasattr(module, "top_k")
        and hasattr(module, "weight")
    )


class HFRoutingReplay:
    def __init__(self, model: torch.nn.Module):
        self.gates = [m for m in model.modules() if _is_topk_router(m)]  # in layer order
        self.replay: list[torch.Tensor] | None = None  # per layer, N × k
        self.counts = [0, 0]
        self.model = model
        self.seen: list[torch.Tensor] | None = (
            None  # the routers' own choices, while `own_choice` runs
        )
        self.capture: list[tuple[torch.Tensor, torch.Tensor]] | None = (
            None  # (logits, chosen ids) per layer
        )
        # while set, each router's input statistics for `HFRouterBalance` (per layer)
        self.inputs: list[RouterInputs] | None = None
        for layer, gate in enumerate(self.gates):
            gate.register_forward_hook(
                lambda mod, inp, out, layer=layer: self._hook(
                    layer, mod, out, inp[0] if inp else None
                )
            )

    @property
    def supported(self) -> bool:
        return bool(self.gates)

    @property
    def top_k(self) -> int:
        return int(self.gates[0].top_k)

    def set(self, routing_LBTk: torch.Tensor | None) -> None:
        """Recorded ids for the next forward (L × B × T × k, -1 where none), or None for no replay."""
        self.replay = (
            None if routing_LBTk is None else [r.reshape(-1, r.shape[-1]) for r in routing_LBTk]
        )
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

    @property
    def num_experts(self) -> int:
        return int(self.gates[0].weight.shape[0])

    def _hook(self, layer: int, gate, out, x):
        logits, own_weights, own = out
        if self.inputs is not None and x is not None:  # (a router called by keyword: no input seen)
            self.inputs[layer].add(x)
        if self.seen is not None:
            self.seen.append(own.detach())
        if self.replay is None:
            if self.capture is not None:
                self.capture.append((logits, own.detach()))
            return out
        idx, (n, differ) = replay_selection(own, self.replay[layer])
        self.counts[0] += n
        self.counts[1] += differ
        if self.capture is not None:
            self.capture.append((logits, idx))
        weights = torch.softmax(logits, dim=-1, dtype=torch.float).gather(1, idx)
        # Qwen-style routers say whether they renormalise; Mixtral's always does and has no flag
        renorm = getattr(gate, "norm_topk_prob", None)
        if renorm is None:
            renorm = bool(torch.allclose(own_weights.float().sum(-1), torch.ones(())))
        if renorm:
            weights = weights / weights.sum(-1, keepdim=True)
        return logits, weights.to(logits.dtype), idx


def balance_terms(captured: list[tuple[torch.Tensor, torch.Tensor]], valid_N: torch.Tensor):
    """(Switch load-balancing loss averaged over layers, per-layer expert loads) from one forward's
    captured router logits (N × E) and chosen ids (N × k); padding (`valid_N` False) takes no part."""
    aux, loads = 0.0, []
    for logits, idx in captured:
        logits, idx = logits[valid_N], idx[valid_N]
        n_experts = logits.shape[-1]
        load = torch.bincount(idx.flatten(), minlength=n_experts)
        share = load.float() / max(idx.numel(), 1)
        aux = aux + n_experts * (share * torch.softmax(logits.float(), -1).mean(0)).sum()
        loads.append(load)
    return aux / max(len(captured), 1), loads


class RouterStats:
    """One optimiser step's router statistics of the project's policy, added a micro-batch at a time
    and the scores then let go: per MoE layer the expert loads under the bias every forward of the
    step used, and what the layer's balancing needs — its histogram (`quantile_hist`), nothing more
    (`sign`), or every score (`quantile`: exact quantiles need them all; a long trajectory's N×E
    scores per layer are what `quantile_hist` exists to avoid keeping)."""

    @torch.no_grad()
    def __init__(self, lm):
        from policy.balance import QuantileHistogram

        self.routers = list(lm.module.routers()) if lm.kind == "policy" else []
        self.biases = [r.bias.detach().float().cpu() for r in self.routers]
        self.loads = [torch.zeros(r.a.n_routed_experts, dtype=torch.long) for r in self.routers]
        self.hists = [
            QuantileHistogram(r.a.n_routed_experts, r.a.top_k, r.a.hist_bins, r.a.hist_range)
            if r.a.balance == "quantile_hist"
            else None
            for r in self.routers
        ]
        self.scores: list[list[torch.Tensor]] = [[] for _ in self.routers]
        self.seen = False

    @torch.no_grad()
    def add(self, scores_per_layer: list[torch.Tensor]) -> None:
        """One forward's router scores (tokens × experts per MoE layer, padding left out)."""
        self.seen = True
        for layer, (router, raw) in enumerate(zip(self.routers, scores_per_layer)):
            scores, bias = (
                raw.detach().float().cpu(),
                self.biases[layer],
            )  # balancing runs on the CPU
            idx = (scores + bias).topk(router.a.top_k, dim=-1).indices
            self.loads[layer] += torch.bincount(idx.flatten(), minlength=router.a.n_routed_experts)
            if self.hists[layer] is not None:
                self.hists[layer].add(scores, bias)
            elif router.a.balance == "quantile":
                self.scores[layer].append(scores)


def balance_policy_routers(lm, stats: RouterStats, world: int = 1) -> dict:
    """Quantile-balancing (or sign) update of every MoE router's selection bias of the project's
    policy (`lm`, an rl.learner.logprobs.CausalLM) from one optimiser step's `stats`; returns the load metric.

    The update uses the scores the step's forward produced, with the bias it had; it takes effect
    from the next forward (rollouts see it after the next weight sync). In a learner group every
    rank's tokens count: loads and histograms are summed, exact quantiles see all scores."""
    if lm.kind != "policy" or not (stats.seen or world > 1):
        return {}  # (in a group, a rank with only dummies still takes part in the collectives)
    from policy.balance import quantile_bias, sign_update
    from rl.learner.shares import all_gather_rows, all_reduce_sum

    loads = []
    for layer, router in enumerate(stats.routers):
        a, bias = router.a, stats.biases[layer]
        load = all_reduce_sum(stats.loads[layer])
        loads.append(load)
        if a.balance == "quantile":
            scores = torch.cat(stats.scores[layer] or [torch.zeros(0, a.n_routed_experts)])
            router.bias.copy_(quantile_bias(all_gather_rows(scores), bias, a.top_k))
        elif a.balance == "quantile_hist":
            all_reduce_sum(stats.hists[layer].counts_EB)
            router.bias.copy_(stats.hists[layer].bias())
        elif a.balance == "sign":
            router.bias.copy_(sign_update(load, bias, a.balance_rate))
    return load_metrics(torch.stack(loads)) if loads else {}


def load_metrics(load_LE: torch.Tensor) -> dict:
    """One optimiser step's expert loads (tokens per expert, per MoE layer) as metrics: the worst
    layer's max/mean (`router_load_max_over_mean`, 1.0 is perfect balance) and every layer's share
    of tokens per expert (`router_load`, layers × experts, each row summing to 1; a nested field
    of metrics.jsonl that `longhorizon plot` draws as router_load.png)."""
    from policy.balance import load_imbalance

    shares = load_LE.double() / load_LE.sum(-1, keepdim=True).clamp(min=1)
    return {
        "router_load_max_over_mean": max(load_imbalance(row) for row in load_LE),
        "router_load": shares.tolist(),
    }


def hf_load_metrics(lm, loads_per_micro: list[list[torch.Tensor]]) -> dict:
    """The worst MoE layer's max/mean expert load over one optimiser step's tokens, for a Hugging
    Face MoE (`balance_terms`' loads, on the CPU; in a group summed over ranks, so every rank takes part)."""
    if lm.kind != "hf" or not lm.hf_replay.supported:
        return {}
    from rl.learner.shares import all_reduce_sum

    n_layers, n_experts = len(lm.hf_replay.gates), lm.hf_replay.num_experts
    load = torch.zeros(n_layers, n_experts, dtype=torch.long)
    for per_layer in loads_per_micro:
        load += torch.stack(per_layer)
    load = all_reduce_sum(load)
    if not int(load.sum()):
        return {}
    return load_metrics(load)


class RouterInputs:
    """One MoE layer's router inputs over an optimiser step, as `HFRouterBalance` needs them: their
    second moment and mean (of a sample of rows per forward: a D×D product per token would cost more
    than the step's MoE layers). Every row of a forward counts, padding included: they only shape
    the direction along which the bias is folded in."""

    def __init__(self, rows_per_forward: int = 256, seed: int = 0):
        self.rows, self.gen = rows_per_forward, torch.Generator().manual_seed(seed)
        self.xx_DD: torch.Tensor | None = None
        self.x_D: torch.Tensor | None = None
        self.n = 0

    @torch.no_grad()
    def add(self, x: torch.Tensor) -> None:
        x_ND = x.detach().reshape(-1, x.shape[-1]).float().cpu()
        if x_ND.shape[0] > self.rows:
            x_ND = x_ND[torch.randperm(x_ND.shape[0], generator=self.gen)[: self.rows]]
        if self.xx_DD is None:
            self.xx_DD = torch.zeros(x_ND.shape[1], x_ND.shape[1], dtype=torch.float64)
            self.x_D = torch.zeros(x_ND.shape[1], dtype=torch.float64)
        self.xx_DD += x_ND.double().T @ x_ND.double()
        self.x_D += x_ND.double().sum(0)
        self.n += x_ND.shape[0]

    def unit_direction(self, ridge: float = 1.0) -> torch.Tensor:
        """u with u·x ≈ 1 for the rows seen (ridge least squares, λ = ridge · trace/D): adding
        b·uᵀ to a router row adds about b to its logit for every token."""
        D = self.xx_DD.shape[0]
        a = self.xx_DD / self.n
        lam = ridge * a.trace() / D
        return torch.linalg.solve(a + lam * torch.eye(D, dtype=a.dtype), self.x_D / self.n).float()


class HFRouterBalance:
    """Quantile balancing for a Hugging Face MoE's routers (`algo.router_balance: quantile`).

    The project's policy balances with a selection bias (policy/balance.py). Mixtral's router has
    none, in transformers and in vLLM, so a bias the learner kept would not be served. Instead each
    step's quantile-balancing bias b (policy.balance.quantile_bias on the step's router logits,
    valid tokens only) is folded into the router's weights along a direction u with u·x ≈ 1 for the
    step's router inputs: W ← W + rate · b uᵀ shifts every token's logits by about b, and the engine
    gets it with the weights at the next sync. What the fold misses (u·x is not exactly 1) the next
    step measures and corrects. Measured offline on the upcycled SmolLM2 (4×1, six steps on ~90
    tokens): the worst layer's max/mean load 3.05 → 1.14, the median layer's 1.80 → 1.03.

    Not covered: LoRA runs (an adapter sync carries no router weights: refused at config load),
    and a learner group (the step's statistics would need summing over ranks first)."""

    def __init__(self, replay: HFRoutingReplay, rate: float = 1.0):
        self.replay, self.rate = replay, rate
        self.logits: list[list[torch.Tensor]] = [[] for _ in replay.gates]

    def begin(self) -> None:
        """A new optimiser step: its forwards' router inputs and logits are collected."""
        self.replay.inputs = [RouterInputs(seed=i) for i in range(len(self.replay.gates))]
        self.logits = [[] for _ in self.replay.gates]

    def add(self, captured: list[tuple[torch.Tensor, torch.Tensor]], valid_N: torch.Tensor) -> None:
        """One forward's captured router logits (`HFRoutingReplay.capture`), valid rows only."""
        for layer, (logits, _) in enumerate(captured):
            self.logits[layer].append(logits.detach()[valid_N].float().cpu())

    @torch.no_grad()
    def step(self) -> None:
        """Fold this step's balancing bias into every router; collection stops until `begin`."""
        from policy.balance import quantile_bias

        inputs, self.replay.inputs = self.replay.inputs, None
        k = self.replay.top_k
        for layer, gate in enumerate(self.replay.gates):
            if not self.logits[layer] or inputs is None or not inputs[layer].n:
                continue
            logits_NE = torch.cat(self.logits[layer])
            b_E = quantile_bias(logits_NE, torch.zeros(logits_NE.shape[1]), k)
            u_D = inputs[layer].unit_direction()
            gate.weight.add_((self.rate * b_E[:, None] * u_D[None, :]).to(gate.weight))
        self.logits = [[] for _ in self.replay.gates]

"""Per-token log-probs (and entropies) from hidden states, a chunk of positions at a time.

Full-vocabulary logits for a long trajectory are the learner's largest tensor (128K tokens ×
150K vocab × 4 bytes = 77 GB for a real vocabulary). Here the LM head runs on `chunk_tokens`
positions at a time and, under autograd, each chunk is recomputed in the backward pass, so at
most one chunk of logits exists at any moment. `token_logprobs` in `rl.learner.grpo` is the reference.

The model side is a `CausalLM` adapter: `hidden(input_ids, attention_mask)` → (B, T, D) final
hidden states (after the final norm) and `head` the output projection, for Hugging Face causal LMs
and for the project's own `policy/` model alike.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
import torch.utils.checkpoint

from policy.norm import upcast
from rl.learner.hf_experts import padded_rows


def _chunk_logprobs(
    h_BCD, head_weight, head_bias, ids_BC, temperature: float, with_entropy: bool, banned_V=None
):
    logits = _scaled_logits(h_BCD, head_weight, head_bias, temperature, banned_V)
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, ids_BC[..., None]).squeeze(-1)
    ent = torch.zeros_like(logp)
    if with_entropy:  # banned tokens: 0 · log 0 counts as 0
        ent = -(
            logp_all.exp() * (logp_all if banned_V is None else logp_all.masked_fill(banned_V, 0.0))
        ).sum(-1)
    return logp, ent


def _scaled_logits(h_BCD, weight, bias, temperature: float, banned_V):
    """fp32 (at least) logits / temperature, banned tokens at -inf: a fresh tensor this code owns."""
    logits = torch.nn.functional.linear(h_BCD, weight, bias)
    z = upcast(logits)
    if temperature != 1.0:
        z = z.div_(temperature)
    if banned_V is not None:
        z = z.masked_fill_(banned_V, -torch.inf)
    return z


class _HeadLogprobs(torch.autograd.Function):
    """log softmax(h·Wᵀ + b / T)[ids] for one chunk of positions, keeping only h's chunk and one
    log-sum-exp per position for the backward, which recomputes the logits and turns them into
    the gradient in place: g·(onehot − softmax)/T, then the two matmuls. The autograd path
    (`_chunk_logprobs` under a checkpoint) made about twice the passes over the chunk's
    positions × vocabulary: a second log-softmax in the recompute, its backward, the division's
    and the upcast's backwards, and a zero-filled gradient for the gather. Matmuls run in the
    dtype the forward's linear ran in (bf16 under autocast). Tested against `_chunk_logprobs` in fp64."""

    @staticmethod
    def forward(ctx, h_BCD, weight, bias, ids_BC, temperature: float, banned_V):
        z_BCV = _scaled_logits(h_BCD, weight, bias, temperature, banned_V)
        lse_BC = torch.logsumexp(z_BCV, dim=-1)
        logp_BC = z_BCV.gather(-1, ids_BC[..., None]).squeeze(-1) - lse_BC
        low = (
            torch.get_autocast_dtype(h_BCD.device.type)
            if torch.is_autocast_enabled(h_BCD.device.type)
            else h_BCD.dtype
        )
        ctx.temperature, ctx.low, ctx.has_bias = temperature, low, bias is not None
        ctx.save_for_backward(
            h_BCD,
            weight,
            bias if bias is not None else weight.new_empty(0),
            ids_BC,
            lse_BC,
            banned_V if banned_V is not None else ids_BC.new_empty(0, dtype=torch.bool),
        )
        return logp_BC

    @staticmethod
    def backward(ctx, g_BC):
        h_BCD, weight, bias, ids_BC, lse_BC, banned_V = ctx.saved_tensors
        low, temperature = ctx.low, ctx.temperature
        h_low, w_low = h_BCD.to(low), weight.to(low)
        b_low = bias.to(low) if ctx.has_bias else None
        z_BCV = _scaled_logits(
            h_low, w_low, b_low, temperature, banned_V if banned_V.numel() else None
        )
        g_BC = g_BC.to(z_BCV.dtype)
        d_BCV = z_BCV.sub_(lse_BC[..., None]).exp_().mul_(-g_BC[..., None])  # −g·softmax, in place
        d_BCV.scatter_add_(-1, ids_BC[..., None], g_BC[..., None])  # + g at the target
        if temperature != 1.0:
            d_BCV.div_(temperature)
        d_BCV = d_BCV.to(low)
        grad_h = (d_BCV @ w_low).to(h_BCD.dtype) if ctx.needs_input_grad[0] else None
        grad_w = grad_b = None
        if ctx.needs_input_grad[1]:
            grad_w = (d_BCV.flatten(0, -2).T @ h_low.flatten(0, -2)).to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = d_BCV.flatten(0, -2).sum(0).to(bias.dtype)
        return grad_h, grad_w, grad_b, None, None, None


def chunked_logprobs(
    hidden_BTD,
    head: torch.nn.Linear,
    ids_BT,
    *,
    temperature: float = 1.0,
    chunk_tokens: int = 1024,
    with_entropy: bool = False,
    banned_ids: list[int] | None = None,
    only_BT=None,
):
    """log p(ids[:, t+1] | ids[:, :t+1]) for t < T-1 (B × T-1, fp32), and the entropies if asked.
    `banned_ids`: tokens the model never generates (`CausalLM.banned_ids`), at probability zero.
    `only_BT` (B × T-1, bool): compute only these targets (the loss mask: the policy's own tokens)
    and return 0 elsewhere; the head then runs on the generated tokens alone, not on prompts and
    tool observations, which are most of a tool-use episode."""
    h = hidden_BTD[:, :-1]
    banned = None
    if banned_ids:
        banned = torch.zeros(head.weight.shape[0], dtype=torch.bool, device=h.device)
        banned[banned_ids] = True
    targets = ids_BT[:, 1:]
    if only_BT is not None:
        sel_BT = only_BT.bool()
        h_ND, t_N = h[sel_BT], targets[sel_BT]
        n = len(t_N)
        # rows to a multiple of ROWS: one oneDNN kernel per few shapes (rl/learner/hf_experts.py)
        pad = padded_rows(n) - n
        if pad:
            h_ND = torch.cat([h_ND, h_ND.new_zeros(pad, h_ND.shape[-1])])
            t_N = torch.cat([t_N, t_N.new_zeros(pad)])
        lp_1N, ent_1N = _logprobs_of(
            h_ND[None], head, t_N[None], temperature, chunk_tokens, with_entropy, banned
        )
        lp_1N, ent_1N = lp_1N[:, :n], (ent_1N[:, :n] if with_entropy else None)
        zeros_BT = torch.zeros(targets.shape, dtype=lp_1N.dtype, device=h.device)
        return (
            zeros_BT.masked_scatter(sel_BT, lp_1N[0]),
            zeros_BT.masked_scatter(sel_BT, ent_1N[0]) if with_entropy else None,
        )
    return _logprobs_of(h, head, targets, temperature, chunk_tokens, with_entropy, banned)


def _logprobs_of(h, head, targets, temperature, chunk_tokens, with_entropy, banned):
    recompute = torch.is_grad_enabled() and (h.requires_grad or head.weight.requires_grad)
    lps, ents = [], []
    for h_c, t_c in zip(h.split(chunk_tokens, dim=1), targets.split(chunk_tokens, dim=1)):
        args = (h_c, head.weight, head.bias, t_c, temperature, with_entropy, banned)
        if not with_entropy:  # the usual case (no entropy bonus): one function, its own backward
            lps.append(_HeadLogprobs.apply(h_c, head.weight, head.bias, t_c, temperature, banned))
            continue
        if recompute:
            lp, ent = torch.utils.checkpoint.checkpoint(_chunk_logprobs, *args, use_reentrant=False)
        else:
            lp, ent = _chunk_logprobs(*args)
        lps.append(lp)
        ents.append(ent)
    return torch.cat(lps, 1), (torch.cat(ents, 1) if with_entropy else None)


def _merge_prefix_captures(captured: list, B: int, n: int) -> list:
    """The routers' captures of a shared-prefix forward (each layer's 1·n prefix rows, then its B·(T−n)
    suffix rows) as the plain B × T forward would have captured them: the prefix rows repeated for
    every row, in row-major order, so balancing and load metrics see the same tokens."""
    L = len(captured) // 2
    out = []
    for (pre_logits, pre_idx), (logits, idx) in zip(captured[:L], captured[L:]):
        merged = []
        for p, s in ((pre_logits, logits), (pre_idx, idx)):
            p_BnX = p[None].expand(B, *p.shape)
            merged.append(
                torch.cat([p_BnX, s.view(B, -1, s.shape[-1])], 1).reshape(-1, s.shape[-1])
            )
        out.append(tuple(merged))
    return out


def right_padded(attn_BT: torch.Tensor | None) -> bool:
    """Whether a mask only pads on the right (each row's ones come first): a causal model's real
    tokens then never see the padding, so the forward needs no mask. Without one, transformers' SDPA
    runs its causal kernel instead of a materialised B × T × T mask: the real policy's forward and
    backward of a demo iteration's micro-batches took 20.4 s against 22.4 with the mask, with the same
    hidden states at every real position."""
    return attn_BT is None or bool((attn_BT[:, 1:] <= attn_BT[:, :-1]).all())


class CausalLM:
    """What the learner needs from a model, for either kind of checkpoint."""

    def __init__(self, module: torch.nn.Module, kind: str):
        self.module, self.kind = module, kind
        self.root: torch.nn.Module | None = None  # the root FSDP unit once `parallelize` has run
        self.banned_ids = module.never_generated() if kind == "policy" else []
        self.hf_replay = None
        # Hugging Face models: a micro-batch whose rows all start with at least this many equal tokens
        # runs that prefix once (`_hf_shared_prefix`); 0: off. Set by the learner (learner.shared_prefix_tokens).
        self.shared_prefix_tokens = 0
        if kind == "hf":
            from rl.learner.routing import HFRoutingReplay

            self.hf_replay = HFRoutingReplay(module)

    def moe_shape(self) -> tuple[int, int] | None:
        """(MoE layers, experts per token) when the model can replay recorded routing, else None."""
        if self.kind == "policy":
            routers = self.module.routers()
            return (len(routers), routers[0].a.top_k) if routers else None
        return (
            (len(self.hf_replay.gates), self.hf_replay.top_k) if self.hf_replay.supported else None
        )

    @property
    def head(self) -> torch.nn.Linear:
        return self.module.lm_head

    def hidden(self, input_ids, attention_mask=None):
        return self.hidden_and_routing(input_ids, attention_mask)[0]

    def hidden_and_routing(
        self, input_ids, attention_mask=None, routing=None, capture: bool = False
    ):
        """(hidden states, router_info or None). The project's policy reports its routing and
        replays recorded expert ids (`routing`, L × B × T × k, -1 where none); right padding needs
        no mask there (every layer is causal, padding only follows real tokens), and a Hugging Face
        model gets none either when `attention_mask` only pads on the right (`right_padded`; the
        shared-prefix forward keeps it: its suffix attends to a cache). A Hugging Face MoE replays
        through hooks, and with `capture` reports each router's logits and chosen experts
        (`hf_routers`, for load balancing and load metrics: rl/learner/routing.py)."""
        if self.kind == "policy":
            return (self.root or self.module.hidden_states)(input_ids, routing=routing)
        capture = capture and self.hf_replay.supported
        self.hf_replay.set(routing)
        self.hf_replay.capture = [] if capture else None
        try:
            shared = self.shared_prefix(input_ids, attention_mask, routing)
            mask = None if right_padded(attention_mask) else attention_mask
            h = None
            if self.root is not None:
                h = self.root(input_ids, mask)
            elif shared:
                h = self._hf_shared_prefix(input_ids, attention_mask, shared)
            # no prefix to share, or a cache it cannot be shared through: the plain forward
            if h is None:
                shared = 0
                if self.hf_replay.capture:
                    self.hf_replay.capture.clear()  # the prefix forward's captures, if one ran
                h = self.module.model(input_ids=input_ids, attention_mask=mask).last_hidden_state
            counts, captured = tuple(self.hf_replay.counts), self.hf_replay.capture
            if shared and captured:
                captured = _merge_prefix_captures(captured, input_ids.shape[0], shared)
        finally:
            self.hf_replay.set(None)
            self.hf_replay.capture = None
        if routing is None and not capture:
            return h, None
        return h, {"replayed": counts, "scores": [], "hf_routers": captured or []}

    def shared_prefix(
        self, ids_BT: torch.Tensor, attn_BT: torch.Tensor | None, routing=None
    ) -> int:
        """How many leading tokens every row of `ids_BT` shares, when `_hf_shared_prefix` should run
        them once (at least `shared_prefix_tokens`, a Hugging Face model with a plain dynamic cache, no
        routing replay, no FSDP, no activation checkpointing); else 0. At most the shortest row and
        one less than the width, so every row keeps a suffix."""
        B, T = ids_BT.shape
        if (
            self.kind != "hf"
            or not self.shared_prefix_tokens
            or B < 2
            or routing is not None
            or self.root is not None
            or getattr(self.module, "is_gradient_checkpointing", False)
        ):
            return 0
        same = int((ids_BT == ids_BT[:1]).all(0).int().cumprod(0).sum())
        shortest = int(attn_BT.sum(1).min()) if attn_BT is not None else T
        n = min(same, shortest, T - 1)
        return n if n >= self.shared_prefix_tokens else 0

    def _hf_shared_prefix(
        self, ids_BT: torch.Tensor, attn_BT: torch.Tensor, n: int
    ) -> torch.Tensor | None:
        """The hidden states of `ids_BT` (B × T × D), its first `n` tokens (equal in every row: a group's
        prompt, or the system prompt all tasks share) run once: one 1 × n forward fills a KV cache,
        which is expanded (a view, no copy) to the B rows, and the B × (T − n) suffixes attend to it.
        In training the gradient reaches the prefix through the cache and its hidden states, summed
        over the rows, so the result and its gradients are those of the plain B × T forward (tested
        against it) for (B − 1)·n fewer token forwards and backwards. None when the model's cache is not
        a plain dynamic one (sliding windows): the caller then runs the plain forward."""
        from transformers.cache_utils import DynamicLayer

        model, B, T = self.module.model, ids_BT.shape[0], ids_BT.shape[1]
        pre = model(input_ids=ids_BT[:1, :n], use_cache=True)
        cache = pre.past_key_values
        # sliding windows, static caches
        if not all(type(layer) is DynamicLayer for layer in cache.layers):
            return None  # the caller runs the plain forward
        for layer in cache.layers:
            layer.keys, layer.values = (
                t.expand(B, *t.shape[1:]) for t in (layer.keys, layer.values)
            )
        pos_S = torch.arange(n, T, device=ids_BT.device)
        rest = model(
            input_ids=ids_BT[:, n:],
            attention_mask=attn_BT,
            past_key_values=cache,
            use_cache=True,
            cache_position=pos_S,
            position_ids=pos_S[None].expand(B, -1),
        )
        return torch.cat([pre.last_hidden_state.expand(B, -1, -1), rest.last_hidden_state], 1)

    def checkpoint_names(
        self, named: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """`named` (the module's state-dict names and tensors, in state-dict order) renamed and reshaped
        into the checkpoint format that `save_pretrained` writes and engines load. transformers 5
        keeps some models' experts fused in memory (Mixtral's `mlp.experts.gate_up_proj`) while the
        checkpoint on disk, which vLLM reads, has one tensor per expert (`block_sparse_moe.experts.0.w1`):
        a weight sync must speak the engine's format. Lazy, one decoder layer at a time."""
        if self.kind == "policy":
            yield from named
            return
        from transformers.core_model_loading import revert_weight_conversion

        def layer_of(name: str) -> str:
            parts = name.split(".")
            return ".".join(parts[:3]) if len(parts) > 3 and parts[1] == "layers" else ""

        group, key = {}, None
        for name, t in named:
            if group and layer_of(name) != key:
                yield from revert_weight_conversion(self.module, group).items()
                group = {}
            key = layer_of(name)
            group[name] = t
        if group:
            yield from revert_weight_conversion(self.module, group).items()

    def parallelize(self, group=None, *, expert_parallel: bool = True) -> None:
        """Shard the model over `group` (FSDP2 + expert parallelism, policy/parallelize.py), with
        its trunk as the root unit so the head can be applied after the forward, as here."""
        from policy.parallelize import (
            HFHiddenStates,
            HiddenStates,
            parallelize,
            parallelize_hf,
        )

        if self.kind == "policy":
            self.root = HiddenStates(self.module)
            parallelize(self.module, group, expert_parallel=expert_parallel, root=self.root)
        else:
            self.root = HFHiddenStates(self.module)
            parallelize_hf(self.module, group, expert_parallel=expert_parallel, root=self.root)


def load_causal_lm(path: str | Path, dtype: torch.dtype) -> CausalLM:
    """A Hugging Face causal LM, or a `policy/` checkpoint (config.json model_type
    `longhorizon_policy`), behind the same adapter."""
    from policy.checkpoint import is_policy_checkpoint, load_policy

    if is_policy_checkpoint(path):
        return CausalLM(load_policy(path, dtype=dtype), "policy")
    from transformers import AutoModelForCausalLM

    from rl.learner.hf_experts import use_autocast_experts

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    # fused experts in bf16 under bf16 autocast (rl/learner/hf_experts.py)
    use_autocast_experts(model)
    return CausalLM(model, "hf")

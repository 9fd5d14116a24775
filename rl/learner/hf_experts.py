"""Hugging Face MoE experts under bf16 autocast: the expert matmuls in bf16, not fp32.

transformers runs a fused-experts module (Mixtral's and Qwen3-MoE's `mlp.experts`, whose experts
are stacked in 3-D `gate_up_proj` / `down_proj`) through `torch._grouped_mm`, which autocast does
not cover, so transformers casts the activations to the weights' dtype. Under bf16 mixed precision
the weights are the fp32 master copy, so the experts — most of an MoE's FLOPs — ran in fp32 while
every `nn.Linear` ran in bf16: on the real policy a bf16 learner step was 1.02× the fp32 one
(bench row 10), and the profile put 12 of its 30 s in fp32 grouped matmuls.

`use_autocast_experts` gives such a model an experts implementation that, inside autocast, runs
`sorted_experts_forward`: the (token, slot) pairs sorted by expert once, each expert's block padded
to a multiple of `ROWS` rows, one `linear` per expert with its weights cast to the autocast dtype
(as autocast does for a linear layer's weight; autograd carries the gradient back to the fp32
weights). Inside `casts_cached()` — the learner opens it around one optimizer step's micro-batches —
each weight is cast once. Layouts it does not know (biases, transposed or interleaved stacks, expert
parallelism) keep transformers' grouped-mm forward, with the weights cast. Outside autocast it is
transformers' forward unchanged, so fp32 training, evaluation and checkpoints see no difference.

Not covered: experts stored per expert in `nn.Linear`s (autocast already covers them), and the
expert-parallel path (policy/parallelize.py runs its experts through `nn.functional.linear`, which
autocast covers).
"""

from __future__ import annotations

import contextlib
import weakref

import torch

KEY = "longhorizon_autocast_grouped_mm"
_WEIGHTS = ("gate_up_proj", "up_proj", "down_proj")
# Expert blocks are padded to a multiple of this many rows. A bf16 matmul on CPU goes through
# oneDNN, which compiles a kernel for each new shape (cached by shape); an expert's token count
# changes every call, so unpadded blocks compiled a kernel nearly every call: a 381 × 3072 by
# 3072 × 576 bf16 matmul took 13.8 ms in the real policy's step, against 3.7 ms for its FLOPs
# at fp32 speed. 128 rows bound the shapes to a few dozen per layer width for ≤ 4K-token
# micro-batches, at ≤ 127 padding rows per expert.
ROWS = 128


def padded_rows(n: int) -> int:
    """`n` rounded up to a multiple of ROWS."""
    return -(-n // ROWS) * ROWS


class _Cached(torch.autograd.Function):
    """`low`, a cast of `weight` made earlier, standing in for `weight.to(low.dtype)`: the backward
    hands the gradient to `weight` in its own dtype, as the cast's backward would."""

    @staticmethod
    def forward(ctx, weight, low):
        ctx.dtype = weight.dtype
        return low.view_as(low)

    @staticmethod
    def backward(ctx, grad):
        return grad.to(ctx.dtype), None


# id(weight) -> (weight, its version when cast, the cast), kept only inside `casts_cached()`: the
# learner opens it around one optimizer step's micro-batches, whose weights do not change, so every
# micro-batch and recomputed forward shares one cast. Not across steps: fused AdamW updates the
# weights without bumping their version counter, so a cache kept by version alone served the
# first step's weights forever. The version check still catches in-place changes inside the scope.
_CASTS: dict[int, tuple[weakref.ref, int, torch.Tensor]] = {}
_SCOPES = 0


@contextlib.contextmanager
def casts_cached():
    """Within this block (nestable) each weight is cast once; leaving the outermost block drops the casts."""
    global _SCOPES
    _SCOPES += 1
    try:
        yield
    finally:
        _SCOPES -= 1
        if not _SCOPES:
            _CASTS.clear()


def _low(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`weight` cast to `dtype`, detached; inside `casts_cached()` made once and reused."""
    with torch.no_grad():
        hit = _CASTS.get(id(weight)) if _SCOPES else None
        if (
            hit is None
            or hit[0]() is not weight
            or hit[1] != weight._version
            or hit[2].dtype != dtype
        ):
            hit = (weakref.ref(weight), weight._version, weight.detach().to(dtype))
            if _SCOPES:
                _CASTS[id(weight)] = hit
    return hit[2]


def cast(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`weight.to(dtype)` for the forward; inside `casts_cached()` made once and reused."""
    low = _low(weight, dtype)
    return _Cached.apply(weight, low) if weight.requires_grad and torch.is_grad_enabled() else low


class _ExpertViews(torch.autograd.Function):
    """The E experts of `low` (a cast of the stacked weight `weight`, E × ...), a view each, whose
    backward adds each expert's low-precision gradient straight into its slice of `weight.grad`.

    `cast(weight).unbind(0)` gives the same forward, but its backward, every micro-batch, stacks the
    E experts' gradients into a new tensor (zeros for an expert no token chose), converts the
    stack to a new fp32 tensor and hands that to AccumulateGrad to add: three passes over the whole
    weight and two allocations of it, where this is one in-place add per expert used (`.grad`
    allocated once per optimizer step). The sums are the same bit for bit: a bf16 → fp32
    conversion is exact, and the micro-batches add in the same order.

    It writes `weight.grad` itself and gives autograd no gradient for `weight`, so it is only for a
    plain leaf tensor without gradient hooks (`_writes_own_grad`), under `backward()`: a
    `torch.autograd.grad` through it would not see the weight's gradient (the learner never takes
    one of its weights that way)."""

    @staticmethod
    def forward(ctx, weight, low):
        ctx.weight = weight
        ctx.set_materialize_grads(False)  # an expert no token chose gets None, not a zero tensor
        return low.unbind(0)

    @staticmethod
    def backward(ctx, *grads):
        w = ctx.weight
        if w.grad is None:
            w.grad = torch.zeros_like(w)
        for e, g in enumerate(grads):
            if g is not None:
                w.grad[e].add_(g)
        return None, None


def _writes_own_grad(weight: torch.Tensor) -> bool:
    """Whether `_ExpertViews` may write `weight.grad` itself: a plain leaf tensor (not a DTensor or
    other subclass) that wants a gradient, with no hook that expects to see it pass, in a process
    outside a torch.distributed group of several ranks (a learner group's FSDP collects the gradients
    of the unsharded weights it swaps in, on its own schedule: that path keeps autograd's
    accumulation). A group of one does not count: it shards nothing, and vLLM starts one of its own
    in any process that runs an engine in-process (the test session's does)."""
    import torch.distributed as dist

    return (
        type(weight) in (torch.Tensor, torch.nn.Parameter)
        and weight.is_leaf
        and weight.requires_grad
        and torch.is_grad_enabled()
        and not weight._backward_hooks
        and not getattr(weight, "_post_accumulate_grad_hooks", None)
        and not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1)
    )


def expert_views(weight: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """`weight.to(dtype).unbind(0)`: the stacked experts in `dtype`, one tensor each, the cast shared
    within `casts_cached()`, the gradient reaching `weight` (through `_ExpertViews` where it can)."""
    if _writes_own_grad(weight):
        return _ExpertViews.apply(weight, _low(weight, dtype))
    return cast(weight, dtype).unbind(0)


class _CastWeights:
    """An experts module seen with its stacked weights in `dtype`; every other attribute (the
    activation, the layout flags, the biases) is the module's own."""

    def __init__(self, module: torch.nn.Module, dtype: torch.dtype):
        self._module = module
        for name in _WEIGHTS:
            w = getattr(module, name, None)
            if isinstance(w, torch.Tensor):
                self.__dict__[name] = cast(w, dtype)

    def __getattr__(self, name: str):
        return getattr(self._module, name)


def _plain_layout(module) -> bool:
    """Mixtral's and Qwen3-MoE's layout: [gate; up] stacked in `gate_up_proj` (E × 2I × H),
    `down_proj` E × H × I, no biases, not expert-parallel."""
    return (
        getattr(module, "has_gate", False)
        and getattr(module, "is_concatenated", True)
        and not getattr(module, "is_transposed", False)
        and not getattr(module, "has_bias", False)
        and not getattr(module, "_is_expert_parallel", False)
    )


def sorted_experts_forward(self, hidden_ND, top_k_index_Nk, top_k_weights_Nk):
    """Σ_k w[n,k] · down_e(act(gate_e(x_n)) · up_e(x_n)), e = top_k_index[n,k], with the (token,
    slot) pairs sorted by expert once and one `linear` per expert on its contiguous block.

    Inside autocast each expert's weights come from `expert_views` (one cast per optimizer step;
    each expert's gradient added straight into the fp32 weight's gradient). `linear`'s
    backward writes each expert's weight gradient in the weight's own layout (out × in), where
    `torch._grouped_mm` on a transposed weight returns it transposed and the cast back to fp32
    then strides through memory (29 ms for one layer's gate_up_proj in the real policy's step)."""
    device = hidden_ND.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        gate_up, down = expert_views(self.gate_up_proj, dtype), expert_views(self.down_proj, dtype)
        x_ND = hidden_ND.to(dtype)
    else:
        # unbind, not gate_up[e]: indexing's backward writes a zero tensor of all E experts per expert
        gate_up, down = self.gate_up_proj.unbind(0), self.down_proj.unbind(0)
        x_ND = hidden_ND
    k = top_k_index_Nk.shape[-1]
    flat_S = top_k_index_Nk.reshape(-1)
    order_S = torch.argsort(flat_S, stable=True)
    counts = torch.bincount(flat_S, minlength=self.num_experts).tolist()  # one host sync
    token_S = order_S // k
    # each expert's block padded to a multiple of ROWS rows: oneDNN builds a kernel per matmul shape,
    # and unpadded blocks have a new row count every call (see ROWS)
    padded = [padded_rows(c) for c in counts]
    starts = [sum(padded[:e]) for e in range(len(padded))]
    slot_S = torch.cat(
        [torch.arange(s, s + c, device=hidden_ND.device) for s, c in zip(starts, counts)]
    )
    x_PH = x_ND.new_zeros(sum(padded), x_ND.shape[-1]).index_copy(0, slot_S, x_ND[token_S])
    outs = []
    for e, x_CH in enumerate(x_PH.split(padded)):
        if padded[e]:
            gate, up = torch.nn.functional.linear(x_CH, gate_up[e]).chunk(2, dim=-1)
            outs.append(torch.nn.functional.linear(self.act_fn(gate) * up, down[e]))
    y_SH = torch.cat(outs)[slot_S] * top_k_weights_Nk.reshape(-1)[order_S, None]
    out_NH = torch.zeros(hidden_ND.shape, dtype=y_SH.dtype, device=hidden_ND.device)
    return out_NH.index_add_(0, token_S, y_SH).to(hidden_ND.dtype)


def autocast_grouped_mm_forward(self, hidden_states, top_k_index, top_k_weights):
    """`sorted_experts_forward` inside autocast for the plain layout; transformers' grouped-mm
    forward otherwise (with the weights cast inside autocast)."""
    from transformers.integrations.moe import grouped_mm_experts_forward

    device = hidden_states.device.type
    if torch.is_autocast_enabled(device):
        if _plain_layout(self):
            return sorted_experts_forward(self, hidden_states, top_k_index, top_k_weights)
        dtype = torch.get_autocast_dtype(device)
        if self.down_proj.dtype != dtype:
            self = _CastWeights(self, dtype)
    return grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)


def use_autocast_experts(model: torch.nn.Module) -> bool:
    """Switch `model`'s fused experts (if it has any that transformers dispatches) to
    `autocast_grouped_mm_forward`; returns whether it did."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    config = getattr(model, "config", None)
    if getattr(config, "_experts_implementation", None) != "grouped_mm" or not hasattr(
        model, "set_experts_implementation"
    ):
        return False  # no dispatched experts, or another implementation chosen on purpose
    if KEY not in ALL_EXPERTS_FUNCTIONS:
        ALL_EXPERTS_FUNCTIONS.register(KEY, autocast_grouped_mm_forward)
    model.set_experts_implementation(KEY)
    return True


def casts_cached_over(items):
    """`items`, iterated inside `casts_cached()` (the learner's micro-batches of one optimizer step)."""
    with casts_cached():
        yield from items

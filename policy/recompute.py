"""`recompute(fn, inputs, params)`: fn's outputs without keeping its intermediates for backward.

fn runs under no_grad; the backward pass runs it again from the saved inputs and takes the
gradients of the inputs and of `params` (the parameters fn reads: they are not fn's arguments, so
they are named here to receive their gradients). What torch.utils.checkpoint does, minus its first
call's import of torch._dynamo (~150 MB resident and ~900 modules on this machine), and limited to
what the policy needs: fn is deterministic and returns a tensor or a tuple of tensors.
"""

from __future__ import annotations

import torch


def recompute(fn, inputs: tuple, params: list) -> torch.Tensor | tuple:
    return _Recompute.apply(fn, len(inputs), *inputs, *params)


class _Recompute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn, n: int, *args):
        ctx.fn, ctx.params = fn, args[n:]
        ctx.save_for_backward(*args[:n])
        with torch.no_grad():
            return fn(*args[:n])

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *douts):
        inputs = [t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors]
        with torch.enable_grad():
            outs = ctx.fn(*inputs)
        outs = outs if isinstance(outs, tuple) else (outs,)
        every = inputs + list(ctx.params)
        wrt = [t for t in every if t.requires_grad]
        used = [(o, d) for o, d in zip(outs, douts) if o.requires_grad]
        grads = iter(
            torch.autograd.grad([o for o, _ in used], wrt, [d for _, d in used], allow_unused=True)
        )
        return (None, None, *(next(grads) if t.requires_grad else None for t in every))

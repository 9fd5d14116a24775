"""RMSNorm, computed in fp32 and cast back, with a hand-written backward."""

from __future__ import annotations

import torch
from torch import nn


def upcast(x: torch.Tensor) -> torch.Tensor:
    """At least fp32 (float64 stays float64, so reference checks can run in double)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """x / rms(x) · weight over the last dim, in fp32, returned in x's dtype."""
    return _RMSNorm.apply(x, weight, eps)


class _RMSNorm(torch.autograd.Function):
    """Saves x (its own dtype) and 1/rms per row; autograd through the formula would keep an fp32
    copy of x and the normalised x as well (two more widths per token for every norm)."""

    @staticmethod
    def forward(ctx, x, weight, eps: float):
        xf = upcast(x)
        r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, r)
        return (xf * r * upcast(weight)).to(x.dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        x, weight, r = ctx.saved_tensors
        n = upcast(x) * r
        dyf = upcast(dy)
        dn = dyf * upcast(weight)
        dx = r * (dn - n * (dn * n).mean(-1, keepdim=True))
        dw = (dyf * n).reshape(-1, n.shape[-1]).sum(0)
        return dx.to(x.dtype), dw.to(weight.dtype), None


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

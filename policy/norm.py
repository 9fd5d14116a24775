"""RMSNorm (computed in fp32, cast back) and the parameter-free variant AttnRes keys use."""

from __future__ import annotations

import torch
from torch import nn


def upcast(x: torch.Tensor) -> torch.Tensor:
    """At least fp32 (float64 stays float64, so reference checks can run in double)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def rms_norm(x: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    xf = upcast(x)
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (rms_norm(x, self.eps) * upcast(self.weight)).to(x.dtype)

"""Gated MLA — multi-head latent attention with a sigmoid output gate.

    c_Q = RMSNorm(W_DQ x);  [q_nope_h ; q_rope_h] = W_UQ,h c_Q          (or a full-rank W_Q)
    [c_KV ; k_rope] = W_DKV x;  c_KV ← RMSNorm(c_KV);  [k_nope_h ; v_h] = W_UKV,h c_KV
    k_h = [k_nope_h ; k_rope]   (k_rope shared by all heads; RoPE on the rope parts, or NoPE)
    o_h = softmax(q_h k_hᵀ / sqrt(nope + rope), causal) v_h
    y   = W_O [o ⊙ sigmoid(W_G x)]        (elementwise gate per head channel, "G1")

The cache holds only c_KV and k_rope per token (kv_lora + rope values). Two equal forms:
- naive: expand k_nope, v for every cached token through W_UKV;
- absorbed (decoding): fold W_UK into the query, score against c_KV directly, apply W_UV after the
  weighted sum. With the gate, W_UV cannot fold into W_O (the gate sits between them).

Batched decoding of sequences of different lengths (the native engine, rollout/engines/native.py)
left-pads the cache: `MLACache.pad` holds each row's padding slots, which no query attends to and
which do not count as positions (RoPE uses the row's own positions).

Not covered: paged/preallocated caches (the cache grows by concatenation), sliding windows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from policy.args import MLAArgs
from policy.norm import RMSNorm, upcast


@dataclass
class MLACache:
    c_kv: torch.Tensor | None = None  # B × T × kv_lora (normed latent)
    k_rope: torch.Tensor | None = None  # B × T × rope (rotated when RoPE is on)
    pad: torch.Tensor | None = (
        None  # B, long: left-padding slots per row (batched decoding); None = no padding
    )

    @property
    def length(self) -> int:
        return 0 if self.c_kv is None else self.c_kv.shape[1]


def rope(x_BTHR: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate pairs of channels by position; `pos` is T (shared by the rows) or B × T."""
    R = x_BTHR.shape[-1]
    inv = theta ** (-torch.arange(0, R, 2, dtype=torch.float64, device=x_BTHR.device) / R)
    dt = torch.promote_types(x_BTHR.dtype, torch.float32)
    ang = (pos.double()[..., None] * inv).to(dt)  # (B ×) T × R/2
    if ang.dim() == 2:
        ang = ang[None]
    cos, sin = ang.cos()[:, :, None, :], ang.sin()[:, :, None, :]
    x1, x2 = x_BTHR.to(dt)[..., 0::2], x_BTHR.to(dt)[..., 1::2]
    out = torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)
    return out.to(x_BTHR.dtype)


class GatedMLA(nn.Module):
    def __init__(self, dim: int, a: MLAArgs, eps: float = 1e-5):
        super().__init__()
        self.a = a
        H = a.n_heads
        qk = a.qk_nope_head_dim + a.qk_rope_head_dim
        if a.q_lora_rank:
            self.wq_a = nn.Linear(dim, a.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(a.q_lora_rank, eps)
            self.wq_b = nn.Linear(a.q_lora_rank, H * qk, bias=False)
        else:
            self.wq = nn.Linear(dim, H * qk, bias=False)
        self.wkv_a = nn.Linear(dim, a.kv_lora_rank + a.qk_rope_head_dim, bias=False)
        self.kv_norm = RMSNorm(a.kv_lora_rank, eps)
        self.wkv_b = nn.Linear(a.kv_lora_rank, H * (a.qk_nope_head_dim + a.v_head_dim), bias=False)
        self.w_gate = nn.Linear(dim, H * a.v_head_dim, bias=False)
        self.wo = nn.Linear(H * a.v_head_dim, dim, bias=False)
        self.scale = 1.0 / math.sqrt(qk)

    def _q(self, x):
        return self.wq_b(self.q_norm(self.wq_a(x))) if self.a.q_lora_rank else self.wq(x)

    def forward(
        self,
        x_BTD,
        cache: MLACache | None = None,
        absorbed: bool | None = None,
        fused: bool | None = None,
    ):
        """`cache` is extended in place when given. `absorbed` picks the form (default: absorbed
        when decoding one token against a cache, naive otherwise). `fused=False` forces the
        explicit softmax in the naive form (the reference the fused path is tested against)."""
        a = self.a
        B, T, _ = x_BTD.shape
        H, N, R, Vd = a.n_heads, a.qk_nope_head_dim, a.qk_rope_head_dim, a.v_head_dim
        start = cache.length if cache is not None else 0
        pos = torch.arange(start, start + T, device=x_BTD.device)  # cache slots of the new tokens
        pad = cache.pad if cache is not None else None
        rope_pos = pos if pad is None else pos[None, :] - pad[:, None]  # the rows' own positions

        q = self._q(x_BTD).view(B, T, H, N + R)
        q_nope, q_rope = q[..., :N], q[..., N:]
        ckv = self.wkv_a(x_BTD)
        c_new, kr_new = self.kv_norm(ckv[..., : a.kv_lora_rank]), ckv[..., a.kv_lora_rank :]
        if a.rope and R:
            q_rope = rope(q_rope, rope_pos, a.rope_theta)
            kr_new = rope(kr_new[:, :, None, :], rope_pos, a.rope_theta)[:, :, 0]
        if cache is not None:
            cache.c_kv = c_new if cache.c_kv is None else torch.cat([cache.c_kv, c_new], 1)
            cache.k_rope = kr_new if cache.k_rope is None else torch.cat([cache.k_rope, kr_new], 1)
            c_all, kr_all = cache.c_kv, cache.k_rope
        else:
            c_all, kr_all = c_new, kr_new
        S = c_all.shape[1]

        use_absorbed = absorbed if absorbed is not None else (cache is not None and T == 1)
        if use_absorbed:
            w = self.wkv_b.weight.view(H, N + Vd, a.kv_lora_rank)
            w_uk, w_uv = w[:, :N], w[:, N:]
            q_lat = torch.einsum("bthn,hnc->bthc", q_nope, w_uk)
            scores = torch.einsum("bthc,bsc->bhts", q_lat, c_all) + torch.einsum(
                "bthr,bsr->bhts", q_rope, kr_all
            )
            p = self._softmax(scores, pos, S, pad).to(c_all.dtype)
            o_lat = torch.einsum("bhts,bsc->bhtc", p, c_all)  # weighted sum in the latent space
            o = torch.einsum("bhtc,hvc->bthv", o_lat, w_uv)
        else:
            kv = self.wkv_b(c_all).view(B, S, H, N + Vd)
            k_nope, v = kv[..., :N], kv[..., N:]
            if start == 0 and pad is None and fused is not False:
                # No earlier context: plain causal attention, through torch's fused SDPA (flash
                # kernel on CPU too: memory linear in length, which long trajectories need).
                # The CPU flash kernel needs equal q/k and v widths (else a T×T math fallback):
                # pad v with zeros and drop those output channels.
                k_full = torch.cat([k_nope, kr_all[:, :, None, :].expand(B, S, H, R)], -1)
                q_full = torch.cat([q_nope, q_rope], -1)
                v_pad = F.pad(v, (0, max(0, N + R - Vd)))
                o = F.scaled_dot_product_attention(
                    q_full.transpose(1, 2),
                    k_full.transpose(1, 2),
                    v_pad.transpose(1, 2),
                    is_causal=True,
                    scale=self.scale,
                ).transpose(1, 2)[..., :Vd]
            else:
                scores = torch.einsum("bthn,bshn->bhts", q_nope, k_nope) + torch.einsum(
                    "bthr,bsr->bhts", q_rope, kr_all
                )
                p = self._softmax(scores, pos, S, pad).to(v.dtype)
                o = torch.einsum("bhts,bshv->bthv", p, v)
        o = o * torch.sigmoid(self.w_gate(x_BTD)).view(B, T, H, Vd)
        return self.wo(o.reshape(B, T, H * Vd))

    def _softmax(self, scores_BHTS, pos_T, S: int, pad_B=None):
        slots_S = torch.arange(S, device=pos_T.device)
        # causal, T × S (only where scores are T × S anyway)
        keep = slots_S[None, :] <= pos_T[:, None]
        if pad_B is not None:  # and never a row's left padding: B × 1 × T × S
            keep = keep[None, None] & (slots_S[None, :] >= pad_B[:, None])[:, None, None, :]
        s = (upcast(scores_BHTS) * self.scale).masked_fill(~keep, -math.inf)
        return torch.softmax(s, dim=-1)

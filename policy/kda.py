"""KDA — Kimi Delta Attention: gated delta-rule linear attention with channel-wise decay.

Per head, with state S (d_k × d_v), log decay g_t ≤ 0 per key channel and β_t ∈ (0, 1):

    S_t = (I − β_t k_t k_tᵀ) Diag(e^{g_t}) S_{t−1} + β_t k_t v_tᵀ        o_t = S_tᵀ q_t

`kda_recurrent` runs this token by token (decoding: O(1) state per sequence). `kda_chunked` is the
parallel training form (WY representation): inside a chunk with G = cumsum(g),

    A = strict_tril(β_t Σ_c k_tc k_ic e^{G_tc − G_ic})     T = (I + A)⁻¹ (triangular solve)
    W = T diag(β) (K ⊙ e^G)     U = T diag(β) V     V_new = U − W S
    O = (Q ⊙ e^G) S + tril((Q ⊙ e^G)(K ⊙ e^{−G})ᵀ) V_new
    S ← Diag(e^{G_last}) S + (K ⊙ e^{G_last − G})ᵀ V_new

The products K⊙e^{−G} overflow for strong decay over a chunk (g ≥ −5 per step, 64 steps:
e^{320}); we never form them: within half a chunk of its middle the factors stay below e^{60}
(the factorised form, plain matmuls), and past that the pairwise form builds e^{G_t − G_i} (t ≥ i,
so ≤ 1) directly, a (C × C × d_k) tensor per head and chunk, one chunk after another. With the
safe gate's bound the factorised form holds for every chunk up to 24 steps and is known before
the data is seen: all chunks' intra-chunk work then runs batched and only the state recurrence
goes chunk by chunk (`_kda_factorised_all`).

Not covered: variable-length packing inside one batch row (sequences are separate rows), and
fused kernels (the CUDA/Triton ones in flash-linear-attention are not usable on CPU).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from policy.args import KDAArgs
from policy.norm import RMSNorm, upcast


def kda_recurrent(q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH, S_BHKV=None):
    """Token-by-token reference/decoding form. Returns (o_BTHV, S_BHKV); math in fp32 or wider."""
    dt = torch.promote_types(q_BTHK.dtype, torch.float32)
    B, T, H, K = q_BTHK.shape
    V = v_BTHV.shape[-1]
    S = torch.zeros(B, H, K, V, dtype=dt, device=q_BTHK.device) if S_BHKV is None else S_BHKV.to(dt)
    q, k, v, g, beta = (t.to(dt) for t in (q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH))
    outs = []
    for t in range(T):
        S = S * g[:, t].exp()[..., None]
        pred_BHV = torch.einsum("bhk,bhkv->bhv", k[:, t], S)
        S = S + beta[:, t, :, None, None] * k[:, t, :, :, None] * (v[:, t] - pred_BHV)[:, :, None, :]
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], S))
    return torch.stack(outs, 1), S


# Largest exponent the factorised form may meet (fp32 overflows past e^88).
_MAX_EXP = 60.0


def _needs_pairwise(G_BHLK: torch.Tensor) -> bool:
    """True when the chunk's decay span around its middle is too large to factorise in fp32.
    G is non-increasing along the chunk, so the extremes sit at its two ends."""
    Gm = G_BHLK[:, :, G_BHLK.shape[2] // 2]
    return float(torch.maximum(G_BHLK[:, :, 0] - Gm, Gm - G_BHLK[:, :, -1]).max()) > _MAX_EXP


def _decay_products(qc, kc, G, pairwise: bool):
    """The chunk's C×C decay-weighted products, for t >= i:
    KK_ti = Σ_c k_tc k_ic e^{G_tc − G_ic} and QK_ti = Σ_c q_tc k_ic e^{G_tc − G_ic}.

    Factorised around the chunk's middle G_m as (x ⊙ e^{G−G_m})(k ⊙ e^{G_m−G})ᵀ: plain matmuls.
    The pairwise form builds e^{G_t − G_i} (≤ 1) explicitly, for spans too large to factorise
    (strong decay over long chunks, the unbounded softplus gate): C×C×d_k per head."""
    if not pairwise:
        Gm = G[:, :, G.shape[2] // 2 :][:, :, :1]
        k_down = kc * (Gm - G).exp()
        up = (G - Gm).exp()
        return (kc * up) @ k_down.transpose(2, 3), (qc * up) @ k_down.transpose(2, 3)
    L = qc.shape[2]
    incl = torch.ones(L, L, dtype=torch.bool, device=qc.device).tril()
    decay = (G[:, :, :, None, :] - G[:, :, None, :, :]).masked_fill(~incl[:, :, None], -math.inf).exp()
    return (torch.einsum("bhtk,bhik,bhtik->bhti", kc, kc, decay),
            torch.einsum("bhtk,bhik,bhtik->bhti", qc, kc, decay))


def _kda_chunk(qc, kc, vc, G, bc, S, pairwise: bool = False):
    """One chunk (heads first: B H L ·) from state S, with G the chunk's inclusive cumulative log
    decay; returns (o, new S)."""
    L, K = qc.shape[2], qc.shape[3]
    kk, qk = _decay_products(qc, kc, G, pairwise)
    causal = torch.ones(L, L, dtype=torch.bool, device=qc.device).tril()
    A = (kk * bc[..., None]).tril(-1)
    eye = torch.eye(L, dtype=qc.dtype, device=qc.device)
    rhs = bc[..., None] * torch.cat([kc * G.exp(), vc], dim=-1)
    X = torch.linalg.solve_triangular(eye + A, rhs, upper=False, unitriangular=True)
    W, U = X[..., :K], X[..., K:]
    V_new = U - W @ S
    o = (qc * G.exp()) @ S + qk.masked_fill(~causal, 0.0) @ V_new
    G_last = G[:, :, -1:, :]  # B H 1 K
    S = G_last.transpose(2, 3).exp() * S + (kc * (G_last - G).exp()).transpose(2, 3) @ V_new
    return o, S


def _kda_factorised_all(q, k, v, g, beta, S, C: int):
    """Every chunk in the factorised form at once (heads first: B H T ·): the intra-chunk work —
    decay products, the triangular solve, W and U — is batched over all chunks, and only the state
    recurrence runs chunk after chunk (two small matmuls in, one out). The tail is padded with
    steps that change nothing (k = v = q = 0, β = 0, g = 0). Returns (o, S)."""
    B, H, T, K = q.shape
    V = v.shape[-1]
    pad = (-T) % C
    if pad:
        q, k, v, g = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v, g))
        beta = F.pad(beta, (0, pad))
    N = (T + pad) // C
    qc, kc, gc = (t.reshape(B, H, N, C, K) for t in (q, k, g))
    vc, bc = v.reshape(B, H, N, C, V), beta.reshape(B, H, N, C)
    G = gc.cumsum(3)
    Gm = G[:, :, :, C // 2 : C // 2 + 1]
    up, k_down = (G - Gm).exp(), kc * (Gm - G).exp()
    kk, qk = (kc * up) @ k_down.transpose(3, 4), (qc * up) @ k_down.transpose(3, 4)
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    A = (kk * bc[..., None]).tril(-1)
    eye = torch.eye(C, dtype=q.dtype, device=q.device)
    X = torch.linalg.solve_triangular(eye + A, bc[..., None] * torch.cat([kc * G.exp(), vc], -1), upper=False,
                                      unitriangular=True)
    W, U = X[..., :K], X[..., K:]
    Qg, QK = qc * G.exp(), qk.masked_fill(~causal, 0.0)
    G_last = G[:, :, :, -1:]
    carry, K_out = G_last.transpose(3, 4).exp(), (kc * (G_last - G).exp()).transpose(3, 4)  # B H N K 1, B H N K C
    outs = []
    for n in range(N):  # the only sequential part: the state from chunk to chunk
        V_new = U[:, :, n] - W[:, :, n] @ S
        outs.append(Qg[:, :, n] @ S + QK[:, :, n] @ V_new)
        S = carry[:, :, n] * S + K_out[:, :, n] @ V_new
    return torch.cat(outs, 2)[:, :, :T], S


def factorisable(chunk_size: int, step_bound: float | None) -> bool | None:
    """Whether every chunk can take the factorised form, decided before any data is seen: yes when
    the per-step log decay is bounded by `step_bound` (the safe gate: |g_min|) and half a chunk of
    it stays within _MAX_EXP; no when bounded but too long; None (decide per chunk, from the data)
    for an unbounded gate."""
    if step_bound is None:
        return None
    return (chunk_size - chunk_size // 2) * step_bound <= _MAX_EXP


def kda_chunked(q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH, S_BHKV=None, chunk_size: int = 16,
                step_bound: float | None = None):
    """Chunk-parallel form; equals `kda_recurrent` to float tolerance. Returns (o_BTHV, S_BHKV).

    `step_bound`: the largest |g| a step can have (the safe gate's |g_min|). Given, the form is
    chosen once for every chunk (`factorisable`): no look at the data, so no host sync per chunk
    (which also kept the loop from `torch.compile`). Without it (the softplus gate is unbounded)
    each chunk is checked. A chunk that needs the pairwise form is recomputed in the backward pass
    (activation checkpointing) rather than keeping its C×C×d_k tensors for the whole sequence."""
    static = factorisable(chunk_size, step_bound)
    dt = torch.promote_types(q_BTHK.dtype, torch.float32)
    B, T, H, K = q_BTHK.shape
    V = v_BTHV.shape[-1]
    # heads first: (B, H, T, ·)
    q, k, v, g = (t.to(dt).transpose(1, 2) for t in (q_BTHK, k_BTHK, v_BTHV, g_BTHK))
    beta = beta_BTH.to(dt).transpose(1, 2)
    S = torch.zeros(B, H, K, V, dtype=dt, device=q.device) if S_BHKV is None else S_BHKV.to(dt)
    if static:  # every chunk factorised: their intra-chunk work batched, the state chunk by chunk
        o, S = _kda_factorised_all(q, k, v, g, beta, S, chunk_size)
        return o.transpose(1, 2), S
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, g, beta, S))
    outs = []
    # split, not slice: the backward of a slice writes into a zero tensor of the full length, which
    # would make the backward quadratic in the number of chunks
    for qc, kc, vc, gc, bc in zip(*(t.split(chunk_size, dim=2) for t in (q, k, v, g, beta))):
        G = gc.cumsum(2)  # inclusive, once per chunk: decides the form and feeds it
        chunk = (qc, kc, vc, G, bc)
        if static is None:
            with torch.no_grad():
                pairwise = _needs_pairwise(G)
        else:
            pairwise = not static
        if pairwise and grad:
            o, S = torch.utils.checkpoint.checkpoint(_kda_chunk, *chunk, S, True, use_reentrant=False)
        else:
            o, S = _kda_chunk(*chunk, S, pairwise)
        outs.append(o)
    return torch.cat(outs, 2).transpose(1, 2), S


def causal_conv(x_BTC, weight_C1W, state_BCW=None):
    """Depthwise causal conv + SiLU; returns the output and the last W−1 inputs (the conv state)."""
    B, T, C = x_BTC.shape
    W = weight_C1W.shape[-1]
    x = x_BTC.transpose(1, 2)
    pad = x.new_zeros(B, C, W - 1) if state_BCW is None else state_BCW.to(x.dtype)
    xx = torch.cat([pad, x], dim=-1)
    y = F.conv1d(xx, weight_C1W, groups=C)
    return F.silu(y).transpose(1, 2), xx[..., xx.shape[-1] - (W - 1) :]


@dataclass
class KDAState:
    """Per-layer decoding state: three conv states and the fp32 recurrent state."""

    conv_q: torch.Tensor | None = None
    conv_k: torch.Tensor | None = None
    conv_v: torch.Tensor | None = None
    S: torch.Tensor | None = None


def safe_gate_bias(A_log_H: torch.Tensor, head_dim: int, g_min: float, decay=(0.90, 0.99)) -> torch.Tensor:
    """dt_bias (H·K) for the safe gate g = g_min·σ(e^{A_log}·(f + dt_bias)) such that with f = 0 each
    channel's per-step decay e^g is drawn log-uniformly in `decay` (as Mamba draws its dt): a layer
    that remembers from the start. A zero bias would give e^{g_min/2} ≈ 0.08 per step, nearly
    memoryless."""
    H = A_log_H.shape[0]
    lo, hi = (math.log(-math.log(d)) for d in (decay[1], decay[0]))  # -log(decay) between these, log-uniform
    minus_g = torch.empty(H, head_dim, dtype=torch.float64).uniform_(lo, hi).exp()
    p = (minus_g / -g_min).clamp(1e-12, 1 - 1e-12)  # σ(·) = g / g_min
    return (torch.log(p / (1 - p)) / A_log_H.double().exp()[:, None]).reshape(-1).to(A_log_H.dtype)


FP32_PARAMS = ("A_log", "dt_bias")
"""KDA parameters kept in fp32 (whatever the model's dtype) and trained without weight decay."""


class KDA(nn.Module):
    def __init__(self, dim: int, a: KDAArgs, eps: float = 1e-5):
        super().__init__()
        self.a = a
        H, K = a.n_heads, a.head_dim
        HK = H * K
        self.q_proj = nn.Linear(dim, HK, bias=False)
        self.k_proj = nn.Linear(dim, HK, bias=False)
        self.v_proj = nn.Linear(dim, HK, bias=False)
        self.q_conv = nn.Parameter(torch.empty(HK, 1, a.conv_size))
        self.k_conv = nn.Parameter(torch.empty(HK, 1, a.conv_size))
        self.v_conv = nn.Parameter(torch.empty(HK, 1, a.conv_size))
        self.beta_proj = nn.Linear(dim, H, bias=False)
        self.f_a = nn.Linear(dim, K, bias=False)  # low-rank decay projection d -> d_k -> H*d_k
        self.f_b = nn.Linear(K, HK, bias=False)
        self.A_log = nn.Parameter(torch.empty(H))  # kept fp32, no weight decay (see policy/README)
        self.dt_bias = nn.Parameter(torch.empty(HK))
        if a.gate_rank:
            self.g_proj = nn.Sequential(nn.Linear(dim, a.gate_rank, bias=False), nn.Linear(a.gate_rank, HK, bias=False))
        else:
            self.g_proj = nn.Linear(dim, HK, bias=False)
        self.o_norm = RMSNorm(K, eps)
        self.o_proj = nn.Linear(HK, dim, bias=False)
        self.reset_parameters()

    def reset_parameters(self):
        for w in (self.q_conv, self.k_conv, self.v_conv):
            nn.init.normal_(w, 0.0, 1.0 / math.sqrt(self.a.conv_size))
        with torch.no_grad():
            self.A_log.copy_(torch.empty_like(self.A_log).uniform_(1, 16).log())
            if self.a.gate == "safe":
                self.dt_bias.copy_(safe_gate_bias(self.A_log.float(), self.a.head_dim, self.a.g_min))
            else:  # Kimi Linear's: softplus(f + 0), scaled by e^{A_log}
                self.dt_bias.zero_()

    def decay(self, x_BTD):
        """Per-step log decay g (B, T, H, K), fp32, in the configured form."""
        H, K = self.a.n_heads, self.a.head_dim
        f = upcast(self.f_b(self.f_a(x_BTD))).view(*x_BTD.shape[:2], H, K) + upcast(self.dt_bias).view(H, K)
        A = upcast(self.A_log).exp()[:, None]
        if self.a.gate == "softplus":
            return -A * F.softplus(f)
        return self.a.g_min * torch.sigmoid(A * f)

    def forward(self, x_BTD, state: KDAState | None = None, recurrent: bool | None = None):
        """`state` is read and updated in place when given (decoding); `recurrent` forces a form
        (default: recurrent for a single token, chunked otherwise)."""
        B, T, _ = x_BTD.shape
        H, K = self.a.n_heads, self.a.head_dim
        st = state or KDAState()
        q, cq = causal_conv(self.q_proj(x_BTD), self.q_conv, st.conv_q)
        k, ck = causal_conv(self.k_proj(x_BTD), self.k_conv, st.conv_k)
        v, cv = causal_conv(self.v_proj(x_BTD), self.v_conv, st.conv_v)
        q = F.normalize(upcast(q.view(B, T, H, K)), dim=-1, eps=1e-6) * K**-0.5
        k = F.normalize(upcast(k.view(B, T, H, K)), dim=-1, eps=1e-6)
        v = v.view(B, T, H, K)
        beta = torch.sigmoid(upcast(self.beta_proj(x_BTD)))
        g = self.decay(x_BTD)
        if recurrent if recurrent is not None else T == 1:
            o, S = kda_recurrent(q, k, v, g, beta, st.S)
        else:
            bound = -self.a.g_min if self.a.gate == "safe" else None  # the softplus gate is unbounded
            o, S = kda_chunked(q, k, v, g, beta, st.S, self.a.chunk_size, step_bound=bound)
        if state is not None:
            state.conv_q, state.conv_k, state.conv_v, state.S = cq, ck, cv, S
        o = self.o_norm(o.to(x_BTD.dtype)) * torch.sigmoid(self.g_proj(x_BTD)).view(B, T, H, K)
        return self.o_proj(o.reshape(B, T, H * K))

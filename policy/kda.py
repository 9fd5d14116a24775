"""KDA — Kimi Delta Attention: gated delta-rule linear attention with channel-wise decay.

Per head, with state S (d_k × d_v), log decay g_t ≤ 0 per key channel and β_t ∈ (0, 1):

    S_t = (I − β_t k_t k_tᵀ) Diag(e^{g_t}) S_{t−1} + β_t k_t v_tᵀ        o_t = S_tᵀ q_t

`kda_recurrent` runs this token by token (decoding: O(1) state per sequence). `kda_chunked` is the
parallel training form (WY representation): inside a chunk with G = cumsum(g),

    A = strict_tril(β_t Σ_c k_tc k_ic e^{G_tc − G_ic})     T = (I + A)⁻¹ (triangular solve)
    W = T diag(β) (K ⊙ e^G)     U = T diag(β) V     V_new = U − W S
    O = (Q ⊙ e^G) S + tril((Q ⊙ e^G)(K ⊙ e^{−G})ᵀ) V_new
    S ← Diag(e^{G_last}) S + (K ⊙ e^{G_last − G})ᵀ V_new

Everything but the last line depends on the chunk alone, so it runs for all chunks at once
(`_intra`); only the state goes chunk after chunk, as S ← M S + b with M = Diag(e^{G_last}) − K_out W
(one small matmul per chunk, `_scan`). The backward pass runs that recurrence in reverse
(dS ← Mᵀ dS + c) and recomputes the intra-chunk work segment by segment: autograd keeps only the
inputs and the state at each chunk's start (`_KDAChunked`), not the ~20 intermediates per token of
the chunk form.

The products K ⊙ e^{−G} overflow for strong decay over a chunk (g ≥ −5 per step, 64 steps:
e^{320}); we never form them. A chunk is cut into sub-chunks of ≤ 16 steps: between sub-chunks the
C×C products factorise around the end of the earlier one (both factors e^{≤0}); within one they
factorise around its middle, which stays below e^{60} for the safe gate (8 steps × 5), else
(an unbounded gate with a large span, checked once per call) the pairwise form builds e^{G_t − G_i}
(t ≥ i, so ≤ 1) directly, s × s × d_k per sub-chunk.

Not covered: variable-length packing inside one batch row (sequences are separate rows), and
fused kernels (the CUDA/Triton ones in flash-linear-attention are not usable on CPU).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from policy.args import SUB_CHUNK, KDAArgs
from policy.norm import RMSNorm, upcast
from policy.recompute import recompute


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
        S = (
            S
            + beta[:, t, :, None, None] * k[:, t, :, :, None] * (v[:, t] - pred_BHV)[:, :, None, :]
        )
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], S))
    return torch.stack(outs, 1), S


# Largest exponent a factorised product may meet (fp32 overflows past e^88).
_MAX_EXP = 60.0
# Elements (batch × tokens × heads × d_k) per segment of the chunk form, forward and the backward's
# recompute: bounds the intra-chunk intermediates alive at once, whatever the sequence length
# (8K tokens at the debug flavour's 2 × 16, 1K at K3's head dim 128 with 2 heads).
_SEGMENT_ELEMENTS = 1 << 18


def factorisable(chunk_size: int, step_bound: float | None) -> bool | None:
    """Whether every sub-chunk's diagonal block can take the factorised form, decided before any
    data is seen: yes when the per-step log decay is bounded by `step_bound` (the safe gate: |g_min|)
    and half a sub-chunk of it stays within _MAX_EXP; no when bounded but too strong; None (decided
    from the data, once per call) for an unbounded gate."""
    if step_bound is None:
        return None
    s = min(chunk_size, SUB_CHUNK)
    return (s - s // 2) * step_bound <= _MAX_EXP


def _diag_span(g_BTHK: torch.Tensor, s: int) -> float:
    """Largest exponent the factorised diagonal blocks would meet on this data (one host sync)."""
    B, T, H, K = g_BTHK.shape
    G = F.pad(g_BTHK.detach(), (0, 0, 0, 0, 0, (-T) % s)).reshape(B, -1, s, H, K).cumsum(2)
    Gm = G[:, :, s // 2]
    return float(torch.maximum(G[:, :, 0] - Gm, Gm - G[:, :, -1]).max())


def _chunks(x_BTH_, C: int) -> torch.Tensor:
    """(B, T, H[, ·]) → (N, B, H, C[, ·]), contiguous; the tail padded with steps that change nothing
    (q = k = v = 0, β = 0, g = 0)."""
    B, T, H = x_BTH_.shape[:3]
    x = x_BTH_.reshape(B, T, H, -1)
    x = (
        F.pad(x, (0, 0, 0, 0, 0, (-T) % C))
        .reshape(B, -1, C, H, x.shape[-1])
        .permute(1, 0, 3, 2, 4)
        .contiguous()
    )
    return x if x_BTH_.dim() == 4 else x.squeeze(-1)


def _unchunk(y_NBHC_: torch.Tensor, T: int) -> torch.Tensor:
    """`_chunks` undone: (N, B, H, C[, ·]) → (B, T, H[, ·]), the padding dropped."""
    y = y_NBHC_ if y_NBHC_.dim() == 5 else y_NBHC_[..., None]
    N, B, H, C = y.shape[:4]
    x = y.permute(1, 0, 3, 2, 4).reshape(B, N * C, H, -1)[:, :T]
    return x if y_NBHC_.dim() == 5 else x.squeeze(-1)


def _products(x, k, G, s: int, pairwise: bool) -> torch.Tensor:
    """The chunks' C×C decay-weighted products Σ_c x_tc k_ic e^{G_tc − G_ic}, valid for t ≥ i
    (the rest is left unspecified); x may carry extra leading dims (k and q stacked).

    Between sub-chunks, (x_t e^{G_t − G_e})(k_i e^{G_e − G_i}) with e the last step of i's sub-chunk:
    both exponents ≤ 0. Within a sub-chunk, factorised around its middle (exponents ≤ _MAX_EXP when
    `factorisable`) or, `pairwise`, with e^{G_t − G_i} built for each pair (s × s × d_k)."""
    C = G.shape[-2]
    m = C // s
    xs, ks, Gs = (t.unflatten(-2, (m, s)) for t in (x, k, G))  # (..., m, s, K)
    if pairwise:
        incl = torch.ones(s, s, dtype=torch.bool, device=G.device).tril()
        decay = (
            (Gs[..., :, None, :] - Gs[..., None, :, :])
            .masked_fill(~incl[:, :, None], -math.inf)
            .exp()
        )
        D = torch.einsum("...tk,...ik,...tik->...ti", xs, ks, decay)
    else:
        Gm = Gs[..., s // 2 : s // 2 + 1, :]
        D = (xs * (Gs - Gm).exp()) @ (ks * (Gm - Gs).exp()).transpose(-1, -2)  # (..., m, s, s)
    if m == 1:
        return D.squeeze(-3)
    cols = []
    for b in range(m):  # column sub-chunk b: zeros above, its diagonal block, the later rows below
        parts = [D.new_zeros(*D.shape[:-3], b * s, s)] if b else []
        parts.append(D[..., b, :, :])
        if b < m - 1:
            Ge = Gs[..., b, -1:, :]
            rows = x[..., (b + 1) * s :, :] * (G[..., (b + 1) * s :, :] - Ge).exp()
            parts.append(
                rows @ (ks[..., b, :, :] * (Ge - Gs[..., b, :, :]).exp()).transpose(-1, -2)
            )
        cols.append(torch.cat(parts, -2))
    return torch.cat(cols, -1)


def _intra(q, k, v, g, beta, s: int, pairwise: bool):
    """What each chunk contributes on its own, for all chunks at once (layout N B H C ·):
    W, U (C × d_k, C × d_v), Q⊙e^G, the causal decayed QK (C × C), the chunk's decay e^{G_last}
    (d_k) and K_out = (K ⊙ e^{G_last − G})ᵀ (d_k × C)."""
    C, K = q.shape[-2:]
    G = g.cumsum(-2)
    kk, qk = _products(torch.stack([k, q]), k, G, s, pairwise).unbind(0)
    # unitriangular: the solve takes I + A's unit diagonal as read
    A = (kk * beta[..., None]).tril(-1)
    X = torch.linalg.solve_triangular(
        A, beta[..., None] * torch.cat([k * G.exp(), v], -1), upper=False, unitriangular=True
    )
    G_last = G[..., -1:, :]
    return (
        X[..., :K],
        X[..., K:],
        q * G.exp(),
        qk.tril(),
        G_last.squeeze(-2).exp(),
        (k * (G_last - G).exp()).transpose(-1, -2),
    )


def _transition(W, carry, K_out):
    """M with S_next = M S + K_out U: Diag(e^{G_last}) − K_out W, per chunk."""
    return torch.diag_embed(carry) - K_out @ W


def _scan(M, b, S):
    """The state at each chunk's start and after the last: S_{n+1} = M_n S_n + b_n (N+1, B, H, K, V)."""
    N = M.shape[0]
    out = S.new_empty(N + 1, *S.shape)
    out[0] = S
    M3, b3, out3 = (
        M.flatten(1, 2),
        b.flatten(1, 2),
        out.flatten(1, 2),
    )  # (·, B·H, ·, ·): one bmm a step
    for n in range(N):
        torch.baddbmm(b3[n], M3[n], out3[n], out=out3[n + 1])
    return out


def _segments(T: int, C: int, width: int):
    """Token ranges [t0, t1) of whole chunks, `width` = batch × heads × max(d_k, d_v) per token."""
    step = max(C, _SEGMENT_ELEMENTS // width // C * C)
    return [(t0, min(t0 + step, T)) for t0 in range(0, T, step)]


class _KDAChunked(torch.autograd.Function):
    """The chunk form with a hand-written backward for the state recurrence. Saves the inputs and the
    state at each segment's start; the backward recomputes, a segment at a time, the intra-chunk
    work (autograd runs through `_intra` alone) and the chunks' states (d_k·d_v per chunk and head:
    at head dim 128 and chunk 64 that alone would be twice q's width per token)."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, S0, C: int, s: int, pairwise: bool):
        B, T, H, K = q.shape
        segments = _segments(T, C, B * H * max(K, v.shape[-1]))
        outs, starts, S = [], [], S0
        for t0, t1 in segments:
            W, U, Qg, QK, carry, K_out = _intra(
                *_segment((q, k, v, g, beta), t0, t1, C, S0.dtype), s, pairwise
            )
            S_all = _scan(_transition(W, carry, K_out), K_out @ U, S)
            S_in = S_all[:-1]
            outs.append(_unchunk(Qg @ S_in + QK @ (U - W @ S_in), t1 - t0))
            starts.append(S)
            S = S_all[-1]
        ctx.save_for_backward(q, k, v, g, beta, torch.stack(starts))
        ctx.args = (C, s, pairwise, segments)
        return torch.cat(outs, 1), S.clone()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dO_BTHV, dS_BHKV):
        q, k, v, g, beta, starts = ctx.saved_tensors
        C, s, pairwise, segments = ctx.args
        inputs = (q, k, v, g, beta)
        grads = [torch.zeros_like(t) for t in inputs]
        dS = dS_BHKV.contiguous()
        for i in reversed(range(len(segments))):
            t0, t1 = segments[i]
            with torch.enable_grad():
                leaves = [t.requires_grad_() for t in _segment(inputs, t0, t1, C, starts.dtype)]
                outs = W, U, Qg, QK, carry, K_out = _intra(*leaves, s, pairwise)
            M = _transition(W, carry, K_out)
            # the chunks' states again, from the segment's start
            S = _scan(M, K_out @ U, starts[i])[:-1]
            dO = _chunks(dO_BTHV[:, t0:t1], C)
            c = Qg.transpose(-1, -2) @ dO - W.transpose(-1, -2) @ (QK.transpose(-1, -2) @ dO)
            # dS_n = M_nᵀ dS_{n+1} + c_n
            dS_all = _scan(M.transpose(-1, -2).flip(0), c.flip(0), dS).flip(0)
            dS_next, dS = dS_all[1:], dS_all[0]
            V_new = U - W @ S
            dV_new = QK.transpose(-1, -2) @ dO + K_out.transpose(-1, -2) @ dS_next
            douts = (
                -dV_new @ S.transpose(-1, -2),
                dV_new,
                dO @ S.transpose(-1, -2),
                dO @ V_new.transpose(-1, -2),
                (dS_next * S).sum(-1),
                dS_next @ V_new.transpose(-1, -2),
            )
            for grad, leaf_grad in zip(grads, torch.autograd.grad(outs, leaves, douts)):
                # in the input's dtype (bf16: rounded once)
                grad[:, t0:t1] = _unchunk(leaf_grad, t1 - t0)
        return (*grads, dS if ctx.needs_input_grad[5] else None, None, None, None)


def _segment(inputs, t0: int, t1: int, C: int, dt: torch.dtype) -> list[torch.Tensor]:
    """Tokens [t0, t1) of each input in chunk layout, in the math dtype `dt` (a bf16 input is
    upcast here, a segment at a time: exact, so the math is fp32's on the bf16 values)."""
    return [_chunks(t[:, t0:t1], C).to(dt) for t in inputs]


def kda_chunked(
    q_BTHK,
    k_BTHK,
    v_BTHV,
    g_BTHK,
    beta_BTH,
    S_BHKV=None,
    chunk_size: int = 16,
    step_bound: float | None = None,
):
    """Chunk-parallel form; equals `kda_recurrent` to float tolerance. Returns (o_BTHV, S_BHKV).

    `chunk_size` ≤ 16 or a multiple of 16 (sub-chunks of 16). `step_bound`: the largest |g| a step
    can have (the safe gate's |g_min|); given, the diagonal blocks' form is chosen once
    (`factorisable`) without looking at the data; without it (the softplus gate is unbounded) the
    data's largest span decides, with one host sync per call.

    bf16 operands: the inputs are kept (and saved for backward) in their own dtype, and each segment
    is upcast as it is computed, so bf16 q, k, v cost autograd half the bytes of fp32 ones while the
    math, the state and the output stay fp32 (exactly the fp32 result on the bf16 values); their
    gradients come back in their dtype. The decay g and β should stay fp32 (the decay's cumulative
    sums over a chunk would lose their small steps in bf16), as `KDA.inputs` gives them."""
    if chunk_size < 1 or (chunk_size > SUB_CHUNK and chunk_size % SUB_CHUNK):
        raise ValueError(
            f"chunk_size {chunk_size}: must be <= {SUB_CHUNK} or a multiple of {SUB_CHUNK}"
        )
    q, k, v, g, beta = q_BTHK, k_BTHK, v_BTHV, g_BTHK, beta_BTH
    dt = torch.float32
    for t in (q, k, v, g, beta):
        dt = torch.promote_types(dt, t.dtype)
    B, T, H, K = q.shape
    S = (
        torch.zeros(B, H, K, v.shape[-1], dtype=dt, device=q.device)
        if S_BHKV is None
        else S_BHKV.to(dt)
    )
    s = min(chunk_size, SUB_CHUNK)
    static = factorisable(chunk_size, step_bound)
    pairwise = (not static) if static is not None else _diag_span(g, s) > _MAX_EXP
    return _KDAChunked.apply(q, k, v, g, beta, S, chunk_size, s, pairwise)


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


def safe_gate_bias(
    A_log_H: torch.Tensor, head_dim: int, g_min: float, decay=(0.90, 0.99)
) -> torch.Tensor:
    """dt_bias (H·K) for the safe gate g = g_min·σ(e^{A_log}·(f + dt_bias)) such that with f = 0 each
    channel's per-step decay e^g is drawn log-uniformly in `decay` (as Mamba draws its dt): a layer
    that remembers from the start. A zero bias would give e^{g_min/2} ≈ 0.08 per step, nearly
    memoryless."""
    H = A_log_H.shape[0]
    # -log(decay) between these, log-uniform
    lo, hi = (math.log(-math.log(d)) for d in (decay[1], decay[0]))
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
            self.g_proj = nn.Sequential(
                nn.Linear(dim, a.gate_rank, bias=False), nn.Linear(a.gate_rank, HK, bias=False)
            )
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
                self.dt_bias.copy_(
                    safe_gate_bias(self.A_log.float(), self.a.head_dim, self.a.g_min)
                )
            else:  # Kimi Linear's: softplus(f + 0), scaled by e^{A_log}
                self.dt_bias.zero_()

    def decay(self, x_BTD):
        """Per-step log decay g (B, T, H, K), fp32, in the configured form."""
        H, K = self.a.n_heads, self.a.head_dim
        f = upcast(self.f_b(self.f_a(x_BTD))).view(*x_BTD.shape[:2], H, K) + upcast(
            self.dt_bias
        ).view(H, K)
        A = upcast(self.A_log).exp()[:, None]
        if self.a.gate == "softplus":
            return -A * F.softplus(f)
        return self.a.g_min * torch.sigmoid(A * f)

    def inputs(self, x_BTD, conv_states=(None, None, None)):
        """The recurrence's inputs: q, k (L2-normalised, q scaled), v (B, T, H, K) in the projections'
        dtype, β (B, T, H) and g in fp32, then the three new conv states."""
        B, T, _ = x_BTD.shape
        H, K = self.a.n_heads, self.a.head_dim
        (q, cq), (k, ck), (v, cv) = (
            causal_conv(proj(x_BTD), w, c)
            for proj, w, c in zip(
                (self.q_proj, self.k_proj, self.v_proj),
                (self.q_conv, self.k_conv, self.v_conv),
                conv_states,
            )
        )
        # normalised in fp32, then kept in the projections' dtype: in a bf16 model the chunk form keeps
        # q and k in bf16 for backward (half the bytes) and computes on their values in fp32
        q = (F.normalize(upcast(q.view(B, T, H, K)), dim=-1, eps=1e-6) * K**-0.5).to(q.dtype)
        k = F.normalize(upcast(k.view(B, T, H, K)), dim=-1, eps=1e-6).to(k.dtype)
        beta = torch.sigmoid(upcast(self.beta_proj(x_BTD)))
        return q, k, v.view(B, T, H, K), beta, self.decay(x_BTD), cq, ck, cv

    def output(self, o_BTHK, x_BTD):
        """W_o [sigmoid(W_gate x) ⊙ RMSNorm_head(o)]."""
        B, T, H, K = o_BTHK.shape
        o = self.o_norm(o_BTHK.to(x_BTD.dtype)) * torch.sigmoid(self.g_proj(x_BTD)).view(B, T, H, K)
        return self.o_proj(o.reshape(B, T, H * K))

    def forward(self, x_BTD, state: KDAState | None = None, recurrent: bool | None = None):
        """`state` is read and updated in place when given (decoding); `recurrent` forces a form
        (default: recurrent for a single token, chunked otherwise). Training (no state, gradients
        on) keeps x and the recurrence's inputs only: the projections, convs, norms and gates on
        either side of the recurrence are recomputed in backward (they would keep ~12 times q's
        width per token, against 4 for the recurrence's own inputs)."""
        T = x_BTD.shape[1]
        train = state is None and torch.is_grad_enabled()
        st = state or KDAState()
        if train:
            q, k, v, beta, g = recompute(
                lambda x: self.inputs(x)[:5], (x_BTD,), list(self.parameters())
            )
        else:
            q, k, v, beta, g, *convs = self.inputs(x_BTD, (st.conv_q, st.conv_k, st.conv_v))
        if recurrent if recurrent is not None else T == 1:
            o, S = kda_recurrent(q, k, v, g, beta, st.S)
        else:
            # the softplus gate is unbounded
            bound = -self.a.g_min if self.a.gate == "safe" else None
            o, S = kda_chunked(q, k, v, g, beta, st.S, self.a.chunk_size, step_bound=bound)
        if state is not None:
            (state.conv_q, state.conv_k, state.conv_v), state.S = convs, S
        # what `output` reads it as: kept for backward in the model's dtype, not fp32
        o = o.to(x_BTD.dtype)
        return (
            recompute(self.output, (o, x_BTD), list(self.parameters()))
            if train
            else self.output(o, x_BTD)
        )

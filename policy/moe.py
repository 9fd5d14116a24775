"""GLU MLPs (SiTU-GLU or SwiGLU) and the Stable LatentMoE layer with its sigmoid router.

SiTU-GLU (Sigmoid-Tanh Unit), in fp32:

    SiTU(g, u) = b1·tanh(g/b1)·sigmoid(g) · b2·tanh(u/b2),   g = W_g x, u = W_u x

It equals SwiGLU's silu(g)·u to first order near zero, recovers it as b1, b2 → ∞, and is bounded
by b1·b2, so heavy-tailed sparse inputs cannot blow activations (or their gradients) up.

LatentMoE: a sigmoid router at full width d picks experts; the selection adds a bias b that only
selects (no gradient, not in the weights; updated by `policy.balance`); weights are the selected
scores renormalised. Routed experts work in a latent space l < d:

    y = Σ_shared E_j(x) + W_up RMSNorm( Σ_{i ∈ TopK(s + b)} p_i E_i(W_down x) )

Group-limited (hierarchical) routing: rank groups by the sum of their top-2 biased scores, keep
`topk_groups`, pick the top-k experts inside them. Rollout routing replay: with recorded expert ids
the selection is taken as given while the weights p come from the current router (so it learns);
a row of -1 (a token the engine recorded nothing for) keeps the router's own choice, and the
count of replayed tokens whose own choice differs from the recorded one is reported.

Dispatch (`routed`): the (token, slot) rows are sorted by expert once (argsort + counts, one host
sync per layer); when experts get few rows each and their loads are even enough that padding every
expert to the busiest one's rows costs at most `PAD_LIMIT`× the rows, all experts run as three
batched matmuls over an (E, C, L) buffer, else each expert runs on its contiguous slice of the
sorted rows (no pass over the rows per expert). `naive_moe`
computes every expert for every token and is the reference both are tested against. No expert
parallelism here (policy/parallelize.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from policy.args import MoEArgs
from policy.norm import RMSNorm, upcast


def situ_glu(g: torch.Tensor, u: torch.Tensor, b1: float = 4.0, b2: float = 25.0) -> torch.Tensor:
    """b1·tanh(g/b1)·sigmoid(g) · b2·tanh(u/b2) in fp32, cast back to g's dtype."""
    return _SiTUGLU.apply(g, u, b1, b2)


class _SiTUGLU(torch.autograd.Function):
    """SiTU-GLU with a hand-written backward: saves g and u (in their own dtype) where autograd
    would keep six fp32 intermediates of the same width."""

    @staticmethod
    def forward(ctx, g, u, b1: float, b2: float):
        gf, uf = upcast(g), upcast(u)
        ctx.save_for_backward(g, u)
        ctx.b = (b1, b2)
        return (b1 * torch.tanh(gf / b1) * torch.sigmoid(gf) * (b2 * torch.tanh(uf / b2))).to(
            g.dtype
        )

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        g, u = ctx.saved_tensors
        b1, b2 = ctx.b
        gf, uf, dyf = upcast(g), upcast(u), upcast(dy)
        t1, sg, t2 = torch.tanh(gf / b1), torch.sigmoid(gf), torch.tanh(uf / b2)
        gate = b1 * t1 * sg
        dgate = (1 - t1.square()) * sg + gate * (1 - sg)  # d/dg [b1 tanh(g/b1) σ(g)]
        return (
            (dyf * b2 * t2 * dgate).to(g.dtype),
            (dyf * gate * (1 - t2.square())).to(u.dtype),
            None,
            None,
        )


def swiglu(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    return F.silu(g) * u


class Activation:
    def __init__(self, kind: str, b1: float, b2: float):
        self.kind, self.b1, self.b2 = kind, b1, b2

    def __call__(self, g, u):
        return situ_glu(g, u, self.b1, self.b2) if self.kind == "situ" else swiglu(g, u)


class GLU(nn.Module):
    def __init__(self, dim: int, hidden: int, act: Activation, out_dim: int | None = None):
        super().__init__()
        self.w_gate = nn.Linear(dim, hidden, bias=False)
        self.w_up = nn.Linear(dim, hidden, bias=False)
        self.w_down = nn.Linear(hidden, out_dim or dim, bias=False)
        self.act = act

    def forward(self, x):
        return self.w_down(self.act(self.w_gate(x), self.w_up(x)))


def replay_selection(
    own_Nk: torch.Tensor, replay_Nk: torch.Tensor
) -> tuple[torch.Tensor, tuple[int, int]]:
    """Rollout routing replay's selection: the recorded expert ids where a row has them (rows of -1
    keep the router's own), and (replayed rows, of which the router's own choice differs as a set).
    Shared by this router and the hooks on Hugging Face routers (rl/learner/routing.py)."""
    replay = replay_Nk.to(own_Nk.device).long()
    have_N = (replay >= 0).all(-1)
    differ_N = (own_Nk.sort(-1).values != replay.sort(-1).values).any(-1) & have_N
    return torch.where(have_N[:, None], replay, own_Nk), (int(have_N.sum()), int(differ_N.sum()))


class Router(nn.Module):
    def __init__(self, dim: int, a: MoEArgs):
        super().__init__()
        self.a = a
        self.weight = nn.Parameter(torch.empty(a.n_routed_experts, dim))
        nn.init.normal_(self.weight, 0.0, dim**-0.5)
        self.register_buffer("bias", torch.zeros(a.n_routed_experts))  # selection only

    def select(self, scores_NE: torch.Tensor) -> torch.Tensor:
        """The router's own top-k expert ids (N×k): biased scores, group-limited."""
        a = self.a
        biased = scores_NE.detach() + self.bias
        if a.n_groups > 1:
            grouped = biased.view(-1, a.n_groups, a.n_routed_experts // a.n_groups)
            group_score = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)
            keep = group_score.topk(a.topk_groups, dim=-1).indices
            mask = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, keep, True)
            biased = grouped.masked_fill(~mask[..., None], -torch.inf).flatten(1)
        return biased.topk(a.top_k, dim=-1).indices

    def forward(self, x_ND, replay_Nk: torch.Tensor | None = None):
        """Returns (expert ids N×k, weights N×k, scores N×E fp32, replay counts). With `replay_Nk`,
        rows of recorded ids are the selection (rows of -1 keep the router's own); the counts are
        (replayed tokens, of which the router's own choice differs as a set)."""
        a = self.a
        scores = torch.sigmoid(F.linear(upcast(x_ND), upcast(self.weight)))
        idx = self.select(scores)
        counts = (0, 0)
        if replay_Nk is not None:
            idx, counts = replay_selection(idx, replay_Nk)
        picked = scores.gather(1, idx)
        weights = picked / picked.sum(-1, keepdim=True).clamp(min=1e-20) * a.routed_scaling
        return idx, weights, scores, counts


# Batched expert matmuls when padding every expert to the busiest one adds at most PAD_LIMIT× the rows
# and experts get few rows each (where a loop's per-expert overhead dominates). Measured on CPU
# (forward+backward): 256 experts × 128 rows, batched 31 ms against 97 ms looped; 64 experts × 1024
# rows, batched 160 ms against 115 ms.
PAD_LIMIT = 2.0
BATCHED_MAX_ROWS = 256


class LatentMoE(nn.Module):
    def __init__(self, dim: int, a: MoEArgs, act: Activation, eps: float = 1e-5):
        super().__init__()
        self.a = a
        E, L, F_ = a.n_routed_experts, a.latent_dim, a.expert_dim
        self.router = Router(dim, a)
        self.shared = GLU(dim, F_ * a.n_shared_experts, act) if a.n_shared_experts else None
        self.down = nn.Linear(dim, L, bias=False)
        self.up = nn.Linear(L, dim, bias=False)
        self.latent_norm = RMSNorm(L, eps)
        self.w_gate_EFL = nn.Parameter(torch.empty(E, F_, L))
        self.w_up_EFL = nn.Parameter(torch.empty(E, F_, L))
        self.w_down_ELF = nn.Parameter(torch.empty(E, L, F_))
        for w, fan_in in ((self.w_gate_EFL, L), (self.w_up_EFL, L), (self.w_down_ELF, F_)):
            nn.init.normal_(w, 0.0, fan_in**-0.5)
        self.act = act

    def expert(self, e: int, x_NL, weights=None):
        """Expert `e` on rows `x_NL`; `weights`: the three stacks already unbound (`routed` passes
        them: indexing a stack per expert makes its backward write a zero tensor of all E experts
        per expert)."""
        gate, up, down = weights or (self.w_gate_EFL[e], self.w_up_EFL[e], self.w_down_ELF[e])
        h = self.act(x_NL @ gate.T, x_NL @ up.T)
        return h @ down.T

    def routed(self, x_NL, idx_Nk, w_Nk, batched: bool | None = None):
        """Σ_k w[n, k] · expert_{idx[n, k]}(x[n]) with the rows sorted by expert (see the module doc);
        `batched` forces one path (None: padded batched matmuls when the padding is cheap)."""
        N, k = idx_Nk.shape
        E = self.a.n_routed_experts
        e_R = idx_Nk.reshape(-1)  # R = N·k (token, slot) rows
        order_R = torch.argsort(e_R, stable=True)
        e_sorted_R, tok_R = e_R[order_R], order_R // k
        w_R = w_Nk.reshape(-1)[order_R].to(x_NL.dtype)
        counts_E = torch.bincount(e_R, minlength=E)
        counts = counts_E.tolist()  # the one host sync
        xs_RL = x_NL[tok_R]
        if batched is None:
            batched = (
                E * max(counts) <= PAD_LIMIT * max(len(e_R), 1) and len(e_R) <= BATCHED_MAX_ROWS * E
            )
        if batched:
            C = max(counts)
            starts_E = torch.cumsum(counts_E, 0) - counts_E
            pos_R = torch.arange(len(e_R), device=x_NL.device) - starts_E[e_sorted_R]
            buf_ECL = x_NL.new_zeros(E, C, x_NL.shape[1]).index_put((e_sorted_R, pos_R), xs_RL)
            h_ECF = self.act(
                torch.bmm(buf_ECL, self.w_gate_EFL.transpose(1, 2)),
                torch.bmm(buf_ECL, self.w_up_EFL.transpose(1, 2)),
            )
            out_RL = torch.bmm(h_ECF, self.w_down_ELF.transpose(1, 2))[e_sorted_R, pos_R]
        else:
            per_expert = list(
                zip(self.w_gate_EFL.unbind(0), self.w_up_EFL.unbind(0), self.w_down_ELF.unbind(0))
            )
            out_RL = torch.cat(
                [
                    self.expert(e, xs, per_expert[e])
                    for e, xs in enumerate(xs_RL.split(counts))
                    if counts[e]
                ]
                or [xs_RL[:0]]
            )
        return torch.zeros_like(x_NL).index_add(0, tok_R, out_RL * w_R[:, None])

    def forward(self, x_BTD, replay_BTk: torch.Tensor | None = None):
        B, T, D = x_BTD.shape
        x = x_BTD.reshape(-1, D)
        replay = replay_BTk.reshape(-1, replay_BTk.shape[-1]) if replay_BTk is not None else None
        idx, w, scores, replayed = self.router(x, replay)
        lat = self.down(x)
        u = self.routed(lat, idx, w)
        y = self.up(self.latent_norm(u))
        if self.shared is not None:
            y = y + self.shared(x)
        load = torch.bincount(idx.flatten(), minlength=self.a.n_routed_experts)
        info = {
            "experts": idx.view(B, T, -1),
            "load": load,
            "scores": scores.detach().float(),
            "replayed": replayed,
        }
        return y.view(B, T, D), info


def naive_moe(moe: LatentMoE, x_BTD, idx_Nk, w_Nk):
    """Reference: every expert on every token, combined with a dense weight matrix."""
    x = x_BTD.reshape(-1, x_BTD.shape[-1])
    lat = moe.down(x)
    dense_NE = torch.zeros(x.shape[0], moe.a.n_routed_experts, dtype=lat.dtype).scatter_add_(
        1, idx_Nk, w_Nk.to(lat.dtype)
    )
    outs_ENL = torch.stack([moe.expert(e, lat) for e in range(moe.a.n_routed_experts)])
    u = torch.einsum("ne,enl->nl", dense_NE, outs_ENL)
    y = moe.up(moe.latent_norm(u)) + (moe.shared(x) if moe.shared is not None else 0)
    return y.view_as(x_BTD)

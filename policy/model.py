"""The policy: a stack of KDA and gated-MLA layers with dense or LatentMoE MLPs, AttnRes, and
native vision input. Plain PyTorch, no parallelism.

One API for the learner and the native engine:

    logits, cache, router_info = model(input_ids, images=None, cache=None, routing=None)

- `cache`: a `PolicyCache` from `model.new_cache()`; given, it is extended in place (prefill with
  many tokens, then one token at a time). Without it the call is a plain training forward.
- `router_info`: per MoE layer, the top-k expert ids per token (`experts`: L × B × T × k), the
  tokens per expert (`load`: L × E) and the router scores (`scores`, for load balancing).
- `routing`: recorded expert ids (L × B × T × k, e.g. from the rollout engine) replayed as the
  selection, with weights from the current router (rollout routing replay); -1 rows keep the
  router's own choice. `router_info["replayed"]`: (replayed tokens, of which the router differs).
- `model.activation_checkpointing = True`: training forwards keep only each layer's inputs and
  recompute the rest in the backward pass.

AttnRes (block form; arXiv 2603.15031): the residual stream is replaced by learned, zero-initialised
pseudo-queries w that attend over the sources [embedding, finished blocks, the current partial
block]: mix_w(V) = Σ_i softmax_i(w·RMSNorm(v_i)) v_i, in fp32. Separate queries before attention,
before the MLP, and at the output; a block is `attn_res_block` layers whose outputs are summed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.utils.checkpoint
from torch import nn

from policy.args import ModelArgs, VisionArgs
from policy.kda import KDA, KDAState
from policy.mla import GatedMLA, MLACache
from policy.moe import GLU, Activation, LatentMoE
from policy.norm import RMSNorm


def attn_res_mix(w_D: torch.Tensor, sources: list[torch.Tensor], eps: float) -> torch.Tensor:
    """AttnRes: Σ_s α_s V_s with α = softmax_s(w · RMSNorm(V_s)) per token, over the earlier blocks'
    outputs and the running prefix (math in fp32, result in the sources' dtype)."""
    return _AttnResMix.apply(w_D, eps, *sources)


class _AttnResMix(torch.autograd.Function):
    """`attn_res_mix` with a hand-written backward. Autograd would keep, for every mix, the stacked
    sources, their normalised copy and the logits (~3 × sources × width per token, in fp32); this
    keeps the sources themselves (alive anyway: later layers read the same blocks, so each is kept
    once however many mixes read it) and two numbers per source and token (1/rms and α)."""

    @staticmethod
    def forward(ctx, w_D, eps: float, *sources):
        dt = torch.promote_types(sources[-1].dtype, torch.float32)
        w = w_D.to(dt)
        inv_rms, logits = [], []
        for V in sources:
            Vf = V.to(dt)
            inv_rms.append(torch.rsqrt(Vf.pow(2).mean(-1) + eps))
            logits.append(inv_rms[-1] * (Vf @ w))
        alpha_SBT = torch.softmax(torch.stack(logits), 0)
        out = sum(a[..., None] * V.to(dt) for a, V in zip(alpha_SBT, sources))
        ctx.save_for_backward(w_D, torch.stack(inv_rms), alpha_SBT, *sources)
        return out.to(sources[-1].dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout_BTD):
        w_D, r_SBT, alpha_SBT, *sources = ctx.saved_tensors
        dt = r_SBT.dtype
        w, g = w_D.to(dt), dout_BTD.to(dt)
        D = g.shape[-1]
        dalpha = torch.stack([(g * V.to(dt)).sum(-1) for V in sources])
        # softmax backward
        dlogit = alpha_SBT * (dalpha - (alpha_SBT * dalpha).sum(0, keepdim=True))
        dw, dsources = torch.zeros_like(w), []
        for V, a, r, dl in zip(sources, alpha_SBT, r_SBT, dlogit):
            Vf = V.to(dt)
            c = dl * r  # logit = r (V·w):  d/dV = r w − r³ (V·w) V / D,  d/dw = r V
            dw += (c[..., None] * Vf).flatten(0, -2).sum(0)
            dV = (
                a[..., None] * g
                + c[..., None] * w
                - (c * r.square() * (Vf @ w) / D)[..., None] * Vf
            )
            dsources.append(dV.to(V.dtype))
        return dw.to(w_D.dtype), None, *dsources


class Block(nn.Module):
    def __init__(self, args: ModelArgs, layer_id: int, kind: str):
        super().__init__()
        self.kind = kind
        self.attn = (
            KDA(args.dim, args.kda, args.norm_eps)
            if kind == "kda"
            else GatedMLA(args.dim, args.mla, args.norm_eps)
        )
        act = Activation(args.mlp_act, args.situ_b1, args.situ_b2)
        self.is_moe = layer_id >= args.n_dense_layers
        self.mlp = (
            LatentMoE(args.dim, args.moe, act, args.norm_eps)
            if self.is_moe
            else GLU(args.dim, args.dense_dim, act)
        )
        self.attn_norm = RMSNorm(args.dim, args.norm_eps)
        self.mlp_norm = RMSNorm(args.dim, args.norm_eps)
        if args.attn_res:
            if layer_id > 0:  # layer 0's attention reads the embedding alone: nothing to mix
                self.res_q_attn = nn.Parameter(torch.zeros(args.dim))
            self.res_q_mlp = nn.Parameter(torch.zeros(args.dim))

    def run_attn(self, x, state):
        return self.attn(x, state)

    def run_mlp(self, x, replay):
        if self.is_moe:
            return self.mlp(x, replay)
        return self.mlp(x), None


class PatchEncoder(nn.Module):
    """Images (N, C, H, W) → patch embeddings (N, H/p · W/p, dim): a linear patch embedding with
    learned positions and a few residual MLP blocks. Enough at tiny scale; a full ViT tower
    (K3 uses MoonViT) plugs in here."""

    def __init__(self, dim: int, v: VisionArgs, eps: float):
        super().__init__()
        self.v = v
        self.proj = nn.Linear(v.channels * v.patch_size**2, dim)
        self.pos = nn.Parameter(torch.zeros(v.max_patches, dim))
        self.blocks = nn.ModuleList(
            nn.Sequential(
                RMSNorm(dim, eps), nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim)
            )
            for _ in range(v.encoder_layers)
        )

    def forward(self, images_NCHW: torch.Tensor) -> torch.Tensor:
        p = self.v.patch_size
        N, C, H, W = images_NCHW.shape
        if H % p or W % p or C != self.v.channels:
            raise ValueError(
                f"images must be (N, {self.v.channels}, H, W) with H, W multiples of {p}; got {tuple(images_NCHW.shape)}"
            )
        patches = images_NCHW.unfold(2, p, p).unfold(3, p, p)  # N C h w p p
        patches = patches.permute(0, 2, 3, 1, 4, 5).reshape(N, (H // p) * (W // p), C * p * p)
        if patches.shape[1] > self.v.max_patches:
            raise ValueError(
                f"{patches.shape[1]} patches per image exceed vision.max_patches={self.v.max_patches}"
            )
        x = self.proj(patches.to(self.proj.weight.dtype)) + self.pos[: patches.shape[1]]
        for blk in self.blocks:
            x = x + blk(x)
        return x

    def patches_per_image(self, H: int, W: int) -> int:
        return (H // self.v.patch_size) * (W // self.v.patch_size)


@dataclass
class PolicyCache:
    layers: list = field(default_factory=list)  # KDAState or MLACache per layer
    seq_len: int = 0


class Policy(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.embed = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(
            Block(args, i, kind) for i, kind in enumerate(args.layer_kinds())
        )
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.lm_head = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.vision = (
            PatchEncoder(args.dim, args.vision, args.norm_eps) if args.vision.enabled else None
        )
        if args.attn_res:
            self.res_q_out = nn.Parameter(torch.zeros(args.dim))
        self.activation_checkpointing = False
        if not any(p.is_meta for p in self.parameters()):
            nn.init.normal_(self.embed.weight, 0.0, 1.0)
            nn.init.normal_(self.lm_head.weight, 0.0, args.dim**-0.5)

    def new_cache(self) -> PolicyCache:
        return PolicyCache([KDAState() if blk.kind == "kda" else MLACache() for blk in self.layers])

    def embed_inputs(self, input_ids_BT, images):
        h = self.embed(input_ids_BT)
        slots = input_ids_BT == self.args.vision.image_token_id if self.vision is not None else None
        n_slots = int(slots.sum()) if slots is not None else 0
        if images is None:
            if n_slots:
                raise ValueError(f"{n_slots} image placeholder tokens but no images were given")
            return h
        if self.vision is None:
            raise ValueError("images given but this policy has vision.enabled = false")
        emb = self.vision(images)  # N × P × D, in image order
        if emb.shape[0] * emb.shape[1] != n_slots:
            raise ValueError(
                f"{n_slots} image placeholder tokens for {emb.shape[0]} image(s) of {emb.shape[1]} patches"
            )
        h = h.clone()
        h[slots] = emb.reshape(-1, emb.shape[-1]).to(h.dtype)
        return h

    def forward(self, input_ids_BT, images=None, cache: PolicyCache | None = None, routing=None):
        h, router_info = self.hidden_states(input_ids_BT, images, cache, routing)
        return self.lm_head(h), cache, router_info

    def hidden_states(
        self, input_ids_BT, images=None, cache: PolicyCache | None = None, routing=None
    ):
        """Everything but the output projection: (final-normed hidden states, router_info). The
        learner projects these a chunk at a time (see rl/learner/logprobs.py)."""
        args = self.args
        h = self.embed_inputs(input_ids_BT, images)
        infos = []
        i_moe = {i: n for n, i in enumerate(i for i, blk in enumerate(self.layers) if blk.is_moe)}
        states = cache.layers if cache is not None else [None] * len(self.layers)
        # Activation checkpointing (training only): keep each layer's inputs, recompute the rest
        # in the backward pass. Memory per token then no longer grows with every intermediate.
        recompute = self.activation_checkpointing and cache is None and torch.is_grad_enabled()

        def run(fn, *tensors):
            if recompute:
                return torch.utils.checkpoint.checkpoint(fn, *tensors, use_reentrant=False)
            return fn(*tensors)

        if args.attn_res:
            prefix, blocks = h, []
            for i, (blk, st) in enumerate(zip(self.layers, states)):
                replay = routing[i_moe[i]] if routing is not None and blk.is_moe else None

                def layer(prefix, *blocks, blk=blk, st=st, i=i, replay=replay):
                    blocks = list(blocks)
                    x_in = (
                        attn_res_mix(blk.res_q_attn, blocks + [prefix], args.norm_eps)
                        if blocks
                        else prefix
                    )
                    if i % args.attn_res_block == 0:
                        blocks.append(prefix)
                        prefix = torch.zeros_like(prefix)
                    prefix = prefix + blk.run_attn(blk.attn_norm(x_in), st)
                    y, info = blk.run_mlp(
                        blk.mlp_norm(attn_res_mix(blk.res_q_mlp, blocks + [prefix], args.norm_eps)),
                        replay,
                    )
                    return prefix + y, blocks, info

                prefix, blocks, info = run(layer, prefix, *blocks)
                if info is not None:
                    infos.append(info)
            h = attn_res_mix(self.res_q_out, blocks + [prefix], args.norm_eps)
        else:
            for i, (blk, st) in enumerate(zip(self.layers, states)):
                replay = routing[i_moe[i]] if routing is not None and blk.is_moe else None

                def layer(h, blk=blk, st=st, replay=replay):
                    h = h + blk.run_attn(blk.attn_norm(h), st)
                    y, info = blk.run_mlp(blk.mlp_norm(h), replay)
                    return h + y, info

                h, info = run(layer, h)
                if info is not None:
                    infos.append(info)
        h = self.norm(h)
        if cache is not None:
            cache.seq_len += input_ids_BT.shape[1]
        router_info = {
            "experts": torch.stack([i["experts"] for i in infos]) if infos else None,
            "load": torch.stack([i["load"] for i in infos]) if infos else None,
            "scores": [i["scores"] for i in infos],
            # rollout routing replay: (replayed tokens, of which the router's own choice differs), all layers
            "replayed": tuple(sum(i["replayed"][j] for i in infos) for j in (0, 1)),
        }
        return h, router_info

    def never_generated(self) -> list[int]:
        """Token ids that are input only: the image placeholder. Engines and the learner give them
        zero probability (logit -inf), so sampled tokens and their log-probs agree on both sides."""
        return [self.args.vision.image_token_id] if self.args.vision.enabled else []

    def routers(self):
        return [blk.mlp.router for blk in self.layers if blk.is_moe]

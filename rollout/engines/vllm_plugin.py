"""vLLM model plugin for the project's `policy/` model (KDA + gated MLA, LatentMoE, AttnRes).

Registered through the `vllm.general_plugins` entry point (pyproject.toml), so every vLLM this
environment starts — in-process, multiprocess or the OpenAI server — can load a `policy/`
checkpoint (config.json `model_type: longhorizon_policy`).

The model runs our own `policy.model.Policy` modules (same weight names as our checkpoints, so
loading and in-place reload are a name-for-name copy) and swaps in vLLM only where a sequence's
history lives:

- **KDA layers** are vLLM hybrid-model state layers (`MambaBase`, the gated-delta-net metadata):
  each sequence owns a state slot holding its conv states (q, k, v: 3·H·d_k × (W−1), model dtype)
  and its recurrent state S (H × d_k × d_v, fp32, so decoding matches the learner's fp32 math).
  Decodes run batched through `KDA.forward` on the gathered slots; prefills run sequence by
  sequence (chunked form), from the slot when the sequence has history.
- **Gated MLA layers** use vLLM's paged attention with the K/V expanded per head (k = [k_nope;
  k_rope], v), zero-padded to the nearest head size the CPU attention kernel supports (32 for the
  debug flavour) with the true 1/sqrt(d_nope + d_rope) scale. vLLM's CPU MLA kernel only takes
  DeepSeek's sizes (latent 512 + rope 64), so the latent-cache layout is not used here: the cost
  is 2 · H · P values per token per MLA layer instead of (kv_lora + rope) — see rollout/README.md.
- LatentMoE (selection bias, hierarchical routing), SiTU-GLU, AttnRes and the norms run as in the
  learner, on the batch's tokens flattened into one row (all of them are per-token).
- The image placeholder token is never sampled (logit −inf), as in the native engine and the learner.

Not covered: images in prompts, tensor/pipeline parallelism, prefix caching (the engine turns it
off for this model: a hybrid model's cached prefix needs state snapshots per block), recording
routed experts (the native engine does that), CUDA graphs / torch.compile (eager only).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import torch
from torch import nn
from transformers import PretrainedConfig
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.model_executor.models.interfaces import HasInnerState, IsHybrid

ARCHITECTURE = "LonghorizonPolicy"
_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def register() -> None:
    """The entry point vLLM calls in every process it starts."""
    from transformers import AutoConfig
    from vllm import ModelRegistry

    from policy.checkpoint import MODEL_TYPE

    try:
        AutoConfig.register(MODEL_TYPE, LonghorizonPolicyConfig)
    except ValueError:  # registered already (the plugin loads once per process, but be safe)
        pass
    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(
            ARCHITECTURE, "rollout.engines.vllm_plugin:LonghorizonPolicyForCausalLM"
        )


class LonghorizonPolicyConfig(PretrainedConfig):
    """A `policy/` checkpoint's config.json as a transformers config: our `ModelArgs` fields as
    they are, plus the names vLLM reads (hidden size, layers, heads, layer types)."""

    model_type = "longhorizon_policy"

    def __init__(self, **kwargs):
        from policy.args import ModelArgs
        from typed_yaml import build_dataclass

        fields = {f.name for f in dataclasses.fields(ModelArgs)}
        own = {k: kwargs.pop(k) for k in list(kwargs) if k in fields}
        super().__init__(**kwargs)
        args = (
            build_dataclass(ModelArgs, own, "", "config.json").validate("config.json")
            if own
            else ModelArgs()
        )
        self.model_args = args
        for k, v in own.items():
            setattr(self, k, v)
        self.hidden_size = args.dim
        self.num_hidden_layers = args.n_layers
        self.num_attention_heads = args.mla.n_heads
        self.num_key_value_heads = args.mla.n_heads
        self.head_dim = mla_head_size(args)
        self.max_position_embeddings = args.max_seq_len
        self.layer_types = [
            "linear_attention" if k == "kda" else "full_attention" for k in args.layer_kinds()
        ]
        self.tie_word_embeddings = False

    def to_dict(self):
        out = super().to_dict()
        out.pop("model_args", None)
        return out


def mla_head_size(args) -> int:
    """The per-head width of the expanded K/V in vLLM's cache: the smallest size the CPU attention
    kernel takes that holds both [k_nope; k_rope] and v."""
    need = max(args.mla.qk_nope_head_dim + args.mla.qk_rope_head_dim, args.mla.v_head_dim)
    return next(s for s in _CPU_HEAD_SIZES if s >= need)


def _kda_state_shapes(args) -> tuple[tuple[int, ...], tuple[int, ...]]:
    H, K = args.kda.n_heads, args.kda.head_dim
    return (3 * H * K, args.kda.conv_size - 1), (H, K, K)


# ---------------------------------------------------------------------------------------------
# The two stateful layers


class VLLMKDA(nn.Module, MambaBase):
    """A KDA layer's history in vLLM's state slots; the math is `policy.kda.KDA.forward`."""

    def __init__(self, kda, args, vllm_config, prefix: str):
        super().__init__()
        self._kda = [kda]  # not a submodule: its weights belong to the policy
        self.args, self.prefix = args, prefix
        self.dtype = vllm_config.model_config.dtype
        ctx = vllm_config.compilation_config.static_forward_context
        if prefix in ctx:
            raise ValueError(f"duplicate layer name {prefix}")
        ctx[prefix] = self
        self.kv_cache = (torch.tensor([]), torch.tensor([]))

    @property
    def mamba_type(self):
        from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

        # its metadata: state slots, starts, history flags
        return MambaAttentionBackendEnum.GDN_ATTN

    def get_state_shape(self):
        return _kda_state_shapes(self.args)

    def get_state_dtype(self):
        return self.dtype, torch.float32

    def forward(self, x_ND: torch.Tensor) -> torch.Tensor:
        from vllm.forward_context import get_forward_context

        from policy.kda import KDAState

        kda = self._kda[0]
        meta = get_forward_context().attn_metadata
        if meta is None:  # vLLM's profiling run: no slots, the stateless forward has the same cost
            return kda(x_ND[None])[0]
        m = meta[self.prefix]
        conv, S = self.kv_cache
        HK = self.args.kda.n_heads * self.args.kda.head_dim
        out = torch.empty_like(x_ND)
        slots = m.non_spec_state_indices_tensor.long()
        starts = m.non_spec_query_start_loc.tolist()

        def read(idx):
            c = conv[idx]
            return KDAState(c[:, :HK], c[:, HK : 2 * HK], c[:, 2 * HK :], S[idx])

        def write(idx, st):
            conv[idx] = torch.cat([st.conv_q, st.conv_k, st.conv_v], 1).to(conv.dtype)
            S[idx] = st.S.to(S.dtype)

        nd = m.num_decodes
        if nd:  # one token each, batched
            st = read(slots[:nd])
            out[:nd] = kda(x_ND[:nd, None], st)[:, 0]
            write(slots[:nd], st)
        for j in range(nd, nd + m.num_prefills):  # whole prompts (chunked prefill is off)
            s, e = starts[j], starts[j + 1]
            idx = slots[j : j + 1]
            st = read(idx) if bool(m.has_initial_state[j]) else KDAState()
            out[s:e] = kda(x_ND[None, s:e], st)[0]
            write(idx, st)
        return out


class VLLMMLA(nn.Module):
    """A gated-MLA layer over vLLM's paged attention, K/V expanded per head (see module docstring);
    the projections are the policy's `GatedMLA` weights."""

    def __init__(self, mla, args, vllm_config, prefix: str):
        super().__init__()
        from vllm.model_executor.layers.attention import Attention

        self._mla = [mla]
        self.a = args.mla
        self.P = mla_head_size(args)
        self.positions: torch.Tensor | None = None  # set by the model before each forward
        self.attn = Attention(
            self.a.n_heads,
            self.P,
            mla.scale,
            num_kv_heads=self.a.n_heads,
            cache_config=vllm_config.cache_config,
            prefix=prefix,
        )

    def forward(self, x_ND: torch.Tensor) -> torch.Tensor:
        import torch.nn.functional as F

        from policy.mla import rope

        mla, a, P = self._mla[0], self.a, self.P
        T = x_ND.shape[0]
        H, N, R, Vd = a.n_heads, a.qk_nope_head_dim, a.qk_rope_head_dim, a.v_head_dim
        q = mla._q(x_ND).view(T, H, N + R)
        ckv = mla.wkv_a(x_ND)
        c, kr = mla.kv_norm(ckv[:, : a.kv_lora_rank]), ckv[:, a.kv_lora_rank :]
        if a.rope and R:
            q = torch.cat([q[..., :N], rope(q[None, ..., N:], self.positions, a.rope_theta)[0]], -1)
            kr = rope(kr[None, :, None, :], self.positions, a.rope_theta)[0, :, 0]
        kv = mla.wkv_b(c).view(T, H, N + Vd)
        k = torch.cat([kv[..., :N], kr[:, None, :].expand(T, H, R)], -1)
        o = self.attn(
            F.pad(q, (0, P - N - R)).reshape(T, H * P),
            F.pad(k, (0, P - N - R)).reshape(T, H * P),
            F.pad(kv[..., N:], (0, P - Vd)).reshape(T, H * P),
        )
        o = o.view(T, H, P)[..., :Vd] * torch.sigmoid(mla.w_gate(x_ND)).view(T, H, Vd)
        return mla.wo(o.reshape(T, H * Vd))


# ---------------------------------------------------------------------------------------------
# The model vLLM instantiates


class LonghorizonPolicyForCausalLM(nn.Module, IsHybrid, HasInnerState):
    loads_in_place = True
    """The weight-sync extension (rollout/engines/vllm_ext.py) calls `load_weights` directly: plain torch
    weights, nothing to repack after loading, and a tensor refused mid-sync leaves a working model."""

    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__()
        from policy.model import Policy

        cfg = vllm_config.model_config.hf_config
        self.args = args = cfg.model_args
        if args.vision.enabled and args.vision.image_token_id >= args.vocab_size:
            raise ValueError(
                f"image_token_id {args.vision.image_token_id} outside the vocabulary {args.vocab_size}"
            )
        # built on the device and dtype vLLM's loader has made the defaults (CPU here, CUDA on GPUs)
        self.policy = Policy(args).to(vllm_config.model_config.dtype)
        self.adapters = nn.ModuleList()
        for i, blk in enumerate(self.policy.layers):
            name = f"{prefix}layers.{i}.attn" if not prefix else f"{prefix}.layers.{i}.attn"
            adapter = (VLLMKDA if blk.kind == "kda" else VLLMMLA)(blk.attn, args, vllm_config, name)
            self.adapters.append(adapter)
            # Block.run_attn is the seam: the block calls it with its normed input and its state
            blk.run_attn = lambda x_BTD, _state, adapter=adapter: adapter(x_BTD[0])[None]
        self.banned = self.policy.never_generated()

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.policy.embed(input_ids)

    def forward(
        self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None, **kwargs
    ):
        if inputs_embeds is not None:
            raise NotImplementedError(
                "the policy plugin takes token ids (images in prompts are not covered)"
            )
        for adapter in self.adapters:
            if isinstance(adapter, VLLMMLA):
                adapter.positions = positions
        h, _ = self.policy.hidden_states(input_ids[None])
        return h[0]

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = self.policy.lm_head(hidden_states)
        if self.banned:
            logits[:, self.banned] = -torch.inf
        return logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Our checkpoint's names (`Policy.state_dict()`), copied in place; unknown names and wrong
        shapes are refused by name. Returns the loaded parameter names (vLLM checks all arrived)."""
        from vllm.model_executor.model_loader.weight_utils import default_weight_loader

        # looked up now, not at construction: vLLM's in-place reload swaps in placeholder tensors
        # whose `weight_loader` buffers a layer's weights and copies them into the served storage
        own = {**dict(self.policy.named_parameters()), **dict(self.policy.named_buffers())}
        loaded = set()
        with torch.no_grad():
            for name, w in weights:
                if name not in own:
                    raise KeyError(
                        f"policy plugin: checkpoint tensor {name!r} is not a weight of this model"
                    )
                t = own[name]
                if tuple(t.shape) != tuple(w.shape):
                    raise ValueError(
                        f"policy plugin: {name} has shape {tuple(w.shape)}, the model {tuple(t.shape)}"
                    )
                getattr(t, "weight_loader", default_weight_loader)(t, w)
                loaded.add(f"policy.{name}")
        return loaded

    # --- IsHybrid ---
    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config):
        return _kda_state_shapes(vllm_config.model_config.hf_config.model_args)

    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config):
        return vllm_config.model_config.dtype, torch.float32

    @classmethod
    def get_mamba_state_copy_func(cls):
        from vllm.model_executor.layers.mamba.mamba_utils import (
            MambaStateCopyFuncCalculator,
        )

        return MambaStateCopyFuncCalculator.gated_delta_net_state_copy_func()

"""ModelArgs: every size and switch of the project's sparse-MoE policy, one docstring per field.

Flavours live in `configs/policy/*.yaml` (debug → small → k3, the full reference design).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from typed_yaml import bound_problems, bounded, load_dataclass, require

SUB_CHUNK = 16
"""KDA's chunks are cut into sub-chunks of this many steps (see policy/kda.py)."""


@dataclass
class KDAArgs:
    n_heads: int = bounded(2, ge=1)
    """KDA heads."""
    head_dim: int = bounded(16, ge=1)
    """Key and value width per head (d_k = d_v)."""
    conv_size: int = bounded(4, ge=1)
    """Depthwise causal conv kernel on q, k, v."""
    gate: Literal["safe", "softplus"] = "safe"
    """Decay form: `safe` g = g_min·sigmoid(e^A (f + dt_bias)) (bounded below), `softplus` g = -e^A·softplus(f + dt_bias)."""
    g_min: float = bounded(-5.0, lt=0)
    """Lower bound of the per-step log decay in the safe form."""
    gate_rank: int = bounded(0, ge=0, note="0: full rank")
    """Rank of the output gate projection; 0 = full rank (K3), > 0 low rank (Kimi Linear)."""
    chunk_size: int = 16
    """Chunk length of the parallel training form: <= 16 or a multiple of 16 (sub-chunks of 16). Longer
    chunks mean fewer steps of the sequential state recurrence and larger matmuls within a chunk."""


@dataclass
class MLAArgs:
    n_heads: int = bounded(2, ge=1)
    """Attention heads."""
    q_lora_rank: int = bounded(32, ge=0, note="0: a full-rank query projection")
    """Rank of the query compression; 0 = a full-rank query projection."""
    kv_lora_rank: int = bounded(16, ge=1)
    """Width of the compressed KV latent c_KV (cached)."""
    qk_nope_head_dim: int = bounded(16, ge=1)
    """Per-head key/query part computed from the latent."""
    qk_rope_head_dim: int = bounded(8, ge=1)
    """Decoupled key/query part shared by all heads (cached with the latent)."""
    v_head_dim: int = bounded(16, ge=1)
    """Per-head value width."""
    rope: bool = False
    """Rotate the decoupled part (RoPE). False = NoPE, as Kimi Linear / K3 use in MLA layers."""
    rope_theta: float = bounded(10000.0, gt=0)
    """RoPE base when `rope` is on."""


@dataclass
class MoEArgs:
    n_routed_experts: int = bounded(8, ge=1)
    """Routed experts per MoE layer."""
    top_k: int = bounded(2, ge=1)
    """Experts per token."""
    n_shared_experts: int = bounded(1, ge=0)
    """Shared experts (full width, every token)."""
    expert_dim: int = bounded(32, ge=1)
    """Hidden width of each expert's GLU."""
    latent_dim: int = bounded(32, ge=1)
    """Width of the latent space routed experts work in (= dim for no compression)."""
    n_groups: int = bounded(1, ge=1)
    """Expert groups for group-limited routing (1 = plain top-k)."""
    topk_groups: int = bounded(1, ge=1)
    """Groups each token may pick experts from."""
    routed_scaling: float = bounded(1.0, gt=0)
    """Scale of the renormalised routed weights."""
    balance: Literal["quantile", "quantile_hist", "sign", "none"] = "quantile"
    """Router bias update: exact quantile balancing, its histogram estimator, DeepSeek's sign update, or none."""
    balance_rate: float = bounded(1e-3, gt=0)
    """Step size of the sign update."""
    hist_bins: int = bounded(1000, ge=2)
    """Histogram bins of the quantile estimator."""
    hist_range: float = bounded(2.0, gt=0)
    """Histogram covers alpha - s in [-hist_range, hist_range]."""


@dataclass
class VisionArgs:
    enabled: bool = False
    """Accept images (patches enter the stack at image placeholder tokens)."""
    patch_size: int = bounded(8, ge=1)
    """Square patch side, pixels."""
    channels: int = bounded(3, ge=1)
    """Image channels."""
    max_patches: int = bounded(256, ge=1)
    """Largest patch grid (learned position embeddings)."""
    encoder_layers: int = bounded(1, ge=0)
    """Residual MLP blocks of the small patch encoder."""
    image_token_id: int = bounded(1, ge=0)
    """Placeholder token id: one per patch, replaced by that patch's embedding."""


@dataclass
class ModelArgs:
    name: str = "debug"
    """Flavour name."""
    vocab_size: int = bounded(512, ge=2)
    """Vocabulary size (untied input and output embeddings)."""
    dim: int = bounded(64, ge=1)
    """Model width."""
    n_layers: int = bounded(4, ge=1)
    """Decoder layers."""
    mla_every: int = bounded(4, ge=1)
    """Every `mla_every`-th layer (1-based) is MLA, the others KDA; the last layer is always MLA. 1 = all MLA."""
    n_dense_layers: int = bounded(1, ge=0)
    """First layers with a dense MLP instead of MoE."""
    dense_dim: int = bounded(128, ge=1)
    """Hidden width of the dense MLP."""
    mlp_act: Literal["situ", "swiglu"] = "situ"
    """GLU activation of every MLP: SiTU-GLU (bounded) or SwiGLU (comparison)."""
    situ_b1: float = bounded(4.0, gt=0)
    """SiTU-GLU gate bound."""
    situ_b2: float = bounded(25.0, gt=0)
    """SiTU-GLU up-projection bound."""
    attn_res: bool = True
    """Attention residuals (block form) instead of the plain residual stream."""
    attn_res_block: int = bounded(2, ge=1)
    """Decoder layers per AttnRes block."""
    norm_eps: float = bounded(1e-5, gt=0)
    """RMSNorm epsilon."""
    max_seq_len: int = bounded(8192, ge=1)
    """Longest sequence (RoPE tables, when used)."""
    kda: KDAArgs = field(default_factory=KDAArgs)
    """KDA layers."""
    mla: MLAArgs = field(default_factory=MLAArgs)
    """Gated MLA layers."""
    moe: MoEArgs = field(default_factory=MoEArgs)
    """MoE layers."""
    vision: VisionArgs = field(default_factory=VisionArgs)
    """Native vision input."""

    def layer_kinds(self) -> list[str]:
        """'kda' or 'mla' per layer."""
        kinds = ["mla" if (i + 1) % self.mla_every == 0 else "kda" for i in range(self.n_layers)]
        kinds[-1] = "mla"
        return kinds

    def validate(self, source: str = "policy config") -> ModelArgs:
        """Every field within the bounds declared with it, then what ties fields together."""
        require(bound_problems(self), source)  # first: the checks below divide by some of them
        m = self.moe
        checks = [
            (
                "n_dense_layers",
                0 <= self.n_dense_layers <= self.n_layers,
                "must be in [0, n_layers]",
            ),
            ("moe.top_k", 1 <= m.top_k <= m.n_routed_experts, "must be in [1, n_routed_experts]"),
            (
                "moe.n_groups",
                m.n_routed_experts % m.n_groups == 0,
                "must divide moe.n_routed_experts",
            ),
            ("moe.topk_groups", 1 <= m.topk_groups <= m.n_groups, "must be in [1, moe.n_groups]"),
            (
                "moe.top_k",
                m.top_k <= m.topk_groups * (m.n_routed_experts // m.n_groups),
                "exceeds the experts in moe.topk_groups groups",
            ),
            (
                "kda.chunk_size",
                self.kda.chunk_size >= 1
                and (self.kda.chunk_size <= SUB_CHUNK or self.kda.chunk_size % SUB_CHUNK == 0),
                f"must be <= {SUB_CHUNK} or a multiple of {SUB_CHUNK}",
            ),
        ]
        require(checks, source)
        return self


def load_model_args(path) -> ModelArgs:
    return load_dataclass(ModelArgs, path).validate(str(path))

"""Sizes of a policy flavour, computed from the module tree built on the `meta` device (no memory).

- total parameters: every parameter (buffers such as router biases excluded);
- active parameters per token: total minus the routed experts a token does not visit
  (n_routed − top_k per MoE layer) minus the input embedding table (a lookup, not a matmul);
- cache bytes per token: MLA layers × (kv_lora + rope) values, bf16;
- recurrent state bytes per sequence: KDA layers × heads × d_k × d_v fp32, plus the conv states
  (3 × H·d_k × (conv − 1) per layer, bf16). Constant in sequence length.
"""

from __future__ import annotations

import torch

from policy.args import ModelArgs
from policy.model import Policy


def policy_info(args: ModelArgs) -> dict:
    with torch.device("meta"):
        model = Policy(args)
    total = sum(p.numel() for p in model.parameters())
    kinds = args.layer_kinds()
    moe_layers = [blk for blk in model.layers if blk.is_moe]
    per_expert = 0
    if moe_layers:
        m = moe_layers[0].mlp
        per_expert = (
            m.w_gate_EFL.numel() + m.w_up_EFL.numel() + m.w_down_ELF.numel()
        ) // args.moe.n_routed_experts
    inactive = len(moe_layers) * (args.moe.n_routed_experts - args.moe.top_k) * per_expert
    active = total - inactive - model.embed.weight.numel()
    n_kda, n_mla = kinds.count("kda"), kinds.count("mla")
    k = args.kda
    state = n_kda * (
        k.n_heads * k.head_dim * k.head_dim * 4 + 3 * k.n_heads * k.head_dim * (k.conv_size - 1) * 2
    )
    return {
        "name": args.name,
        "layers": args.n_layers,
        "layer_pattern": "".join("M" if kind == "mla" else "K" for kind in kinds),
        "kda_layers": n_kda,
        "mla_layers": n_mla,
        "dense_layers": args.n_dense_layers,
        "moe_layers": len(moe_layers),
        "total_params": total,
        "active_params": active,
        "params_per_routed_expert": per_expert,
        "vision_params": sum(p.numel() for p in model.vision.parameters())
        if model.vision is not None
        else 0,
        "cache_bytes_per_token": n_mla * (args.mla.kv_lora_rank + args.mla.qk_rope_head_dim) * 2,
        "state_bytes_per_sequence": state,
    }


def human(n: float) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f}{unit}"
    return str(int(n))

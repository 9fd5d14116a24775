"""Checkpoints of the project's policy in Hugging Face directory format.

    DIR/config.json          {"model_type": "longhorizon_policy", "architectures": [...], **ModelArgs}
    DIR/model.safetensors    the state dict, names as in `Policy.state_dict()` (router biases included)

Parameter names (per layer `layers.{i}.`):
  attn.*   KDA: q_proj k_proj v_proj (weights), q_conv k_conv v_conv (H·d_k × 1 × conv), beta_proj,
           f_a f_b (low-rank decay), A_log (H), dt_bias (H·d_k), g_proj (gate), o_norm, o_proj;
           MLA: wq_a q_norm wq_b (or wq), wkv_a kv_norm wkv_b, w_gate, wo
  mlp.*    dense: w_gate w_up w_down; MoE: router.weight, router.bias (selection bias, buffer),
           shared.{w_gate,w_up,w_down}, down, up, latent_norm, w_gate_EFL w_up_EFL (E × F × l), w_down_ELF (E × l × F)
  attn_norm, mlp_norm, res_q_attn, res_q_mlp (AttnRes pseudo-queries)
and at the top: embed, lm_head, norm, res_q_out, vision.* (patch encoder).
Loading is strict: a missing or unexpected tensor is an error naming it.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from policy.args import ModelArgs
from policy.model import Policy
from typed_yaml import build_dataclass

MODEL_TYPE = "longhorizon_policy"


def is_policy_checkpoint(path: str | Path) -> bool:
    """True for this project's checkpoints (config.json model_type `longhorizon_policy`), False for
    Hugging Face ones."""
    return json.loads((Path(path) / "config.json").read_text()).get("model_type") == MODEL_TYPE


def save_policy(model: Policy, out_dir: str | Path, state: dict | None = None) -> Path:
    """config.json + model.safetensors; `state`: the weights to write instead of `model`'s own
    (a sharded learner's gathered full state)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = {
        "model_type": MODEL_TYPE,
        "architectures": ["LonghorizonPolicy"],
        **dataclasses.asdict(model.args),
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    state = {
        k: v.detach().contiguous()
        for k, v in (state if state is not None else model.state_dict()).items()
    }
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def load_policy(path: str | Path, dtype: torch.dtype | None = None) -> Policy:
    path = Path(path)
    raw = json.loads((path / "config.json").read_text())
    if raw.pop("model_type", None) != MODEL_TYPE:
        raise ValueError(f"{path}/config.json is not a {MODEL_TYPE} checkpoint")
    raw.pop("architectures", None)
    args = build_dataclass(ModelArgs, raw, "", f"{path}/config.json").validate(
        f"{path}/config.json"
    )
    state = load_file(str(path / "model.safetensors"))
    model = Policy(args)
    ref_dtype = next(iter(state.values())).dtype
    model.to(dtype or ref_dtype)
    keep_fp32(model)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(
            f"{path}: checkpoint does not match the config: missing {missing}, unexpected {unexpected}"
        )
    return model


def keep_fp32(model: torch.nn.Module) -> None:
    """The KDA decay parameters (policy.kda.FP32_PARAMS) and the routers' selection biases back to
    fp32 after a cast of the whole model: small, and a bf16 rounding of a decay rate or a bias that
    only reorders near-ties is a change in what the layer does, not noise."""
    from policy.kda import FP32_PARAMS

    for name, p in model.named_parameters():
        if name.rsplit(".", 1)[-1] in FP32_PARAMS:
            p.data = p.data.float()
    for name, b in model.named_buffers():
        if name.endswith("router.bias"):
            b.data = b.data.float()

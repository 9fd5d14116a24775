"""LoRA RL: low-rank adapters (peft) on a Hugging Face policy, trained alone, synced alone.

`add_adapters` puts peft's LoRA layers into the loaded model in place (`inject_adapter_in_model`: the
module tree keeps its names, so the learner's routing hooks and output head still find their modules)
on the attention projections (q/k/v/o) and on every routed expert's weights: transformers 5 keeps a
MoE layer's experts fused in 3-D parameters (`mlp.experts.gate_up_proj`, E × out × in), which
peft adapts with one rank-r pair per expert (`target_parameters`). Everything else is frozen; the
learner's optimiser sees only the adapters.

A weight sync sends the adapters, not the model (`engine_factors`): for every tensor the engine
serves in checkpoint format (`q_proj.weight`, `block_sparse_moe.experts.3.w1.weight`), the pair
(B·scale, A) whose product is that tensor's update. The learner's fused in-memory layout differs
from the checkpoint's (experts unstacked, gate and up split), so the pairs are cut by a row map: each
adapted parameter's row indices are passed once through the model's own checkpoint conversion
(`CausalLM.checkpoint_names`), which tells which rows of which expert each served tensor holds; B is
cut by those rows, A is the expert's. The map is checked on the first layer against converting the
full product, so a conversion that mixes experts or columns is refused at start-up, not served wrong.
The rollout worker adds B·A to the base weights it reads from the checkpoint file (rollout/weights.py).

`merged_state` is the model with its adapters folded in under the original names (checkpoints, so an
engine or `longhorizon eval` loads one alone); `adapter_state`/`load_adapter_state` are the
adapters alone (what a resumed run restores on top of the base).

Not covered: `policy/` checkpoints (their experts are not peft targets yet), a learner group
(FSDP over peft's wrappers), DoRA and other peft variants, dropout on the adapters (off: the
learner's log-probs must be those of the weights the engine serves).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
ADAPTER = "default"  # peft's adapter name; one adapter per run


def _expert_params(model: torch.nn.Module) -> list[str]:
    """Suffixes (`experts.gate_up_proj`) of the 3-D expert parameters of fused MoE layers."""
    found = set()
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] == "experts":
            found |= {
                f"experts.{p}" for p, t in module.named_parameters(recurse=False) if t.dim() == 3
            }
    return sorted(found)


def add_adapters(model: torch.nn.Module, cfg) -> int:
    """Inject LoRA layers (`cfg`: rl.config.LoraConfig) into `model` in place and freeze everything but them; returns how many
    parameters train. B starts at zero, so the adapted model computes exactly the base at first."""
    from peft import LoraConfig as PeftLora
    from peft import inject_adapter_in_model

    modules = list(ATTENTION) if "attention" in cfg.targets else []
    params = _expert_params(model) if "experts" in cfg.targets else []
    if "experts" in cfg.targets and not params:
        raise ValueError(
            "lora.targets has experts, but the model has no fused expert parameters "
            "(mlp.experts.* with one slice per expert)"
        )
    peft_cfg = PeftLora(
        r=cfg.rank,
        lora_alpha=cfg.alpha,
        lora_dropout=0.0,
        bias="none",
        target_modules=modules or None,
        target_parameters=params or None,
    )
    inject_adapter_in_model(peft_cfg, model, adapter_name=ADAPTER)
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def _lora_layers(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module]]:
    """(original parameter name, LoRA layer) for every adapter, e.g. `model.layers.0.mlp.experts.down_proj`."""
    from peft.tuners.lora import LoraLayer

    for name, module in model.named_modules():
        if isinstance(module, LoraLayer) and ADAPTER in module.lora_A:
            param = getattr(module, "parameter_name", None) or "weight"
            yield f"{name.replace('.base_layer', '')}.{param}", module


def factors(layer) -> tuple[torch.Tensor, torch.Tensor]:
    """(B·scale, A) with B·scale @ A = the layer's update of its weight, in the weight's layout:
    (out, r) and (r, in) for a linear layer, (E, rows, r) and (E, r, cols) for fused experts."""
    # ParamWrapper (fused experts): delta = scale · lhs @ rhs
    if hasattr(layer, "get_delta_factors"):
        lhs, rhs, scale = layer.get_delta_factors(ADAPTER)
        return lhs * scale, rhs
    return layer.lora_B[ADAPTER].weight * layer.scaling[ADAPTER], layer.lora_A[ADAPTER].weight


def base_of(layer) -> torch.Tensor:
    return layer.get_param() if hasattr(layer, "get_param") else layer.get_base_layer().weight


def merged_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict under its original names, each adapted weight with its update added
    (new tensors: the model is not touched)."""
    state = {
        k.replace(".base_layer", ""): v for k, v in model.state_dict().items() if "lora_" not in k
    }
    with torch.no_grad():
        for name, layer in _lora_layers(model):
            b, a = factors(layer)
            state[name] = base_of(layer) + (b @ a).to(state[name].dtype)
    return state


def adapter_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu() for k, v in model.state_dict().items() if "lora_" in k}


def load_adapter_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Restore `adapter_state`; every adapter of the model must be in `state` and nothing else."""
    own = adapter_state(model)
    wrong = sorted(set(own) ^ set(state)) or [k for k in own if own[k].shape != state[k].shape]
    if wrong:
        raise ValueError(
            f"saved adapters do not match the model's (lora.rank or lora.targets changed?): "
            f"{len(wrong)} tensor(s) differ, e.g. {wrong[0]}"
        )
    model.load_state_dict(state, strict=False)


class EngineFactors:
    """Cuts each adapted parameter's factors into the engine's checkpoint-format tensors."""

    def __init__(self, lm, model: torch.nn.Module):
        self.lm = lm
        self.layers = dict(_lora_layers(model))  # fixed once the adapters are injected
        self.maps = {
            name: self._row_map(name, tuple(base_of(layer).shape))
            for name, layer in self.layers.items()
        }
        self._check()

    def _row_map(
        self, name: str, shape: tuple[int, ...]
    ) -> list[tuple[str, int | None, torch.Tensor]]:
        """[(checkpoint name, expert or None, rows)]: which rows of which expert each served tensor is."""
        rows = shape[-2]
        idx = torch.arange(int(np.prod(shape[:-1])), dtype=torch.float64).reshape(*shape[:-1], 1)
        out = []
        for ckpt, t in self.lm.checkpoint_names([(name, idx)]):
            ids = t.reshape(-1).long()
            if len(shape) == 2:
                out.append((ckpt, None, ids))
                continue
            experts = (ids // rows).unique()
            if len(experts) != 1:
                raise ValueError(
                    f"LoRA sync: the checkpoint tensor {ckpt} mixes experts of {name}; "
                    "its factors cannot be cut per tensor"
                )
            out.append((ckpt, int(experts[0]), ids % rows))
        return out

    def _check(self) -> None:
        """On the first layer's adapters, with random factors: the cut pieces multiply out to the
        checkpoint conversion of the full update (a mismatch would serve wrong weights silently)."""
        g = torch.Generator().manual_seed(0)
        first = [n for n in self.maps if ".layers.0." in n] or list(self.maps)[:1]
        for name in first:
            shape = tuple(base_of(self.layers[name]).shape)
            r = 3
            b = torch.randn(*shape[:-1], r, generator=g, dtype=torch.float64)
            a = torch.randn(*shape[:-2], r, shape[-1], generator=g, dtype=torch.float64)
            want = dict(self.lm.checkpoint_names([(name, b @ a)]))
            got = dict(self._cut(name, b, a))
            for ckpt, (bp, ap) in got.items():
                if ckpt not in want or not torch.allclose(
                    bp @ ap, want[ckpt].reshape(bp.shape[0], -1), atol=1e-9
                ):
                    raise ValueError(
                        f"LoRA sync: the factors of {name} do not reproduce its checkpoint tensor {ckpt}"
                    )
            if set(got) != set(want):
                raise ValueError(
                    f"LoRA sync: {name} converts to {sorted(want)}, the cut gives {sorted(got)}"
                )

    def _cut(self, name: str, b: torch.Tensor, a: torch.Tensor):
        for ckpt, expert, rows in self.maps[name]:
            if expert is None:
                yield ckpt, (b[rows], a)
            else:
                yield ckpt, (b[expert][rows], a[expert])

    def __call__(self) -> Iterator[tuple[str, np.ndarray]]:
        """(`NAME.lora_B`, B·scale) then (`NAME.lora_A`, A) for every served tensor with an adapter,
        fp32 (what rollout/weights.py `merge_adapters` adds to the base)."""
        with torch.no_grad():
            for name, layer in self.layers.items():
                b, a = factors(layer)
                for ckpt, (bp, ap) in self._cut(name, b.float().cpu(), a.float().cpu()):
                    yield f"{ckpt}.lora_B", bp.contiguous().numpy()
                    yield f"{ckpt}.lora_A", ap.contiguous().numpy()

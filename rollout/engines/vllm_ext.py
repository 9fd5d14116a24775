"""Code that runs *inside* vLLM's worker, mixed into it through `worker_extension_cls`.

vLLM calls these methods through `LLM.collective_rpc(name, args=...)`. On CPU, `model.load_weights`
alone is not enough: the CPU layers repack weights after loading. What works in vLLM 0.32 is the
worker's own `reload_weights(weights_iterator=..., is_checkpoint_format=True)`, which reruns the
per-layer post-load processing.

vLLM 0.32 bug worked around here: for MoE models the CPU expert repacking is skipped on reload,
so the engine keeps computing with the *old* packed expert weights and its outputs are silently
wrong (log-probs off by ~0.4 after reloading identical weights). We redo the fused-experts
post-load step for every fused-MoE module after each reload. `repack_moe=False` exists only so a
test can show the bug is still caught when the fix is missing.

Direct expert loading (`_DirectExperts`): the CPU fused-MoE experts are most of an MoE's bytes,
and vLLM's layerwise reload moved each of them four times: into a freshly allocated
checkpoint-layout tensor, back into the kernel tensor's storage, then our repack into another fresh
tensor, and the repack's result into the layer. Here every expert's checkpoint tensors (gate, up,
down) are copied once into a checkpoint-layout staging pair reused layer after layer, and a complete
layer is packed at once straight into the kernel tensors the engine computes with
(`prepack_moe_weight` takes its output buffer). The other
tensors take vLLM's path. Only for layers the direct path understands (unquantized CPU experts
without intermediate padding, not zentorch); a layer that receives only some of its experts'
tensors fails the load, naming the layer. `direct_experts=False` keeps vLLM's path for every
tensor (the reference the tests compare against).
"""

from __future__ import annotations

import logging
from typing import Any, Iterable

import torch


def _fused_moe_modules(model: torch.nn.Module):
    for module in model.modules():
        quant_method = getattr(module, "quant_method", None)
        kernel = getattr(quant_method, "moe_kernel", None)
        fused = getattr(kernel, "fused_experts", None)
        if fused is not None and hasattr(fused, "process_weights_after_loading"):
            yield module, fused


def _tied_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Modules sharing one weight tensor (an lm_head tied to the embedding, as SmolLM2's is).

    vLLM's CPU layers compute with a packed copy of their weight made after loading (oneDNN,
    `dispatch_cpu_unquantized_gemm`). A reload writes the embedding's new values into the shared
    tensor and repacks the embedding, but the head receives no tensor of its own, so its packed
    copy kept the weights of the engine's start: the embedding lookup moved with every sync and the
    output projection never did (measured: log-probs 10.4 off the reloaded model's, after moving
    the embedding). Every module of a shared weight is repacked after a reload."""
    holders: dict[int, list[torch.nn.Module]] = {}
    for module in model.modules():
        w = getattr(module, "weight", None)
        if isinstance(w, torch.Tensor) and w.numel() and hasattr(getattr(module, "quant_method", None),
                                                                 "process_weights_after_loading"):
            holders.setdefault(w.data_ptr(), []).append(module)
    return [m for group in holders.values() if len(group) > 1 for m in group]


class _ExpertLayer:
    """One fused-MoE layer's packed kernel tensors, and the checkpoint-layout staging buffers its
    experts' tensors are copied into until the layer is complete; then both are packed at once
    (the pack runs its experts in parallel: packing one expert per call was slower than vLLM's path)."""

    def __init__(self, module: torch.nn.Module, fused, name: str):
        self.module, self.fused, self.name = module, fused, name
        self.w13, self.w2 = module.w13_weight, module.w2_weight  # the kernel tensors (E×2I×H, E×H×I)
        self.inter = self.w2.shape[-1]
        self.stage: tuple[torch.Tensor, torch.Tensor] | None = None
        self.done: set[tuple[int, str]] = set()
        self.packed = False

    def put(self, expert: int, shard: str, t: torch.Tensor, pool: dict) -> None:
        from vllm import _custom_ops as ops  # noqa: F401  (registers torch.ops._C)

        want = self.w2.shape[1:] if shard == "w2" else (self.inter, self.w13.shape[-1])
        if tuple(t.shape) != tuple(want):
            raise ValueError(f"weight sync: {self.name} expert {expert} {shard}: got shape {tuple(t.shape)}, "
                             f"the engine's is {tuple(want)}")
        if self.stage is None:  # a free pair of staging buffers of this shape, or new ones
            key = (tuple(self.w13.shape), tuple(self.w2.shape), self.w13.dtype)
            free = pool.setdefault(key, [])
            self.stage = free.pop() if free else (torch.empty_like(self.w13), torch.empty_like(self.w2))
            self._key = key
        s13, s2 = self.stage
        rows = {"w1": s13[expert, :self.inter], "w3": s13[expert, self.inter:], "w2": s2[expert]}[shard]
        rows.copy_(t)  # vLLM's w13 is [gate (w1); up (w3)]
        self.done.add((expert, shard))
        if len(self.done) == 3 * self.w13.shape[0]:
            torch.ops._C.prepack_moe_weight(s13, self.w13.data, self.fused.isa)
            torch.ops._C.prepack_moe_weight(s2, self.w2.data, self.fused.isa)
            self.packed = True
            pool[self._key].append(self.stage)
            self.stage = None

    def check(self) -> None:
        if self.done and not self.packed:
            raise RuntimeError(f"weight sync: {self.name} received {len(self.done)} of its {3 * self.w13.shape[0]} "
                               "expert tensors; a version must carry all of a layer's experts")
        if self.module.w13_weight is not self.w13 or self.module.w2_weight is not self.w2:
            raise RuntimeError(f"weight sync: vLLM replaced {self.name}'s kernel tensors during the reload, "
                               "so the experts loaded directly are not the ones served")


class _DirectExperts:
    """Checkpoint names of CPU fused-MoE expert tensors → the layer that loads them directly."""

    def __init__(self, model: torch.nn.Module):
        self.targets: dict[str, tuple[_ExpertLayer, int, str]] = {}
        self.layers: list[_ExpertLayer] = []
        self.pool: dict = {}  # staging buffers by shape, reused layer after layer
        for module, fused in _fused_moe_modules(model):
            if not self._eligible(module, fused):
                continue
            prefix = module.layer_name.rsplit(".", 1)[0]
            layer = _ExpertLayer(module, fused, module.layer_name)
            self.layers.append(layer)
            for _param, weight_name, expert, shard in module.get_expert_mapping():
                self.targets[f"{prefix}.{weight_name}weight"] = (layer, expert, shard)

    @staticmethod
    def _eligible(module, fused) -> bool:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

        # the portable kernel and its ISA variants (x86 AMX for bf16, Arm, Power) pack the same
        # way, each with its own `isa`; zentorch keeps its own layout
        if not isinstance(fused, CPUUnquantizedExperts) or getattr(fused, "_use_zentorch", False):
            return False
        if not (hasattr(module, "get_expert_mapping") and hasattr(module, "layer_name")):
            return False
        w13, w2 = getattr(module, "w13_weight", None), getattr(module, "w2_weight", None)
        if w13 is None or w2 is None or hasattr(module, "w13_bias"):
            return False
        inter = fused.moe_config.intermediate_size_per_partition
        return (w13.shape[1] == 2 * inter and w2.shape[-1] == inter
                and fused._padded_intermediate_size(fused.moe_config) == inter)

    def take(self, name: str, t: torch.Tensor) -> bool:
        hit = self.targets.get(name)
        if hit is None:
            return False
        layer, expert, shard = hit
        layer.put(expert, shard, t, self.pool)
        return True

    def loaded(self) -> set:
        """The fused-MoE modules whose experts this load put in place."""
        for layer in self.layers:
            layer.check()
        return {id(layer.module) for layer in self.layers if layer.packed}


class _QuietDirectLayers(logging.Filter):
    """vLLM's reload warns about what it did not load itself: '<layer>: Failed to load weights' for
    a layer it received nothing for, and 'Following weights were not loaded from checkpoint: {...}'.
    The directly loaded expert layers and their kernel tensors are such on purpose; anything else
    is still reported."""

    def __init__(self, classes: set[str], params: set[str]):
        super().__init__()
        self.classes, self.params = classes, params

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg == "%s: Failed to load weights" and record.args:
            return record.args[0] not in self.classes
        if str(record.msg).startswith("Following weights were not loaded") and record.args:
            rest = set(record.args[0]) - self.params
            record.args = (rest,)
            return bool(rest)
        return True


class WeightSyncExtension:
    """Methods added to vLLM's worker. `self` is the worker (it has `model_runner`)."""

    def lh_reload_weights(self, named_tensors: Iterable[tuple[str, Any]], repack_moe: bool = True,
                          direct_experts: bool = True) -> dict:
        """Load checkpoint-format (HF-named) tensors in place; return how many tensors were loaded
        (`tensors`) and how many of them went straight into the served tensors (`direct`: the packed
        experts here, every tensor of the policy/ plugin) rather than through vLLM's layerwise reload.

        `named_tensors` is any iterable of torch tensors or numpy arrays (what Ray's object store
        hands out zero-copy), consumed once and lazily, so a weight sync can fetch its buckets
        while vLLM loads them. Only valid in-process: tensors and iterators passed through
        `collective_rpc` do not survive vLLM's multiprocess mode (use a path there).
        """
        count = 0

        def as_tensors():
            nonlocal count
            for name, value in named_tensors:
                count += 1
                yield name, value if isinstance(value, torch.Tensor) else torch.from_numpy(value)

        model = self.model_runner.get_model()
        if getattr(model, "loads_in_place", False):
            # plain torch weights with no post-load processing (the policy/ plugin): copied into the
            # served tensors one by one, each checked first, so a refused tensor leaves a working
            # model (vLLM's layerwise reload would leave its layers on placeholder tensors)
            model.load_weights(as_tensors())
            return {"tensors": count, "direct": count}
        direct = _DirectExperts(model) if direct_experts else None

        taken = 0

        def rest():  # what the direct path does not load, for vLLM's reload
            nonlocal taken
            for name, t in as_tensors():
                if direct is not None and direct.take(name, t):
                    taken += 1
                else:
                    yield name, t

        loggers = [logging.getLogger(f"vllm.model_executor.model_loader.reload.{m}") for m in ("layerwise", "inplace")]
        names = {id(m): n for n, m in model.named_modules()}
        quiet = _QuietDirectLayers({type(layer.module).__name__ for layer in direct.layers} if direct else set(),
                                   {f"{names[id(layer.module)]}.{p}" for layer in (direct.layers if direct else [])
                                    for p in ("w13_weight", "w2_weight")})
        for logger in loggers:
            logger.addFilter(quiet)
        try:
            self.reload_weights(weights_iterator=rest(), is_checkpoint_format=True)
        finally:
            for logger in loggers:
                logger.removeFilter(quiet)
        packed = direct.loaded() if direct is not None else set()
        if repack_moe:
            for module, fused in _fused_moe_modules(model):
                if id(module) not in packed:  # packed already by the direct path
                    fused.process_weights_after_loading(module)
        for module in _tied_modules(model):  # a tied head's packed copy of the embedding, packed again
            module.quant_method.process_weights_after_loading(module)
        return {"tensors": count, "direct": taken}

    def lh_num_fused_moe_modules(self) -> int:
        """How many fused-MoE modules the repack fix touches (0 would mean the fix is inert)."""
        return sum(1 for _ in _fused_moe_modules(self.model_runner.get_model()))

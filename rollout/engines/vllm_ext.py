"""Code that runs *inside* vLLM's worker, mixed into it through `worker_extension_cls`.

vLLM calls these methods through `LLM.collective_rpc(name, args=...)`. A weight sync loads
checkpoint-format (HF-named) tensors into a running engine. What vLLM 0.32 offers for that is the
worker's `reload_weights(weights_iterator=..., is_checkpoint_format=True)`, a layerwise reload: every
layer's tensors are put back on the meta device, each layer is materialised in fresh memory when its
last tensor arrives, loaded, processed (the CPU layers pack their weights for oneDNN) and copied back
into the tensors the engine computes with.

The direct path (`_DirectLoader`, the default) does only the work the engine needs:
- CPU fused-MoE experts (most of an MoE's bytes): each expert's checkpoint tensors (gate, up, down)
  are copied into a staging pair reused layer after layer, and a complete layer is packed at once
  straight into the kernel tensors the engine computes with (`prepack_moe_weight` takes its output
  buffer).
- Dense layers: a parameter the engine computes with as it is (a norm, the embedding) is written in
  place. A CPU linear layer keeps no weight after loading, only oneDNN's packed copy (vLLM drops
  the parameter), so its checkpoint shards (q, k, v of a fused qkv; gate, up of a fused gate_up)
  are copied into a reused staging buffer and the layer is packed again from it.
- Nothing else: no meta tensors, no fresh allocation per layer, no copy back.
It covers unquantized layers at tensor-parallel size 1 whose checkpoint names are the module's own
or a `packed_modules_mapping` part of it (the standard vLLM models); any other tensor takes vLLM's
reload, and a module is loaded by one path or the other, never both. A layer that receives only part
of its tensors fails the load, naming the layer. `direct=False` sends every tensor through vLLM's
reload (the reference the tests compare against).

vLLM 0.32 bug worked around on its path: for MoE models the CPU expert repacking is skipped on
reload, so the engine kept computing with the *old* packed expert weights (log-probs off by ~0.4
after reloading identical weights). The fused-experts post-load step is rerun for every fused-MoE
module after vLLM's reload. `repack_moe=False` exists only so a test can show the bug is still
caught when the fix is missing.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch


def _fused_moe_modules(model: torch.nn.Module):
    for module in model.modules():
        quant_method = getattr(module, "quant_method", None)
        kernel = getattr(quant_method, "moe_kernel", None)
        fused = getattr(kernel, "fused_experts", None)
        if fused is not None and hasattr(fused, "process_weights_after_loading"):
            yield module, fused


def _tied_groups(model: torch.nn.Module) -> list[list[torch.nn.Module]]:
    """Modules sharing one weight tensor (an lm_head tied to the embedding, as SmolLM2's is).

    vLLM's CPU layers compute with a packed copy of their weight made after loading (oneDNN,
    `dispatch_cpu_unquantized_gemm`). A load writes the embedding's new values into the shared
    tensor and repacks the embedding, but the head receives no tensor of its own, so its packed
    copy kept the weights of the engine's start: the embedding lookup moved with every sync and the
    output projection never did (measured: log-probs 10.4 off the reloaded model's, after moving
    the embedding). The other holders of a shared weight are repacked after a load."""
    holders: dict[int, list[torch.nn.Module]] = {}
    for module in model.modules():
        w = getattr(module, "weight", None)
        if (
            isinstance(w, torch.Tensor)
            and w.numel()
            and hasattr(getattr(module, "quant_method", None), "process_weights_after_loading")
        ):
            holders.setdefault(w.data_ptr(), []).append(module)
    return [group for group in holders.values() if len(group) > 1]


def _staging(pool: dict, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    free = pool.setdefault((tuple(shape), dtype), [])
    return free.pop() if free else torch.empty(shape, dtype=dtype)


class _ExpertLayer:
    """One fused-MoE layer's packed kernel tensors, and the checkpoint-layout staging buffers its
    experts' tensors are copied into until the layer is complete; then both are packed at once
    (the pack runs its experts in parallel: packing one expert per call was slower than vLLM's path).

    No staging copy when the experts' tensors arrive as slices of one block already in the kernel's
    layout (a shared-memory sync sends the learner's fused `gate_up_proj` E × 2I × H, which is vLLM's
    w13 = [gate; up] per expert, and `down_proj` E × H × I, its w2): the tensors are held, each
    checked to lie where that layout puts it, and the layer is packed straight from the block. The
    first one that does not (an object-store sync's separate arrays) sends what is held to staging."""

    def __init__(self, module: torch.nn.Module, fused, name: str):
        self.module, self.fused, self.name = module, fused, name
        self.begin()

    def begin(self) -> None:
        # the kernel tensors (E×2I×H, E×H×I); vLLM's reload and its repack (below) replace them
        self.w13, self.w2 = self.module.w13_weight, self.module.w2_weight
        self.inter = self.w2.shape[-1]
        self.stage: tuple[torch.Tensor, torch.Tensor] | None = None
        self.done: set[tuple[int, str]] = set()
        self.held: dict[tuple[int, str], torch.Tensor] | None = {}  # None: staging
        # "w13"/"w2" -> (storage pointer, element offset of expert 0)
        self.blocks: dict[str, tuple] = {}
        self.loaded = False
        self.unstaged = False  # this load packed the experts straight from the tensors sent

    def _in_block(self, key: tuple[int, str], t: torch.Tensor) -> bool:
        """Whether `t` lies where expert `key` of a block in the kernel's layout would, given the
        tensors held so far (the first of each block fixes where its block starts)."""
        expert, shard = key
        block = "w2" if shard == "w2" else "w13"
        target = self.w2 if block == "w2" else self.w13
        if t.dtype != target.dtype or not t.is_contiguous():
            return False
        per_expert = target[0].numel()
        start = (
            t.storage_offset()
            - expert * per_expert
            - (self.inter * target.shape[-1] if shard == "w3" else 0)
        )
        where = (t.untyped_storage().data_ptr(), start)
        if start < 0 or start + target.numel() > t.untyped_storage().nbytes() // t.element_size():
            return False
        return self.blocks.setdefault(block, where) == where

    def _to_stage(self, key: tuple[int, str], t: torch.Tensor, pool: dict) -> None:
        if self.stage is None:
            self.stage = (
                _staging(pool, self.w13.shape, self.w13.dtype),
                _staging(pool, self.w2.shape, self.w2.dtype),
            )
        s13, s2 = self.stage
        expert, shard = key
        rows = {"w1": s13[expert, : self.inter], "w3": s13[expert, self.inter :], "w2": s2[expert]}[
            shard
        ]
        rows.copy_(t)  # vLLM's w13 is [gate (w1); up (w3)]

    def put(self, key: tuple[int, str], t: torch.Tensor, pool: dict) -> None:
        from vllm import _custom_ops as ops  # noqa: F401  (registers torch.ops._C)

        expert, shard = key
        want = self.w2.shape[1:] if shard == "w2" else (self.inter, self.w13.shape[-1])
        if tuple(t.shape) != tuple(want):
            raise ValueError(
                f"weight sync: {self.name} expert {expert} {shard}: got shape {tuple(t.shape)}, "
                f"the engine's is {tuple(want)}"
            )
        if self.held is not None and self._in_block(key, t):
            self.held[key] = t
        else:
            if self.held:  # what was held goes to staging after all
                for k, h in self.held.items():
                    self._to_stage(k, h, pool)
            self.held = None
            self._to_stage(key, t, pool)
        self.done.add(key)
        if len(self.done) == 3 * self.w13.shape[0]:
            # both blocks complete, in the kernel's layout: packed from them
            if self.held is not None:
                src13, src2 = (
                    self._block(b, target) for b, target in (("w13", self.w13), ("w2", self.w2))
                )
            else:
                src13, src2 = self.stage
            torch.ops._C.prepack_moe_weight(src13, self.w13.data, self.fused.isa)
            torch.ops._C.prepack_moe_weight(src2, self.w2.data, self.fused.isa)
            self.loaded, self.unstaged, self.held = True, self.held is not None, {}
            for s in self.stage or ():
                pool[(tuple(s.shape), s.dtype)].append(s)
            self.stage = None

    def _block(self, block: str, target: torch.Tensor) -> torch.Tensor:
        first = next(t for (_, shard), t in self.held.items() if (shard == "w2") == (block == "w2"))
        contiguous = torch.empty(target.shape, device="meta").stride()
        return first.as_strided(tuple(target.shape), contiguous, self.blocks[block][1])

    def check(self) -> None:
        if self.done and not self.loaded:
            raise RuntimeError(
                f"weight sync: {self.name} received {len(self.done)} of its {3 * self.w13.shape[0]} "
                "expert tensors; a version must carry all of a layer's experts"
            )
        if self.loaded and (
            self.module.w13_weight is not self.w13 or self.module.w2_weight is not self.w2
        ):
            raise RuntimeError(
                f"weight sync: vLLM replaced {self.name}'s kernel tensors during the reload, "
                "so the experts loaded directly are not the ones served"
            )


class _DenseLayer:
    """One dense module's parameter (a linear layer's weight, the embedding, a norm), written where the
    engine reads it: in place when the engine computes with the parameter itself; else (a CPU linear
    layer, whose weight vLLM drops once oneDNN has packed its own copy) rebuilt in a staging buffer
    from the checkpoint's shards and packed again by the layer's own post-load step."""

    def __init__(
        self,
        module: torch.nn.Module,
        name: str,
        param: str,
        shape: tuple,
        rows: list[tuple[int, int]],
    ):
        self.module, self.name, self.param, self.shape, self.rows = module, name, param, shape, rows
        method = getattr(module, "quant_method", None)
        self.process = getattr(method, "process_weights_after_loading", None)
        self.begin()

    def begin(self) -> None:
        self.target: torch.Tensor | None = None
        self.staged = False
        self.done: set[int] = set()
        self.loaded = False

    def put(self, shard: int, t: torch.Tensor, pool: dict) -> None:
        start, size = self.rows[shard]
        want = (size, *self.shape[1:])
        if tuple(t.shape) != want:
            raise ValueError(
                f"weight sync: {self.name}.{self.param}"
                + (f" shard {shard}" if len(self.rows) > 1 else "")
                + f": got shape {tuple(t.shape)}, the engine's is {want}"
            )
        if self.target is None:
            live = self.module._parameters[self.param]
            self.staged = tuple(live.shape) != self.shape  # the engine dropped it after packing
            self.target = _staging(pool, self.shape, live.dtype) if self.staged else live.data
        self.target[start : start + size].copy_(t)
        self.done.add(shard)
        if len(self.done) == len(self.rows):
            self._finish(pool)

    def _finish(self, pool: dict) -> None:
        stage, end = self.target if self.staged else None, self.rows[-1][0] + self.rows[-1][1]
        if end < self.shape[0]:
            self.target[end:].zero_()
        if stage is not None:
            setattr(self.module, self.param, torch.nn.Parameter(stage, requires_grad=False))
        if self.process is not None:
            # CPU: packs a oneDNN copy, and drops the weight of a linear layer
            self.process(self.module)
        if stage is not None and self.module._parameters[self.param].data_ptr() != stage.data_ptr():
            pool[(tuple(stage.shape), stage.dtype)].append(stage)  # not kept by the layer: reusable
        self.target, self.loaded = None, True

    def check(self) -> None:
        if self.done and not self.loaded:
            raise RuntimeError(
                f"weight sync: {self.name} received {len(self.done)} of its {len(self.rows)} "
                "checkpoint tensors; a version must carry all of a layer's parts"
            )


class _DirectLoader:
    """Checkpoint names → the layer that loads them directly (or None: vLLM's reload), resolved once
    per name and kept with the staging buffers from one sync to the next."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.modules = dict(model.named_modules())
        self.parts: dict[str, tuple[str, int]] = {}  # "q_proj" -> ("qkv_proj", 0)
        for fused, parts in (getattr(model, "packed_modules_mapping", None) or {}).items():
            for i, part in enumerate(parts):
                self.parts[part] = (fused, i)
        self.targets: dict[str, tuple[Any, Any] | None] = {}
        self.layers: dict = {}  # id(fused-MoE module) or (id(dense module), parameter name) -> its layer
        self.pool: dict = {}
        for module, fused in _fused_moe_modules(model):
            if self._experts_eligible(module, fused):
                prefix = module.layer_name.rsplit(".", 1)[0]
                layer = self.layers[id(module)] = _ExpertLayer(module, fused, module.layer_name)
                for _param, weight_name, expert, shard in module.get_expert_mapping():
                    self.targets[f"{prefix}.{weight_name}weight"] = (layer, (expert, shard))

    @staticmethod
    def _experts_eligible(module, fused) -> bool:
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
        return (
            w13.shape[1] == 2 * inter
            and w2.shape[-1] == inter
            and fused._padded_intermediate_size(fused.moe_config) == inter
        )

    def _resolve(self, name: str):
        path, _, param = name.rpartition(".")
        module, shard = self.modules.get(path), None
        if module is None:  # a part of a fused module (q_proj of qkv_proj)?
            parent, _, leaf = path.rpartition(".")
            fused, shard = self.parts.get(leaf, (None, None))
            if fused is None:
                return None
            path = f"{parent}.{fused}" if parent else fused
            module = self.modules.get(path)
        # unknown, or a fused-MoE layer's other tensors
        if module is None or id(module) in self.layers:
            return None
        layer = self.layers.get((id(module), param))
        if layer is None:
            shape = self._dense_shape(module, param)
            if shape is None:
                return None
            sizes = getattr(module, "output_sizes", None)
            # a padded vocabulary's rows past the checkpoint's are zero, as vLLM loads them
            if shard is None:
                rows = [(0, getattr(module, "org_vocab_size", shape[0]))]
                if getattr(module, "num_added_embeddings", 0) or rows[0][1] > shape[0]:
                    return None
            elif sizes is None or sum(sizes) != shape[0] or not 0 <= shard < len(sizes):
                return None
            else:
                rows = [(sum(sizes[:i]), s) for i, s in enumerate(sizes)]
            layer = self.layers[(id(module), param)] = _DenseLayer(module, path, param, shape, rows)
        elif (shard is None) != (len(layer.rows) == 1):  # both whole and in parts: leave it to vLLM
            return None
        return layer, 0 if shard is None else shard

    @staticmethod
    def _dense_shape(module: torch.nn.Module, param: str) -> tuple | None:
        """The full (unsharded) shape of a parameter the direct path understands, else None."""
        from vllm.model_executor.layers.linear import UnquantizedLinearMethod
        from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod
        from vllm.model_executor.model_loader.weight_utils import default_weight_loader

        p = module._parameters.get(param)
        if p is None or getattr(module, "tp_size", 1) != 1:
            return None
        method = getattr(module, "quant_method", None)
        # a norm: loaded as it is, unless a loader of the module's transforms (vLLM's path)
        if method is None:
            plain = all(
                getattr(q, "weight_loader", default_weight_loader) is default_weight_loader
                for q in module._parameters.values()
                if q is not None
            )
            return tuple(p.shape) if plain else None
        if not isinstance(method, (UnquantizedLinearMethod, UnquantizedEmbeddingMethod)) or {
            k for k, v in module._parameters.items() if v is not None
        } != {"weight"}:  # no bias
            return None
        if p.numel():
            return tuple(p.shape)
        # dropped after packing: its shape from the layer (a replicated layer has no per-partition sizes)
        out = getattr(module, "output_size_per_partition", None) or sum(
            getattr(module, "output_partition_sizes", None) or [0]
        )
        inp = getattr(module, "input_size_per_partition", None) or getattr(
            module, "input_size", None
        )
        return (out, inp) if isinstance(out, int) and out and isinstance(inp, int) else None

    def begin(self) -> None:
        for layer in self.layers.values():
            layer.begin()

    def take(self, name: str, t: torch.Tensor) -> bool:
        if name not in self.targets:
            self.targets[name] = self._resolve(name)
        hit = self.targets[name]
        if hit is None:
            return False
        layer, key = hit
        layer.put(key, t, self.pool)
        return True

    def loaded(self) -> list:
        """The layers this load put in place."""
        for layer in self.layers.values():
            layer.check()
        return [layer for layer in self.layers.values() if layer.loaded]


class _QuietDirectLayers(logging.Filter):
    """vLLM's reload warns about what it did not load itself: '<layer>: Failed to load weights' for
    a layer it received nothing for, and 'Following weights were not loaded from checkpoint: {...}'.
    The directly loaded layers and their tensors are such on purpose; anything else is still
    reported (a layer of the same class as a direct one is named by its class only, so it is not)."""

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

    def lh_reload_weights(
        self, named_tensors: Iterable[tuple[str, Any]], repack_moe: bool = True, direct: bool = True
    ) -> dict:
        """Load checkpoint-format (HF-named) tensors in place; return how many tensors were loaded
        (`tensors`) and how many of them went straight into the served tensors (`direct`: see the
        module docstring; every tensor of the policy/ plugin) rather than through vLLM's reload.

        `named_tensors` is any iterable of torch tensors or numpy arrays (what Ray's object store
        hands out zero-copy), consumed once and lazily, so a weight sync can fetch its buckets
        while the engine loads them. Only valid in-process: tensors and iterators passed through
        `collective_rpc` do not survive vLLM's multiprocess mode (use a path there).
        """
        model = self.model_runner.get_model()
        count, rest = 0, []

        def as_tensors():
            nonlocal count
            for name, value in named_tensors:
                count += 1
                yield name, value if isinstance(value, torch.Tensor) else torch.from_numpy(value)

        if getattr(model, "loads_in_place", False):
            # plain torch weights with no post-load processing (the policy/ plugin): copied into the
            # served tensors one by one, each checked first, so a refused tensor leaves a working
            # model (vLLM's layerwise reload would leave its layers on placeholder tensors)
            model.load_weights(as_tensors())
            return {"tensors": count, "direct": count}
        loader = None
        if direct:
            loader = getattr(self, "_lh_direct", None)
            if loader is None or loader.model is not model:
                loader = self._lh_direct = _DirectLoader(model)
            loader.begin()
        for name, t in as_tensors():
            if loader is None or not loader.take(name, t):
                rest.append((name, t))  # references only: the object store's buffers, not copies
        done = loader.loaded() if loader is not None else []
        if rest:
            self._lh_vllm_reload(model, rest, done, repack_moe)
        else:  # what vLLM's reload does after loading
            for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):
                getattr(self.model_runner, reset, lambda: None)()
        processed = {id(layer.module) for layer in done}
        # a tied head's packed copy of the embedding, packed again
        for group in _tied_groups(model):
            if rest or any(id(m) in processed for m in group):
                for module in group:
                    if id(module) not in processed:
                        module.quant_method.process_weights_after_loading(module)
        # `unstaged`: expert layers packed straight from the tensors sent (no staging copy; _ExpertLayer)
        return {
            "tensors": count,
            "direct": count - len(rest),
            "unstaged": sum(isinstance(layer, _ExpertLayer) and layer.unstaged for layer in done),
        }

    def _lh_vllm_reload(self, model, rest: list, done: list, repack_moe: bool) -> None:
        """vLLM's layerwise reload of what the direct path did not load."""
        loggers = [
            logging.getLogger(f"vllm.model_executor.model_loader.reload.{m}")
            for m in ("layerwise", "inplace")
        ]
        names = {id(m): n for n, m in model.named_modules()}
        params = {
            f"{names[id(layer.module)]}.{p}"
            for layer in done
            for p, _ in layer.module.named_parameters()
        }
        quiet = _QuietDirectLayers({type(layer.module).__name__ for layer in done}, params)
        for logger in loggers:
            logger.addFilter(quiet)
        try:
            self.reload_weights(weights_iterator=iter(rest), is_checkpoint_format=True)
        finally:
            for logger in loggers:
                logger.removeFilter(quiet)
        if repack_moe:
            packed = {id(layer.module) for layer in done}
            for module, fused in _fused_moe_modules(model):
                if id(module) not in packed:  # packed already by the direct path
                    fused.process_weights_after_loading(module)

    def lh_num_fused_moe_modules(self) -> int:
        """How many fused-MoE modules the repack fix touches (0 would mean the fix is inert)."""
        return sum(1 for _ in _fused_moe_modules(self.model_runner.get_model()))

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
"""

from __future__ import annotations

from typing import Any, Iterable

import torch


def _fused_moe_modules(model: torch.nn.Module):
    for module in model.modules():
        quant_method = getattr(module, "quant_method", None)
        kernel = getattr(quant_method, "moe_kernel", None)
        fused = getattr(kernel, "fused_experts", None)
        if fused is not None and hasattr(fused, "process_weights_after_loading"):
            yield module, fused


class WeightSyncExtension:
    """Methods added to vLLM's worker. `self` is the worker (it has `model_runner`)."""

    def lh_reload_weights(self, named_tensors: Iterable[tuple[str, Any]], repack_moe: bool = True) -> int:
        """Load checkpoint-format (HF-named) tensors in place; return how many tensors were loaded.

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
            return count
        self.reload_weights(weights_iterator=as_tensors(), is_checkpoint_format=True)
        if repack_moe:
            for module, fused in _fused_moe_modules(model):
                fused.process_weights_after_loading(module)
        return count

    def lh_num_fused_moe_modules(self) -> int:
        """How many fused-MoE modules the repack fix touches (0 would mean the fix is inert)."""
        return sum(1 for _ in _fused_moe_modules(self.model_runner.get_model()))

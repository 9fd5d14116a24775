"""The learner's side of a shared-memory weight sync (rollout/shared_memory.py): where each tensor
the engines load lies in a slab, and the writing of a version into one, whole or bucket by bucket.

The engines load checkpoint-named tensors (`CausalLM.checkpoint_names`): transformers 5 keeps a
Mixtral's or Qwen3-MoE's experts fused in memory (`experts.gate_up_proj`, E × 2I × H) and renames
them into one tensor per expert by copying (the revert split gate from up with copies: 105 ms per
sync of the real policy, bf16). Most of those tensors are plain slices of the fused ones, so the
slab holds the learner's own tensors (cast to the engines' dtype), and the manifest names each
checkpoint tensor as a view into them: the cast into the slab is the sync's only copy on the
learner. Which slices they are is not written down per model: `layout` runs the model's own
renaming once on tensors of element indices and reads every output back as (offset, strides) into
the input it came from. A model whose renaming makes anything but slices (a sum, a reversed copy)
gets a layout of the renamed tensors themselves, written by running the renaming at every sync.
The same layout serves a slab in host memory or in the learner's GPU (CUDA IPC, for engines on
that GPU): only where the slab lies differs.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass

import torch

from rollout.shared_memory import SharedTensor, Slab, aligned
from rollout.weights import bucketize


@dataclass
class Layout:
    """Where a version lies in a slab: `regions` (name, shape, dtype, byte offset) are what the learner
    writes, in its source's order; `entries` (checkpoint name, region index, SharedTensor) what the
    engines read. `views`: the regions are the learner's own tensors (else the renamed ones)."""

    regions: list[tuple[str, tuple, torch.dtype, int]]
    entries: list[tuple[str, int, SharedTensor]]
    views: bool
    nbytes: int


def _region_dtype(dtype: torch.dtype, engine_dtype: torch.dtype) -> torch.dtype:
    return engine_dtype if dtype.is_floating_point else dtype


def _regions(named, engine_dtype: torch.dtype):
    regions, offset = [], 0
    for name, shape, dtype in named:
        dt = _region_dtype(dtype, engine_dtype)
        regions.append((name, tuple(shape), dt, offset))
        offset += aligned(max(1, torch.Size(shape).numel()) * dt.itemsize)
    return regions, offset


def _as_slice(t: torch.Tensor, starts: list[int], sizes: list[int]):
    """(region index, first element, strides) when index tensor `t` is a strided slice of one region
    (element indices counted across all regions), else None."""
    flat = t.reshape(-1)
    if not flat.numel():
        return None
    first = int(flat[0])
    r = bisect.bisect_right(starts, first) - 1
    stride = []
    for d, n in enumerate(t.shape):
        at = [0] * t.dim()
        at[d] = min(1, n - 1)
        stride.append(int(t[tuple(at)]) - first if n > 1 else 1)
    local = first - starts[r]
    if (
        any(s < 0 for s in stride)
        or local + sum((n - 1) * s for n, s in zip(t.shape, stride)) >= sizes[r]
    ):
        return None
    expected = torch.full((), first, dtype=t.dtype)
    for d, (n, s) in enumerate(zip(t.shape, stride)):
        shape = [1] * t.dim()
        shape[d] = n
        expected = expected + (torch.arange(n, dtype=t.dtype) * s).view(shape)
    return (r, local, tuple(stride)) if torch.equal(expected.expand(t.shape), t) else None


def layout(lm, named: list[tuple[str, torch.Tensor]], engine_dtype: torch.dtype) -> Layout:
    """The slab layout for the learner's (untied) state-dict tensors `named`, renamed as `lm` renames
    them for the engines. Runs the renaming once on index tensors, one decoder layer at a time."""
    regions, nbytes = _regions([(n, t.shape, t.dtype) for n, t in named], engine_dtype)
    sizes = [t.numel() for _, t in named]
    starts = [0]
    for n in sizes[:-1]:
        starts.append(starts[-1] + n)
    index = torch.int32 if sum(sizes) < 2**31 else torch.int64

    def indices():
        for (name, t), start in zip(named, starts):
            yield name, torch.arange(start, start + t.numel(), dtype=index).view(t.shape)

    entries = []
    for name, t in lm.checkpoint_names(indices()):
        hit = _as_slice(t, starts, sizes)
        if hit is None:
            return renamed_layout(lm, named, engine_dtype)
        r, local, stride = hit
        _, _, dt, offset = regions[r]
        entries.append(
            (
                name,
                r,
                SharedTensor(
                    offset + local * dt.itemsize,
                    tuple(t.shape),
                    stride,
                    str(dt).removeprefix("torch."),
                ),
            )
        )
    return Layout(regions, entries, True, nbytes)


def renamed_layout(lm, named: list[tuple[str, torch.Tensor]], engine_dtype: torch.dtype) -> Layout:
    """The fallback: every renamed tensor a region of its own (the renaming runs at every sync)."""
    out = [
        (n, tuple(t.shape), t.dtype)
        for n, t in lm.checkpoint_names((n, t.to("meta")) for n, t in named)
    ]
    regions, nbytes = _regions(out, engine_dtype)
    entries = [
        (
            name,
            i,
            SharedTensor(
                offset,
                shape,
                tuple(torch.empty(shape, device="meta").stride()),
                str(dt).removeprefix("torch."),
            ),
        )
        for i, (name, shape, dt, offset) in enumerate(regions)
    ]
    return Layout(regions, entries, False, nbytes)


class SharedPublisher:
    """Versions written into slabs: one per version in flight, reused once the driver releases it
    (`release`); at most `max_slabs` (beyond that `plan` answers None and the version goes through
    the object store). Cut like rollout/weights.py `Outgoing`: `take(i)` in order, `started`."""

    def __init__(self, layout: Layout, max_slabs: int = 4):
        self.layout, self.max_slabs = layout, max_slabs
        self.slabs: list[Slab] = []

    def plan(
        self, version: int, bucket_mb: float, source, device: torch.device | None = None
    ) -> dict | None:
        """Take a slab for `version` and plan its buckets (consecutive entries of at most `bucket_mb`
        MiB); `source` yields the regions' (name, tensor), read once, in order, as buckets are cut.
        `device`: a CUDA device puts the slab in its memory (engines on that GPU), else host memory."""
        device = torch.device("cpu") if device is None else torch.device(device)
        slab = next((s for s in self.slabs if s.version is None and s.device == device), None)
        if slab is None:
            idle = [s for s in self.slabs if s.version is None]  # free, but in the other memory
            if len(self.slabs) >= self.max_slabs and idle:
                self.slabs.remove(idle[0])
            if len(self.slabs) >= self.max_slabs:
                return None
            slab = Slab(self.layout.nbytes, device)
            self.slabs.append(slab)
        slab.version = version
        slab.mark(-1)
        sizes = ((i, _nbytes(ref)) for i, (_, _, ref) in enumerate(self.layout.entries))
        buckets = [
            [i for i, _ in g]
            for g in bucketize(sizes, max(1, int(bucket_mb * (1 << 20))), nbytes=lambda n: n)
        ]
        self.started = time.perf_counter()
        self._cut = {
            "slab": slab,
            "buckets": buckets,
            "source": iter(source),
            "written": 0,
            "next": 0,
        }
        names = [[self.layout.entries[i][0] for i in b] for b in buckets]
        nbytes = [sum(_nbytes(self.layout.entries[i][2]) for i in b) for b in buckets]
        return {
            "version": version,
            "names": names,
            "bytes": nbytes,
            "adapter": False,
            "bf16": False,
            "shared": slab.address,
        }

    def take(self, index: int) -> list[tuple[str, SharedTensor]]:
        """Write what bucket `index` views into the slab (the regions up to its last), and name its
        tensors. The last bucket writes every remaining region and marks the slab with the version."""
        cut = self._cut
        if index != cut["next"]:
            raise RuntimeError(
                f"weight sync of version {cut['slab'].version}: bucket {index} asked for, "
                f"bucket {cut['next']} is next"
            )
        entries = [self.layout.entries[i] for i in cut["buckets"][index]]
        last = index == len(cut["buckets"]) - 1
        self._write(cut, len(self.layout.regions) if last else max(r for _, r, _ in entries) + 1)
        cut["next"] += 1
        if last:
            cut["slab"].mark(cut["slab"].version)
        else:
            cut["slab"].flush()
        return [(name, ref) for name, _, ref in entries]

    def _write(self, cut: dict, upto: int) -> None:
        slab, regions = cut["slab"], self.layout.regions
        while cut["written"] < upto:
            name, t = next(cut["source"], (None, None))
            want, shape, dtype, offset = regions[cut["written"]]
            if name != want or tuple(t.shape) != shape:
                raise RuntimeError(
                    f"weight sync: the learner's tensor {cut['written']} is {name} "
                    f"{tuple(t.shape) if t is not None else ''}; its shared-memory layout expects "
                    f"{want} {shape}"
                )
            # the cast to the engines' dtype is this copy
            slab.region(offset, shape, dtype).copy_(t)
            cut["written"] += 1

    def release(self, version: int) -> None:
        """Every load of `version` is done: its slab may take the next version."""
        for slab in self.slabs:
            if slab.version == version:
                slab.version = None


def _nbytes(ref: SharedTensor) -> int:
    return torch.Size(ref.shape).numel() * getattr(torch, ref.dtype).itemsize

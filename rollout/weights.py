"""The weight sync's wire format: a published version is a `Manifest` of buckets in Ray's object store.

The learner cuts its state dict into buckets of at most `bucket_mb` MiB (`publish`); a rollout
worker fetches them one at a time while its engine loads them (`iter_weights`). How the driver
orchestrates a sync (deadlines, lost workers, the GPU/NCCL path) is rl/weight_sync/transport.py; this module is the
record both sides share, so it lives below both.

LoRA (rl/learner/lora.py): an adapter manifest (`Manifest.adapter`) carries, for each served tensor with an
adapter, `NAME.lora_B` (B·scale, out × r) followed by `NAME.lora_A` (r × in) — megabytes instead of the
model. `merge_adapters` turns them back into full tensors on the worker: the base tensor read from
the policy's checkpoint files (memory-mapped, so the workers on a node share one copy in the page
cache and no worker keeps a second copy of the model) plus B·A, one tensor at a time. Merging into
the served weights (rather than serving the adapter with vLLM's LoRA support) keeps one code path for
every engine, including MoE experts, and leaves no adapter-keyed prefix cache to go stale: a
turn's recorded policy version is the adapter version it was sampled with.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from rollout.shared_memory import CudaIpc, SlabReader, view, written_version


@dataclass
class Manifest:
    """One published version: what a rollout worker needs to fetch and load it."""

    version: int
    buckets: list  # ObjectRefs, each to a list of (name, array)
    bucket_bytes: list[int]
    names: list[list[str]] = field(default_factory=list)
    adapter: bool = (
        False  # the buckets hold LoRA factors to add to the base weights (merge_adapters)
    )
    bf16: bool = False  # its int16 arrays are bfloat16 bit patterns (`to_wire`): iter_weights views them back
    shared: str | CudaIpc | None = (
        None  # the learner's shared-memory slab: the buckets hold `SharedTensor`s into it
    )
    shared_node: str | None = (
        None  # the Ray node whose processes can open it (rollout/shared_memory.py)
    )

    @property
    def nbytes(self) -> int:
        return int(sum(self.bucket_bytes))


def bucketize(
    named: Iterable[tuple[str, np.ndarray]], max_bytes: int, nbytes=lambda a: a.nbytes
) -> Iterator[list[tuple[str, np.ndarray]]]:
    """Consecutive (name, array) pairs grouped so each group holds at most `max_bytes` (a single
    array larger than that is a group of its own). Order is kept: every array appears exactly once.
    Lazy: a group is yielded as soon as it is full, so a streamed source (a sharded learner
    gathering one tensor at a time) is never held whole. `nbytes` sizes an item (a plan of
    (name, size) pairs is cut exactly as the arrays themselves are)."""
    cur, size = [], 0
    for name, arr in named:
        if cur and size + nbytes(arr) > max_bytes:
            yield cur
            cur, size = [], 0
        cur.append((name, arr))
        size += nbytes(arr)
    if cur:
        yield cur


def wire_nbytes(t: torch.Tensor, dtype: torch.dtype) -> int:
    """The bytes `to_wire` sends for `t` to engines computing in `dtype` (without casting it)."""
    itemsize = (
        torch.empty((), dtype=dtype).element_size() if t.is_floating_point() else t.element_size()
    )
    return t.numel() * itemsize


def to_wire(
    named: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype
) -> Iterator[tuple[str, np.ndarray]]:
    """The (name, array) pairs a sync sends, from (name, CPU tensor), for engines that compute in `dtype`: floating tensors cast
    to it as they are read (bf16 engines get half the bytes of an fp32 learner's weights; only one
    tensor's copy exists at a time), the rest unchanged. numpy has no bfloat16, so bf16 travels as its
    bit pattern in int16 arrays, which `from_wire` (and the collective receiver) view back; a model
    whose own tensors are int16 cannot be sent that way and is refused by name."""
    for name, t in named:
        if dtype == torch.bfloat16 and t.dtype == torch.int16:
            raise ValueError(
                f"weight sync: {name} is an int16 tensor, which a bf16 sync cannot tell from bf16 bits"
            )
        if t.is_floating_point() and t.dtype != dtype:
            t = t.to(dtype)
        yield name, (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()


def from_wire(arr: np.ndarray, bf16: bool):
    """An array as it travelled → what the engine loads (a torch bf16 view of `to_wire`'s int16 bits)."""
    if bf16 and arr.dtype == np.int16:
        return torch.from_numpy(arr).view(torch.bfloat16)
    return arr


def publish(
    named: Iterable[tuple[str, np.ndarray]],
    version: int,
    bucket_mb: float,
    adapter: bool = False,
    bf16: bool = False,
) -> Manifest:
    """Put the weights (or, `adapter`, LoRA factors) into the object store, bucket by bucket (runs
    inside the learner). `bf16`: `named` comes from `to_wire(..., torch.bfloat16)`."""
    import ray  # here, not at the top: the merge side also runs where no Ray is installed (GPU checks)

    m = Manifest(version=version, buckets=[], bucket_bytes=[], names=[], adapter=adapter, bf16=bf16)
    # each bucket into the store as it fills
    for g in bucketize(named, max(1, int(bucket_mb * (1 << 20)))):
        m.buckets.append(ray.put(g))
        m.bucket_bytes.append(int(sum(a.nbytes for _, a in g)))
        m.names.append([n for n, _ in g])
    return m


class Outgoing:
    """One version published bucket by bucket on request, so the workers load the first buckets while
    the learner still casts and puts the later ones (rl/weight_sync/transport.py `start_sync`). The plan (every
    bucket's names and bytes) comes first, from sizes alone; `take(i)` then cuts bucket i from the
    lazy source, which is read once, in order. A bucket cut otherwise than planned fails by name."""

    def __init__(
        self,
        sizes: Iterable[tuple[str, int]],
        named: Iterable[tuple[str, np.ndarray]],
        version: int,
        bucket_mb: float,
        adapter: bool = False,
        bf16: bool = False,
    ):
        import time

        self.started = time.perf_counter()
        max_bytes = max(1, int(bucket_mb * (1 << 20)))
        plan = list(bucketize(sizes, max_bytes, nbytes=lambda n: n))
        self.plan = {
            "version": version,
            "names": [[n for n, _ in g] for g in plan],
            "bytes": [int(sum(s for _, s in g)) for g in plan],
            "adapter": adapter,
            "bf16": bf16,
        }
        self._buckets = enumerate(bucketize(named, max_bytes))

    def take(self, index: int) -> list[tuple[str, np.ndarray]]:
        i, bucket = next(self._buckets, (None, None))
        names = [n for n, _ in bucket] if bucket is not None else None
        if i != index or names != self.plan["names"][index]:
            raise RuntimeError(
                f"weight sync of version {self.plan['version']}: bucket {index} was planned as "
                f"{self.plan['names'][index][:3]}..., the weights gave {(names or [])[:3]}... "
                f"(bucket {i})"
            )
        return bucket


def planned_manifest(plan: dict, refs: list) -> Manifest:
    """An `Outgoing` plan's manifest, its buckets the (maybe still pending) results of `take`, in order."""
    return Manifest(
        version=plan["version"],
        buckets=list(refs),
        bucket_bytes=plan["bytes"],
        names=plan["names"],
        adapter=plan["adapter"],
        bf16=plan["bf16"],
        shared=plan.get("shared"),
        shared_node=plan.get("shared_node"),
    )


def iter_weights(manifest: Manifest) -> Iterator[tuple[str, np.ndarray]]:
    """(name, array) pairs of a manifest, fetching one bucket at a time (runs inside a rollout worker);
    a bf16 manifest's tensors come as torch bf16 views. The previous bucket is released before the next
    is fetched. A shared-memory manifest's tensors are views of the learner's slab (its buckets, plain
    lists or object refs, name where they lie), and the slab must still hold this version once they
    have all been read: a slab rewritten meanwhile fails the load (rollout/shared_memory.py)."""
    import ray

    slab = _shared_slab(manifest) if manifest.shared else None
    for ref in manifest.buckets:
        bucket = ray.get(ref) if isinstance(ref, ray.ObjectRef) else ref
        for name, arr in bucket:
            yield name, view(slab, arr) if slab is not None else from_wire(arr, manifest.bf16)
        del bucket
    # a GPU slab (CUDA IPC): the engine's copies from it must be done
    if slab is not None and slab.is_cuda:
        torch.cuda.synchronize(slab.device)
    if slab is not None and written_version(slab) != manifest.version:
        raise RuntimeError(
            f"weight sync to version {manifest.version}: the learner's shared-memory slab now holds "
            f"version {written_version(slab)}; it was rewritten while this worker read it"
        )


_SLABS = SlabReader()


def _shared_slab(manifest: Manifest):
    import ray

    here = ray.get_runtime_context().get_node_id()
    if manifest.shared_node is not None and here != manifest.shared_node:
        raise RuntimeError(
            f"weight sync to version {manifest.version}: published in shared memory on node "
            f"{manifest.shared_node}, and this rollout worker runs on node {here}"
        )
    return _SLABS.open(manifest.shared)


class CheckpointTensors:
    """Tensors of a Hugging Face checkpoint directory by name, memory-mapped from its safetensors
    files (one file, or several listed in `model.safetensors.index.json`)."""

    def __init__(self, path: str | Path):
        path = Path(path)
        index = path / "model.safetensors.index.json"
        if index.exists():
            self.files = {
                n: path / f for n, f in json.loads(index.read_text())["weight_map"].items()
            }
        elif (path / "model.safetensors").exists():
            from safetensors import safe_open

            with safe_open(path / "model.safetensors", "pt") as f:
                self.files = {n: path / "model.safetensors" for n in f.keys()}
        else:
            raise FileNotFoundError(
                f"{path}: no model.safetensors (LoRA sync merges into a safetensors checkpoint)"
            )
        self._open: dict = {}

    def __getitem__(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        if name not in self.files:
            raise KeyError(f"LoRA sync: {name!r} is not a tensor of the base checkpoint")
        f = self.files[name]
        if f not in self._open:
            self._open[f] = safe_open(f, "pt")
        return self._open[f].get_tensor(name)


def merge_adapters(
    base: CheckpointTensors, factors: Iterable[tuple[str, np.ndarray]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, base + B·A) for each `NAME.lora_B`, `NAME.lora_A` pair of an adapter manifest, in the
    base tensor's dtype (the product in fp32), one tensor at a time."""
    pending: dict = {}
    for key, arr in factors:
        name, _, part = key.rpartition(".")
        if part == "lora_B":
            pending[name] = arr
            continue
        if part != "lora_A" or name not in pending:
            raise ValueError(
                f"LoRA sync: unexpected tensor {key!r} in an adapter manifest (want NAME.lora_B, then NAME.lora_A)"
            )
        w = base[name]
        # numpy from the object store (read-only views: the small factors are copied) or torch (collective)
        b_, a_ = (
            torch.from_numpy(x.copy()) if isinstance(x, np.ndarray) else x
            for x in (pending.pop(name), arr)
        )
        delta = b_.float() @ a_.float()
        if delta.shape != w.shape:
            raise ValueError(
                f"LoRA sync: {name}: B·A is {tuple(delta.shape)}, the base tensor {tuple(w.shape)}"
            )
        yield name, (w.to(delta.device).float() + delta).to(w.dtype)
    if pending:
        raise ValueError(f"LoRA sync: {sorted(pending)[0]}.lora_B came without its lora_A")

"""Weight sync over a process group (`sync.transport: collective`): the learner broadcasts each bucket
to every rollout worker, NCCL between GPUs, gloo on CPUs.

The object-store path (rollout/weights.py) copies the weights into Ray's store and every worker
fetches them from there; on GPUs that is two trips through host memory. Here the learner's rank 0
and the rollout workers form their own process group (`SyncGroup`, created by the driver at
start-up and again whenever a worker is replaced: rl/weight_sync/transport.py `form_group`). It is a standalone
group (its own TCP store, not torch.distributed's default group), so it lives beside a learner
group's FSDP group and beside vLLM's own. A version travels as buckets of at most `bucket_mb` MiB:

    header: int64 [n]        the JSON description's length (0: no more buckets)
    description: uint8 [n]   {"version", "adapter", "nbytes", "tensors": [[name, dtype, shape, offset], ...]}
    buffer: uint8 [nbytes]   the bucket's tensors, flattened, each at a 16-byte-aligned offset

A receiver allocates one buffer per bucket on its device (the GPU for NCCL), cuts it into views by the
description and hands them to its engine's `load_weights` while the next bucket is still to come:
one bucket is in flight, the memory bound of the object-store path. Collectives block until every
member takes part, so a broadcast has the group's timeout (`sync.timeout_s`): a member that died or
never joined fails the sync instead of hanging it, and the driver forms a new group.

What is sent is whatever the learner publishes: full weights, or LoRA factors (`adapter`: the worker
merges them into its base weights, as on the object-store path).

Not covered: an engine on the learner's own GPU (NCCL refuses two ranks on one device: a one-GPU
config syncs through a slab in that GPU's memory, CUDA IPC, rollout/shared_memory.py), and
broadcasting in async mode (the broadcast would hold the learner until every worker's queued
rollouts end; `sync.transport: collective` needs `schedule.mode: sync`).
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Iterable, Iterator

import numpy as np
import torch


class NotInGroup(RuntimeError):
    """A rollout worker asked to receive before it joined the sync group (Ray restarted it since)."""


ALIGN = 16  # every tensor starts at a multiple of this many bytes of its bucket, so views of any dtype are aligned


class SyncGroup:
    """One member of the sync group: rank 0 sends (the learner), the others receive."""

    def __init__(self, master: str, rank: int, world: int, backend: str, timeout_s: float):
        import torch.distributed as dist

        host, port = master.rsplit(":", 1)
        timeout = datetime.timedelta(seconds=timeout_s)
        self.rank, self.world, self.backend = rank, world, backend
        self.store = dist.TCPStore(host, int(port), world, is_master=rank == 0, timeout=timeout)
        if backend == "gloo":
            self.pg = dist.ProcessGroupGloo(self.store, rank, world, timeout)
            self.device = torch.device("cpu")
        elif backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self.pg = dist.ProcessGroupNCCL(self.store, rank, world, options)
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            raise ValueError(f"sync backend must be gloo or nccl, got {backend!r}")

    def _broadcast(self, t: torch.Tensor) -> None:
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self.pg.broadcast([t], opts).wait()

    def send(
        self,
        named: Iterable[tuple[str, np.ndarray]],
        version: int,
        bucket_mb: float,
        adapter: bool = False,
        bf16: bool = False,
    ) -> dict:
        """Broadcast (name, array) pairs in buckets (rank 0); returns bytes and buckets sent. `bf16`:
        the int16 arrays are bf16 bits (rollout/weights.py `to_wire`), received as bf16 tensors."""
        from rollout.weights import bucketize

        sent, buckets = 0, 0
        for group in bucketize(named, max(1, int(bucket_mb * (1 << 20)))):
            tensors, offset = [], 0
            for name, arr in group:
                tensors.append([name, str(arr.dtype), list(arr.shape), offset])
                offset += -(-arr.nbytes // ALIGN) * ALIGN
            buf = torch.zeros(offset, dtype=torch.uint8)
            for (_, arr), (_, _, _, off) in zip(group, tensors):
                flat = torch.from_numpy(np.ascontiguousarray(arr).reshape(-1).view(np.uint8))
                buf[off : off + flat.numel()] = flat
            desc = json.dumps(
                {
                    "version": version,
                    "adapter": adapter,
                    "bf16": bf16,
                    "nbytes": offset,
                    "tensors": tensors,
                }
            ).encode()
            self._broadcast(torch.tensor([len(desc)], dtype=torch.int64, device=self.device))
            self._broadcast(torch.frombuffer(bytearray(desc), dtype=torch.uint8).to(self.device))
            self._broadcast(buf.to(self.device))
            sent += sum(arr.nbytes for _, arr in group)
            buckets += 1
        self._broadcast(torch.zeros(1, dtype=torch.int64, device=self.device))  # the end
        return {"bytes": sent, "buckets": buckets}

    def receive(self) -> Iterator[tuple[dict, Iterator[tuple[str, torch.Tensor]]]]:
        """(description, its (name, tensor) views) per bucket until the sender's end (ranks > 0).
        Each bucket gets a buffer of its own, freed when no view of it is left."""
        while True:
            size = torch.zeros(1, dtype=torch.int64, device=self.device)
            self._broadcast(size)
            if int(size) == 0:
                return
            raw = torch.zeros(int(size), dtype=torch.uint8, device=self.device)
            self._broadcast(raw)
            desc = json.loads(bytes(raw.cpu().numpy()))
            buf = torch.empty(desc["nbytes"], dtype=torch.uint8, device=self.device)
            self._broadcast(buf)
            yield desc, _views(buf, desc["tensors"], desc["bf16"])


def _views(buf: torch.Tensor, tensors: list, bf16: bool) -> Iterator[tuple[str, torch.Tensor]]:
    for name, dtype, shape, off in tensors:
        dt = torch.bfloat16 if bf16 and dtype == "int16" else getattr(torch, np.dtype(dtype).name)
        n = int(np.prod(shape)) * torch.empty(0, dtype=dt).element_size()
        yield name, buf[off : off + n].view(dt).reshape(shape)


def received_weights(group: SyncGroup, meta: dict) -> Iterator[tuple[str, torch.Tensor]]:
    """Every (name, tensor) of one version, bucket after bucket, for an engine's `load_weights`;
    `meta` is filled with the version, whether it is an adapter, bytes and buckets."""
    meta.update(version=None, adapter=False, bytes=0, buckets=0)
    for desc, views in group.receive():
        if meta["version"] is not None and desc["version"] != meta["version"]:
            raise RuntimeError(
                f"weight sync: a bucket of version {desc['version']} inside version {meta['version']}"
            )
        meta.update(version=desc["version"], adapter=desc["adapter"], buckets=meta["buckets"] + 1)
        for name, t in views:
            meta["bytes"] += t.numel() * t.element_size()
            yield name, t

"""Versioned weight sync: the learner publishes its weights once, every rollout worker loads them in place.

CPU path (what runs here and on any Ray cluster): the learner cuts its state dict into buckets of
at most `bucket_mb` MiB (a tensor larger than that gets a bucket of its own) and puts each bucket
once into Ray's object store. It hands back a `Manifest`: the version, the bucket references and
their sizes, never the arrays. Each rollout worker then fetches the buckets one at a time while
its engine loads them (`iter_weights` feeds vLLM's reload as a lazy iterator), so a worker pins at
most one bucket of published weights on top of its engine's own parameters; workers on the
learner's node read the buckets zero-copy from shared memory, workers on other nodes pull them
through Ray's object transfer. The wire format (`Manifest`, `publish`, `iter_weights`) is
rollout/weights.py. The driver drops the manifest after the sync and the buckets are
freed.

GPU path (not exercised on CPU machines): the same manifest shape, but the buckets are flattened
into one contiguous GPU buffer per bucket on learner rank 0 and broadcast with NCCL over a process
group that joins the learner and every rollout engine's workers (vLLM's `StatelessProcessGroup` /
`PyNcclCommunicator`, created once at start-up); each engine receives a bucket into a buffer of the
same size, splits it into views by the manifest's names, shapes and offsets, and calls
`load_weights` on them. Only the buffer of one bucket is in flight at a time, which bounds the
extra GPU memory exactly like the bucket size bounds host memory here.

Every sync has a deadline: a worker that has not loaded the version in time is named in the
`TimeoutError`, and so is a worker that reports another version than the one published. A worker
whose process died is reported back (`PendingSync.lost`) for the driver to restore.
"""

from __future__ import annotations

import time

import ray

from rl.ray_utils import result
from rollout.weights import Manifest

# How a rollout worker's death shows in a call to it: its process died (crash, kill, node loss),
# its result was lost with it, or Ray's memory monitor killed it (the actor restarts like a crash).
WORKER_LOST = (ray.exceptions.RayActorError, ray.exceptions.ObjectLostError, ray.exceptions.OutOfMemoryError)


class PendingSync:
    """The load calls of one published version, on every worker; `finish` waits for them."""

    def __init__(self, manifest: Manifest, futures: dict, publish_s: float, started: float):
        self.manifest, self.publish_s, self.started = manifest, publish_s, started
        self.futures = futures  # load ref -> index of its rollout worker
        self.version = manifest.version
        self.lost: list[int] = []  # workers that died before loading this version (see `finish`)

    def finish(self, timeout_s: float) -> dict:
        """Wait for every worker's load; metrics of the sync. `timeout_s` counts from this call, so
        a load queued behind a rollout on its worker is not blamed for the rollout's time.

        A worker whose process died is not an error here: it is listed in `self.lost` (and the
        `sync_workers_lost` metric) for the driver, which brings it back and syncs it again once
        Ray has restarted it. A live worker that is late, fails or loads another version is."""
        refs = list(self.futures)
        ready, late = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        if late:
            names = ", ".join(f"rollout worker {self.futures[r]}" for r in late)
            raise TimeoutError(f"weight sync to version {self.version}: {names} did not load it within {timeout_s:.0f}s")
        loads = []
        for ref in ready:
            try:
                loads.append((ref, ray.get(ref)))
            except WORKER_LOST:
                self.lost.append(self.futures[ref])
            except ray.exceptions.RayError as exc:
                raise RuntimeError(f"weight sync to version {self.version}: rollout worker {self.futures[ref]} "
                                   f"failed: {exc}") from exc
        for ref, r in loads:
            if r["version"] != self.version:
                raise RuntimeError(f"weight sync: rollout worker {self.futures[ref]} reports version {r['version']}, "
                                   f"expected {self.version}")
        self.manifest = None  # the buckets are freed once nobody holds a reference
        out = {"sync_version": self.version, "sync_publish_s": self.publish_s,
               "sync_wall_s": time.perf_counter() - self.started, "sync_workers_lost": len(self.lost)}
        if loads:
            load_max = max(r["load_s"] for _, r in loads)
            # sync_s: what delivering the version cost (publish + the slowest load), in either mode;
            # sync_wall_s also counts the wait behind rollouts queued before the loads (async mode)
            out.update({"sync_s": self.publish_s + load_max, "sync_load_s_max": load_max,
                        "sync_bytes": loads[0][1]["bytes"], "sync_buckets": loads[0][1]["buckets"]})
        return out


def start_sync(learner, workers: list, bucket_mb: float, indices: list[int] | None = None) -> PendingSync:
    """Publish the learner's current weights and queue a load on every worker (returns at once
    after the publish; on each worker the load runs after the calls already queued there).
    `indices` names the workers in errors (default: their positions in `workers`)."""
    t0 = time.perf_counter()
    manifest = result(learner.publish.remote(bucket_mb))  # a learner group answers with rank 0's manifest
    publish_s = time.perf_counter() - t0
    indices = list(range(len(workers))) if indices is None else indices
    futures = {w.load_weights.remote(manifest): i for i, w in zip(indices, workers)}
    return PendingSync(manifest, futures, publish_s, t0)

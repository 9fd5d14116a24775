"""Versioned weight sync: the learner publishes its weights once, every rollout worker loads them in place.

CPU path (what runs here and on any Ray cluster): the learner cuts its state dict into buckets of
at most `bucket_mb` MiB (a tensor larger than that gets a bucket of its own) and puts each bucket
once into Ray's object store. A `Manifest` describes the version: the bucket references and their
sizes, never the arrays. A single learner may stream (`start_sync`, `sync.publish`): it plans the
buckets from the tensors' sizes, and the workers get the manifest of buckets still being cut, so
they load the first while the learner casts and puts the next; otherwise (on CPU-only nodes by
default: there the two share the cores) and in a learner group it puts them all first. Each
rollout worker fetches the buckets one at a time while
its engine loads them (`iter_weights` feeds vLLM's reload as a lazy iterator), so a worker pins at
most one bucket of published weights on top of its engine's own parameters; workers on the
learner's node read the buckets zero-copy from shared memory, workers on other nodes pull them
through Ray's object transfer. The wire format (`Manifest`, `publish`, `Outgoing`, `iter_weights`)
is rollout/weights.py. The driver drops the manifest after the sync and the buckets are
freed.

Shared-memory path (`sync.shared_memory`, the default where the learner and every worker share a
node): the same buckets, but the learner writes the tensors into a shared-memory slab it keeps
(rl/learner/shared_weights.py, rollout/shared_memory.py) and a bucket only names where they lie; the
workers' engines read them in place. `ray.put` alone cost ~3× a memcpy of its bytes, which is what
this skips. The driver hands the slab back (`release_shared`) once every load is done. A learner
on a GPU whose every engine runs on that same GPU (configs/gpu/one_gpu.yaml) keeps the slab in GPU
memory and the engines map it through CUDA IPC (`shared_memory_kind`; metric `sync_shared_gpu`).

Collective path (`sync.transport: collective`; NCCL between GPUs, gloo on CPUs, rollout/collective.py):
the learner's rank 0 and every rollout worker form their own process group at start-up
(`form_group`); a sync queues a receive on every worker and a broadcast on the learner
(`start_collective_sync`), and each bucket travels flattened into one buffer, described by a
small JSON header, and is loaded while the next one is still to come. Only one bucket's buffer is
in flight, which bounds the extra (GPU) memory exactly like the bucket size bounds host memory on
the object-store path. A member that dies fails the broadcast for all (the group's timeout is
`sync.timeout_s`); the driver then waits for Ray to restart the worker, forms the group again and
syncs everyone.

Every sync has a deadline: a worker that has not loaded the version in time is named in the
`TimeoutError`, and so is a worker that reports another version than the one published. A worker
whose process died is reported back (`PendingSync.lost`) for the driver to restore.
"""

from __future__ import annotations

import time

import ray

from rl.ray_utils import result
from rollout.shared_memory import CudaIpc
from rollout.weights import Manifest, planned_manifest

# How a rollout worker's death shows in a call to it: its process died (crash, kill, node loss),
# its result was lost with it, or Ray's memory monitor killed it (the actor restarts like a crash).
WORKER_LOST = (
    ray.exceptions.RayActorError,
    ray.exceptions.ObjectLostError,
    ray.exceptions.OutOfMemoryError,
)


class PendingSync:
    """The load calls of one published version, on every worker; `finish` waits for them. On the
    collective path `sender` is the learner's broadcast, which finishes with the loads."""

    def __init__(
        self,
        manifest: Manifest | None,
        futures: dict,
        publish_s: float,
        started: float,
        version: int | None = None,
        sender=None,
        publish_seconds_ref=None,
    ):
        self.manifest, self.publish_s, self.started = manifest, publish_s, started
        self.publish_seconds_ref = (
            publish_seconds_ref  # a streamed publish: the learner's seconds, once it is done
        )
        self.futures = futures  # load ref -> index of its rollout worker
        self.version = manifest.version if manifest is not None else version
        self.sender = sender
        self.lost: list[int] = []  # workers that died before loading this version (see `finish`)
        self.release = (
            None  # a shared-memory version: hands its slab back to the learner (`start_sync`)
        )

    def _published(self) -> float:
        """The learner's publish seconds (a streamed publish reports them once its last bucket is
        in the object store)."""
        if self.publish_seconds_ref is None:
            return self.publish_s
        return ray.get(self.publish_seconds_ref, timeout=30)

    def _check_buckets(self) -> None:
        """A streamed publish: raise, naming the learner, if it failed to cut one of the buckets (on a
        failed load only: reading the buckets here would pull them to the driver's node)."""
        if self.publish_seconds_ref is None or self.manifest is None:
            return
        for ref in self.manifest.buckets:
            try:
                ray.get(ref, timeout=30)
            except ray.exceptions.RayTaskError as exc:
                raise RuntimeError(
                    f"weight sync to version {self.version}: the learner failed to publish it: "
                    f"{getattr(exc, 'cause', None) or exc}"
                ) from exc

    def _sent(self, late: list) -> None:
        """The collective path: the learner's broadcast finished (or is still waiting for a late worker,
        named by the caller) and sent the version the driver expects."""
        try:
            sent = ray.get(self.sender, timeout=0 if late else 30)
        except ray.exceptions.GetTimeoutError:
            return
        except ray.exceptions.RayTaskError as exc:
            raise RuntimeError(
                f"weight sync to version {self.version}: the learner's broadcast failed: {exc}"
            ) from exc
        if sent["version"] != self.version:
            raise RuntimeError(
                f"weight sync: the learner broadcast version {sent['version']}, expected {self.version}"
            )
        self.publish_s = sent["send_s"]

    def finish(self, timeout_s: float) -> dict:
        """Wait for every worker's load; metrics of the sync. `timeout_s` counts from this call, so
        a load queued behind a rollout on its worker is not blamed for the rollout's time.

        A worker whose process died is not an error here: it is listed in `self.lost` (and the
        `sync_workers_lost` metric) for the driver, which brings it back and syncs it again once
        Ray has restarted it. A live worker that is late, fails or loads another version is."""
        refs = list(self.futures)
        ready, late = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        if self.sender is not None:
            dead = [self.futures[r] for r in ready if _died(r)]
            if dead:  # a broadcast fails for every member: the driver restores the dead, forms the group again
                self.lost = dead
                return {
                    "sync_version": self.version,
                    "sync_workers_lost": len(dead),
                    "sync_wall_s": time.perf_counter() - self.started,
                }
            self._sent(late)
        if late:
            names = ", ".join(f"rollout worker {self.futures[r]}" for r in late)
            raise TimeoutError(
                f"weight sync to version {self.version}: {names} did not load it within {timeout_s:.0f}s"
            )
        loads = []
        for ref in ready:
            try:
                loads.append((ref, ray.get(ref)))
            except WORKER_LOST:
                self.lost.append(self.futures[ref])
            except ray.exceptions.RayError as exc:
                self._check_buckets()  # a bucket the learner failed to cut fails every load: blame the learner
                raise RuntimeError(
                    f"weight sync to version {self.version}: rollout worker {self.futures[ref]} "
                    f"failed: {exc}"
                ) from exc
        for ref, r in loads:
            if r["version"] != self.version:
                raise RuntimeError(
                    f"weight sync: rollout worker {self.futures[ref]} reports version {r['version']}, "
                    f"expected {self.version}"
                )
        published = self._published()
        shared = bool(self.manifest is not None and self.manifest.shared)
        on_gpu = shared and isinstance(self.manifest.shared, CudaIpc)
        self.manifest = None  # the buckets are freed once nobody holds a reference
        # every load is done (a late one raised above: its slab stays held)
        if self.release is not None:
            self.release()
        out = {
            "sync_version": self.version,
            "sync_publish_s": published,
            "sync_wall_s": time.perf_counter() - self.started,
            "sync_workers_lost": len(self.lost),
            "sync_shared": shared,
            "sync_shared_gpu": on_gpu,
        }
        if loads:
            load_max = max(r["load_s"] for _, r in loads)
            # sync_s: what delivering the version cost (the publish until the loads were queued + the
            # slowest load, which with a streamed publish includes waiting for its buckets), in either
            # mode; sync_wall_s also counts the wait behind rollouts queued before the loads (async mode)
            out.update(
                {
                    "sync_s": self.publish_s + load_max,
                    "sync_load_s_max": load_max,
                    # waiting for this node's other CPU engines to load first (rollout.serial_cpu_loads)
                    "sync_load_wait_s_max": max(r.get("load_wait_s", 0.0) for _, r in loads),
                    "sync_bytes": loads[0][1]["bytes"],
                    "sync_buckets": loads[0][1]["buckets"],
                }
            )
            if all("direct" in r for _, r in loads):
                # tensors the slowest-path worker loaded straight where its engine reads them, not
                # through vLLM's layerwise reload (rollout/engines/vllm_ext.py), of those it received
                out.update(
                    {
                        "sync_tensors": loads[0][1]["tensors"],
                        "sync_direct_tensors": min(r["direct"] for _, r in loads),
                    }
                )
            # expert layers packed straight from what was sent
            if all("unstaged" in r for _, r in loads):
                out["sync_unstaged_expert_layers"] = min(r["unstaged"] for _, r in loads)
        return out


def _died(ref) -> bool:
    """Whether a collective load failed because its worker died: the call was lost with the process,
    or it reached the restarted worker, which is in no group yet."""
    from rollout.collective import NotInGroup

    try:
        ray.get(ref, timeout=0)
    except WORKER_LOST + (NotInGroup,):
        return True
    except Exception:  # noqa: BLE001  (any other outcome is not a death)
        return False
    return False


def form_group(learner, workers: list, backend: str, timeout_s: float) -> None:
    """(Re)form the weight-sync process group: the learner's rank 0 (rank 0 of the group, the
    sender) and every rollout worker (ranks 1..N), at a free port on the learner's node."""
    master = result(learner.address.remote())
    world = len(workers) + 1
    refs = learner.join_sync_group.remote(master, world, backend, timeout_s)
    refs = (refs if isinstance(refs, list) else [refs]) + [
        w.join_sync_group.remote(master, i + 1, world, backend, timeout_s)
        for i, w in enumerate(workers)
    ]
    ray.get(refs, timeout=timeout_s + 30)


def start_collective_sync(learner, workers: list, bucket_mb: float, version: int) -> PendingSync:
    """Queue a receive on every worker and the learner's broadcast of `version` (its current one);
    returns at once. Every worker of the group must be in `workers`: a broadcast waits for all."""
    t0 = time.perf_counter()
    futures = {w.receive_weights.remote(): i for i, w in enumerate(workers)}
    sender = learner.broadcast_weights.remote(bucket_mb)
    sender = sender[0] if isinstance(sender, list) else sender  # a learner group: rank 0 sends
    return PendingSync(None, futures, 0.0, t0, version=version, sender=sender)


def start_sync(
    learner,
    workers: list,
    bucket_mb: float,
    indices: list[int] | None = None,
    stream: bool = True,
    shared: bool = False,
) -> PendingSync:
    """Publish the learner's current weights and queue a load on every worker; returns once the
    loads are queued (on each worker a load runs after the calls already queued there).
    `indices` names the workers in errors (default: their positions in `workers`).

    `stream` (a single learner; `sync.publish`): it plans the buckets from the tensors' sizes, the
    driver asks for each bucket (`publish_bucket`, a call whose result is the bucket in the object
    store) and hands the workers the manifest of those pending results at once, so a worker loads
    bucket 1 while the learner casts and puts bucket 2. Otherwise, and always for a learner group
    (its gathers are collective), the learner puts every bucket before the loads are queued.

    `shared` (`sync.shared_memory`): when the learner and every worker share a node, the learner
    writes the version into shared memory instead of the object store (rollout/shared_memory.py),
    in its GPU's memory when it trains on a GPU every worker's engine shares (CUDA IPC), and its slab
    is released to it once every load is done."""
    t0 = time.perf_counter()
    kind = shared_memory_kind(*placements(learner, workers)) if shared else None
    shared = {"shared": kind} if kind else {}
    plan = result(learner.plan_publish.remote(bucket_mb, **shared)) if stream else None
    seconds = None
    if plan is None:
        # a learner group answers with rank 0's manifest
        manifest = result(learner.publish.remote(bucket_mb, **shared))
    else:
        manifest = planned_manifest(
            plan, [_one(learner.publish_bucket.remote(i)) for i in range(len(plan["names"]))]
        )
        seconds = _one(learner.publish_seconds.remote())  # runs right after the last bucket
    publish_s = time.perf_counter() - t0
    indices = list(range(len(workers))) if indices is None else indices
    futures = {w.load_weights.remote(manifest): i for i, w in zip(indices, workers)}
    pending = PendingSync(manifest, futures, publish_s, t0, publish_seconds_ref=seconds)
    if manifest is not None and manifest.shared:
        pending.release = lambda: _one(learner.release_shared.remote(manifest.version))
    return pending


def placements(learner, workers: list) -> tuple[dict | None, list[dict]]:
    """Where the learner (a single one; None for a group, which publishes through the object store)
    and each worker run: {"node": Ray node id, "gpus": UUIDs of the GPUs its process uses}. Asked at
    every sync: a worker Ray restarted may be elsewhere. (In async mode a worker runs this call
    beside its rollouts; in sync mode it has none queued.)"""
    # rl/learner/learner_group.py LearnerGroup, or the actor itself
    ranks = getattr(learner, "actors", [learner])
    if len(ranks) > 1:
        return None, []
    places = ray.get([a.placement.remote() for a in [ranks[0], *workers]], timeout=60)
    return places[0], places[1:]


def shared_memory_kind(learner: dict | None, workers: list[dict]) -> str | None:
    """Which memory a shared sync goes through: "cuda" when the learner trains on a GPU that every
    worker's engine runs on (CUDA IPC, rollout/shared_memory.py), "host" when they share the
    learner's node, None when a worker is elsewhere (or the learner is a group): the object store."""
    if learner is None or any(w["node"] != learner["node"] for w in workers):
        return None
    gpu = learner["gpus"][0] if learner["gpus"] else None
    return "cuda" if gpu and workers and all(gpu in w["gpus"] for w in workers) else "host"


def _one(ref):
    """A learner call's ref (a group of one answers with a list)."""
    return ref[0] if isinstance(ref, list) else ref

"""When and to whom the learner's weights go: the driver's side of the weight sync.

`WeightSync` owns the learner's newest version and what is queued towards the engines:
- `now()`: publish (or, collective transport, broadcast) the current weights and wait until every
  rollout worker has loaded them (the sync schedule, the warm start, a resume);
- `queue(after)`: start a sync that loads behind every rollout already submitted, without waiting
  (the async schedule), and `finish_queued(collected)` once the rollouts in front of it are in;
- `restore(i, min_version)`: wait until Ray has restarted rollout worker `i`, then bring it to the
  current weights (on the collective transport, form the group again and sync everyone).

How a version travels (buckets, shared memory, a collective group) is rl/weight_sync/transport.py's; this module
only decides when. A learner that dies on the way raises `LearnerDied` (rl/loop/actors.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import ray

from rl.config import SyncConfig
from rl.faults import WorkerLost, learner_alive
from rl.weight_sync.transport import PendingSync, form_group, start_collective_sync, start_sync


class WeightSync:
    def __init__(
        self,
        cfg: SyncConfig,
        learner,
        workers: list,
        run_dir: Path,
        log: Callable[[str], None],
        *,
        backend: str = "gloo",
        stream: bool = False,
        max_restarts: int = 3,
    ):
        """`backend` and `stream`: `sync.backend` and `sync.publish` as the run resolved them
        (they depend on where the learner and the engines run: `RunConfig.sync_backend`,
        `sync_streams`); `max_restarts`: Ray's, named when a worker does not come back."""
        self.cfg, self.learner, self.workers, self.run_dir, self.log = (
            cfg,
            learner,
            workers,
            run_dir,
            log,
        )
        self.backend, self.stream, self.max_restarts = backend, stream, max_restarts
        self.version = 0  # the learner's newest version: what the engines must reach
        # (last iteration submitted before it, sync)
        self.queued: list[tuple[int, PendingSync]] = []
        self.worker_restarts = 0  # rollout worker deaths this driver recovered from, so far

    @property
    def collective(self) -> bool:
        return self.cfg.transport == "collective"

    def form_group(self) -> None:
        with learner_alive(self.run_dir, "forming the weight-sync group"):
            form_group(self.learner, self.workers, self.backend, self.cfg.timeout_s)

    def _publish(self, workers: list, indices: list[int] | None = None) -> PendingSync:
        with learner_alive(self.run_dir, "publishing weights"):
            return start_sync(
                self.learner,
                workers,
                self.cfg.bucket_mb,
                indices,
                stream=self.stream,
                shared=self.cfg.shared_memory,
            )

    def now(self) -> dict:
        """Publish (or broadcast) the learner's weights and wait until every worker has loaded them.
        A worker that died meanwhile is restored, then synced on its own (on the collective
        transport its death broke the broadcast for all: the group is formed again and everyone is
        synced). Metrics of the sync."""
        if not self.workers:  # training from a store: nobody to sync
            return {}
        if self.collective:  # the learner broadcasts: it is busy until every worker has loaded
            with learner_alive(self.run_dir, "broadcasting weights"):
                pending = start_collective_sync(
                    self.learner, self.workers, self.cfg.bucket_mb, self.version
                )
                out = pending.finish(self.cfg.timeout_s)
        else:
            pending = self._publish(self.workers)
            out = pending.finish(self.cfg.timeout_s)
        for i in pending.lost:
            self.restore(i, pending.version)
        return out

    def queue(self, after: int) -> None:
        """Start a sync whose load queues behind every rollout already submitted (the last of them
        of iteration `after`); what is submitted next uses it."""
        self.queued.append((after, self._publish(self.workers)))

    def finish_queued(self, collected: int) -> dict:
        """Wait for the queued syncs that no longer sit behind a rollout still running (every
        rollout up to iteration `collected` is in); metrics of the newest one."""
        out = {}
        while self.queued and self.queued[0][0] <= collected:
            pending = self.queued.pop(0)[1]
            out = pending.finish(self.cfg.timeout_s)
            # a worker that died before this load: its queued rollouts fail and are rerun on collection;
            # syncing it now keeps rollouts submitted later from meeting an unsynced worker
            for i in pending.lost:
                self.restore(i, pending.version)
        return out

    def finish_all(self) -> dict:
        """Every queued sync loaded (nothing is left to roll out: the last versions must still arrive)."""
        out = {}
        while self.queued:
            out = self.finish_queued(self.queued[0][0])
        return out

    def restore(self, i: int, min_version: int) -> None:
        """Wait until Ray has restarted rollout worker `i`, then sync it to the learner's current
        weights if it holds an older version than `min_version` (collective transport: the sync
        group is formed again with it and every worker is synced)."""
        self.worker_restarts += 1
        w, timeout = self.workers[i], self.cfg.timeout_s
        deadline = time.monotonic() + timeout
        while True:
            try:
                version = ray.get(w.version.remote(), timeout=max(1.0, deadline - time.monotonic()))
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as exc:
                # unreachable while Ray notices the death and restarts it (vLLM takes a while to start)
                if time.monotonic() > deadline:
                    raise WorkerLost(
                        f"rollout worker {i} did not come back within sync.timeout_s={timeout:.0f}s (Ray restarts "
                        f"it at most ray.max_restarts={self.max_restarts} times; last error: "
                        f"{type(exc).__name__}: {exc})"
                    ) from None
                time.sleep(1.0)
                continue
            if self.collective:  # the restarted worker is not in the old group
                self.form_group()
                if version < min_version:
                    self.now()
                return
            if version >= min_version:
                return
            pending = self._publish([w], [i])
            pending.finish(max(1.0, deadline - time.monotonic()))
            if not pending.lost:
                self.log(f"rollout worker {i} is back, at policy version {pending.version}")
                return

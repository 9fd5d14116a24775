"""The episodes in flight: which rollout worker plays which of an iteration's episodes, what comes
back, what is run again, and which ended episodes may train.

`Rollouts` owns that state:
- `submit(it)` splits iteration `it`'s episode tasks evenly over the workers and queues them
  (returns at once; the async schedule submits iterations ahead);
- `collect(it)` waits for them. A worker that died (or came back without the current weights) has
  its share run again once it is restored, with every episode it held suspended; episodes are
  handed back only when the iteration's every share is in, so each episode id is stored once.
  Judge parts of the rubric are sent as soon as the episodes are in, and applied here;
- `trainable(ended)`: partial rollouts (`rollout.iteration_token_budget`) end a group's episodes in
  different iterations; a group trains once all its episodes have ended, the others are held.

Not covered: where a version comes from (rl/weight_sync/driver.py, which `restore` is) or held-out
evaluation (rl/loop/held_out.py).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import ray

from rl.loop.episodes import iteration_tasks
from rl.weight_sync.transport import WORKER_LOST
from rollout.config import RolloutConfig
from rollout.judge_actor import ask_groups, settle
from rollout.trajectory import EpisodeTask, Trajectory
from rollout.worker import StaleWorkerError


class Rollouts:
    def __init__(
        self,
        cfg: RolloutConfig,
        workers: list,
        restore: Callable[[int, int], None],
        rubric,
        judge,
        log: Callable[[str], None],
        *,
        seed: int,
        iterations: int,
        judge_timeout_s: float,
    ):
        """`restore(i, min_version)`: bring back rollout worker `i` at `min_version` at least
        (WeightSync.restore); `rubric`, `judge`: the run's (rewards/rubric.py, rollout/judge_actor.py);
        `seed`: the run's (the episodes' tasks); `iterations`: none is submitted beyond them;
        `judge_timeout_s`: how long the judge's scores are waited for."""
        self.cfg, self.workers, self.restore, self.log = cfg, workers, restore, log
        self.seed, self.iterations, self.judge_timeout_s = seed, iterations, judge_timeout_s
        self.rubric, self.judge = rubric, judge
        # iteration → [(worker index, share, min version, future)]
        self.inflight: dict[int, list] = {}
        # per rollout worker: episode id → task, given and not yet back
        self.outstanding: list[dict] = [{} for _ in workers]
        # ended episodes whose group has not ended yet (partial rollouts)
        self.held: list[Trajectory] = []
        self.episodes_rerun = 0
        self.judge_row: dict = {}  # the judge's metrics of the iteration collected last

    def submit(self, iteration: int, version: int) -> None:
        """Queue an iteration's episodes on the rollout workers (split evenly; returns at once).
        Every rollout queued now runs after the loads queued before it: at least `version`."""
        if iteration in self.inflight or iteration >= self.iterations:
            return
        tasks = iteration_tasks(self.cfg, self.seed, iteration)
        shares = [tasks[i :: len(self.workers)] for i in range(len(self.workers))]
        for i, share in enumerate(shares):
            self.outstanding[i].update((t.episode_id, t) for t in share)
        # a worker continues its suspended episodes in every call, so each gets one, even with no new task
        self.inflight[iteration] = [
            (i, s, version, self._call(i, s, version, iteration)) for i, s in enumerate(shares)
        ]

    def _call(self, i: int, share: list[EpisodeTask], min_version: int, iteration: int):
        tokens = self.cfg.episode_tokens_at(iteration)
        return self.workers[i].rollout.remote(share, min_version, tokens)

    def collect(self, iteration: int, version: int) -> list[Trajectory]:
        """The episodes that ended in `iteration` (submitted now if they were not), scored."""
        self.submit(iteration, version)
        parts, out = self.inflight.pop(iteration), []
        while parts:
            i, share, min_version, ref = parts.pop(0)
            try:
                done = ray.get(ref)
            except (*WORKER_LOST, StaleWorkerError) as exc:
                # its share is lost, and so is every episode it held suspended: all are run again, except
                # those of its other calls still in flight (they fail too and are rerun when collected)
                elsewhere = {t.episode_id for j, s, _, _ in parts for t in s if j == i}
                elsewhere |= {
                    t.episode_id
                    for p in self.inflight.values()
                    for j, s, _, _ in p
                    for t in s
                    if j == i
                }
                share = [t for eid, t in self.outstanding[i].items() if eid not in elsewhere]
                stale = isinstance(exc, StaleWorkerError)
                what = "restarted without the current weights" if stale else "died"
                self.log(
                    f"[yellow]rollout worker {i} {what} ({type(exc).__name__}); running its "
                    f"{len(share)} episode(s) of iteration {iteration} again[/]"
                )
                self.restore(i, min_version)
                self.episodes_rerun += len(share)
                parts.append((i, share, min_version, self._call(i, share, min_version, iteration)))
                continue
            for t in done:
                self.outstanding[i].pop(t.episode_id, None)
            out.extend(done)
        # judge parts were sent to the judge as each worker finished (rank parts: now, with whole groups);
        # the rubric is applied once their scores are in
        ask_groups(self.rubric, out, self.judge)
        self.judge_row = settle(self.rubric, out, self.judge_timeout_s)
        return out

    def trainable(self, ended: list[Trajectory]) -> list[Trajectory]:
        """The episodes whose whole group has ended, held ones first; the others are held back
        (partial rollouts end a group's episodes in different iterations)."""
        pool = self.held + ended
        counts = Counter(t.group_id for t in pool)
        ready = {g for g, n in counts.items() if n >= self.cfg.group_size}
        self.held = [t for t in pool if t.group_id not in ready]
        return [t for t in pool if t.group_id in ready]

    def suspended(self, iteration: int) -> int:
        """Episodes of `iteration` or earlier still running: suspended by the token budget."""
        return sum(t.iteration <= iteration for o in self.outstanding for t in o.values())

    def last_submitted(self, default: int) -> int:
        return max(self.inflight, default=default)

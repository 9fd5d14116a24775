"""The RL loop, on one page: rollout → store → learn → sync → evaluate, an iteration at a time.

    rollout (vLLM, version v) → store → GRPO update (→ v+1) → weight sync → next iteration.

Two schedules (`schedule.mode`), one staleness model: every turn records the policy version that
generated it, and the learner's importance weights correct for whatever lag there is.
- sync (`sync_iteration`): iteration i is rolled out by the weights trained on iteration i-1.
- async (`async_iteration`): rollouts of iterations i+1 … i+max_staleness are already running while
  the learner trains on iteration i. A worker runs these calls at once on one shared engine
  (rollout/engines/shared.py); a load runs once the requests in flight have ended, so the rollouts
  in flight continue with the newer weights. Iteration j is submitted once the sync of version
  j - max_staleness is queued, and waits on the worker until that version is loaded: no token is
  more than `max_staleness` versions older than the weights it is trained at.

The state lives in small objects, each in its own module: the actors (rl/loop/actors.py), the episodes
in flight and held (rl/loop/rollouts.py), the weights on their way to the engines (rl/weight_sync/driver.py),
held-out evaluation (rl/loop/held_out.py), the metrics row's clocks and sinks (rl/loop/metrics.py), whether
the run can learn (rl/loop/guards.py); rl/loop/setup.py starts and stops them (a new run, a warm start,
a resume). The weights live in the learner, the engines in the workers, the episodes in the store
(rl/store.py).

Faults: rollout and env workers are restarted by Ray (`ray.max_restarts`); a rollout worker's
lost share of an iteration is run again once it is back on the current weights. The learner is
not restarted: its death stops the run with `LearnerDied`, and `longhorizon train --resume
RUN_DIR` continues from the last checkpoint (rl/learner/checkpoints.py).

What it writes to the run directory:

    config.yaml          the config as run
    metrics.jsonl        one JSON line per iteration
    tensorboard/         the same metrics as TensorBoard event files
    trajectories/        Parquet shards, one per iteration
    checkpoints/         Hugging Face checkpoints, `version-NNNNNN/`
    policy-init/         the tiny random policy, when `policy.path` was empty
    warm-start/          the policy after the supervised warm start (warm_start.demos), warm_start.json
    eval-initial.json    the held-out evaluation before RL (eval.every)
"""

from __future__ import annotations

import json
import time

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from rl.faults import LearnerDied, WorkerLost
from rl.loop.episodes import batch_metrics
from rl.loop.held_out import eval_metrics
from rl.loop.metrics import progress_line, rates_line
from rl.loop.setup import RunSetup
from rollout.trajectory import Trajectory

__all__ = ["LearnerDied", "Trainer", "WorkerLost"]


class Trainer(RunSetup):
    """The RL loop over the parts `RunSetup` starts (rl/loop/setup.py): `start()`, then `run()`."""

    # --- the loop ---
    def run(self) -> list[dict]:
        rows = []
        columns = [
            TextColumn("[bold]iteration"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.fields[status]}"),
        ]
        with Progress(*columns, console=self.console, transient=False) as progress:
            total, done = self.cfg.iterations, self.start_iteration
            bar = progress.add_task("train", total=total, completed=done, status="rolling out")
            if self.cfg.eval.every and self.workers and self.start_iteration == 0:
                self.evaluate_start(progress.console.log)
            self.metrics.start_clock()
            # the first iterations all start from the current weights
            if self.cfg.schedule.mode == "async" and self.rollouts:
                for j in range(
                    self.start_iteration, self.start_iteration + self.cfg.schedule.max_staleness + 1
                ):
                    self.rollouts.submit(j, self.version)
            for it in range(self.start_iteration, self.cfg.iterations):
                row = self.iteration(it)
                rows.append(row)
                status = progress_line(row)
                progress.console.log(f"iter {it}: {status}  {rates_line(row)}")
                progress.update(bar, advance=1, status=status)
        self.metrics.finish()
        self.guard.finish()  # a run whose last iteration could not learn does not end green
        return rows

    def iteration(self, it: int) -> dict:
        """One iteration of the run's schedule: its metrics row (also written to the run)."""
        if self.cfg.schedule.mode == "async":
            return self.async_iteration(it)
        return self.sync_iteration(it)

    def sync_iteration(self, it: int) -> dict:
        t0 = time.perf_counter()
        trajs = self.episodes(it)  # rollout: the weights trained on iteration it - 1
        rollout_s = time.perf_counter() - t0
        self.store.write(f"iter-{it:06d}", trajs)  # store: what ended in this iteration
        batch = self.trainable(trajs)
        staleness = self.staleness(batch)
        stats = self.learn(it, batch)  # learn: → version v + 1
        sync = self.weights.now()  # sync: every engine on v + 1 before the next rollout
        return self.finish_iteration(it, t0, trajs, batch, stats, sync, rollout_s, staleness)

    def async_iteration(self, it: int) -> dict:
        t0 = time.perf_counter()
        trajs = self.episodes(it)  # rollout: submitted up to max_staleness iterations ago
        rollout_s = time.perf_counter() - t0  # only the wait for rollouts that were not done yet
        sync = self.weights.finish_queued(it)  # the loads that sat behind these rollouts
        self.store.write(f"iter-{it:06d}", trajs)
        batch = self.trainable(trajs)
        staleness = self.staleness(batch)
        stats = self.learn(it, batch)
        if self.workers:
            # sync: the load queues behind every rollout already submitted; what is submitted next uses it
            self.weights.queue(after=self.rollouts.last_submitted(default=it))
            self.rollouts.submit(it + 1 + self.cfg.schedule.max_staleness, self.version)
        # nothing is left to roll out: the last versions must still arrive
        if it + 1 == self.cfg.iterations:
            sync = self.weights.finish_all() or sync
        return self.finish_iteration(it, t0, trajs, batch, stats, sync, rollout_s, staleness)

    def finish_iteration(self, it, t0, trajs, batch, stats, sync, rollout_s, staleness) -> dict:
        """Evaluate, checkpoint, and write the iteration's metrics row; the guard has its say last."""
        last = it + 1 == self.cfg.iterations
        every = self.cfg.eval.every
        evaluate = every and self.workers and ((it + 1) % every == 0 or last)
        held_out = self.held_out.evaluate() if evaluate else {}
        if last or (it + 1) % self.cfg.checkpoint_every == 0:
            path = self.run_dir / "checkpoints" / f"version-{self.version:06d}"
            self._learner(
                self.learner.save_checkpoint.remote(str(path), {"iteration": it}),
                "a checkpoint save",
            )
        busy, iteration_s = self.metrics.clocks(t0)
        rollouts = self.rollouts
        row = {
            "iteration": it,
            "policy_version": self.version,
            **batch_metrics(trajs),
            **stats,
            **sync,
            "rollout_s": rollout_s,
            "iteration_s": iteration_s,
            "staleness_max": staleness,
            **held_out,
            **(rollouts.judge_row if rollouts else {}),
            "worker_restarts": self.worker_restarts,
            "episodes_rerun": rollouts.episodes_rerun if rollouts else 0,
            "episodes_trained": len(batch),
            "episodes_held": len(rollouts.held) if rollouts else 0,
            # episodes of this or earlier iterations still running: suspended by the token budget
            "episodes_suspended": rollouts.suspended(it) if rollouts else 0,
            "episodes_per_s": len(trajs) / max(iteration_s, 1e-9),
            # the share of the iteration's wall time the engines spent in engine calls (mean over workers)
            **({"engine_busy": busy / max(iteration_s, 1e-9)} if busy is not None else {}),
            "gen_tokens_per_s": sum(t.num_generated for t in trajs) / max(iteration_s, 1e-9),
        }
        self.metrics.write(row)
        self.guard.check(it, trajs, stats)  # after the row is written: what the run did is on disk
        return row

    # --- the steps ---
    def episodes(self, it: int) -> list[Trajectory]:
        """Iteration `it`'s ended episodes: from the rollout workers, or the source run's shard."""
        if self.source is None:
            return self.rollouts.collect(it, self.version)
        shards = self.source.shards()
        if it >= len(shards):
            raise FileNotFoundError(
                f"--from-store {self.source.dir.parent} holds {len(shards)} iteration(s); "
                f"iteration {it} has no data"
            )
        return list(self.source.trajectories(shards[it]))

    def trainable(self, ended: list[Trajectory]) -> list[Trajectory]:
        return ended if self.source is not None else self.rollouts.trainable(ended)

    def staleness(self, batch: list[Trajectory]) -> int:
        """How many versions behind the weights about to train on it the oldest token is (0 when synchronous)."""
        return max(
            (self.version - min(t.policy_version for t in tr.turns) for tr in batch if tr.turns),
            default=0,
        )

    def learn(self, it: int, batch: list[Trajectory]) -> dict:
        """One update of the learner on `batch`; its metrics. The learner's annotations of the
        episodes (what it saw of each) go to the store beside the iteration's shard."""
        stats = self._learner(
            self.learner.train_step.remote(batch), f"the update of iteration {it}"
        )
        self.version = stats.pop("policy_version")
        annotations = stats.pop("annotations", {})
        if annotations:
            self.store.write_learner(f"iter-{it:06d}", annotations, self.version - 1)
        return stats

    def evaluate_start(self, log) -> None:
        """The starting point, for comparison with the evaluations to come: after a warm start its
        best round was evaluated on the same validation seeds with these weights (eval-initial.json)."""
        v = self.warm_start_summary.get("validation")
        initial = eval_metrics(v, self.version) if v else self.held_out.evaluate()
        (self.run_dir / "eval-initial.json").write_text(json.dumps(initial))
        if initial:
            log(
                f"held-out success before RL: {initial['eval/success']:.3f} "
                f"({initial['eval/ci95_low']:.3f}–{initial['eval/ci95_high']:.3f})"
            )

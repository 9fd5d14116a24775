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
the run can learn (rl/loop/guards.py). The weights live in the learner, the engines in the workers, the
episodes in the store (rl/store.py).

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
import os
import time
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from rewards.rubric import build as build_rubric
from rl.config import RunConfig, dump_config
from rl.faults import LearnerDied, WorkerLost, latest_checkpoint, learner_get
from rl.learner.checkpoints import resume_point
from rl.loop.actors import policy_path, start_actors
from rl.loop.episodes import batch_metrics
from rl.loop.guards import LearningGuard
from rl.loop.held_out import HeldOut, eval_metrics
from rl.loop.metrics import MetricsLog
from rl.loop.rollouts import Rollouts
from rl.ray_utils import init_ray
from rl.store import TrajectoryStore
from rl.weight_sync.driver import WeightSync
from rollout.trajectory import Trajectory

__all__ = ["LearnerDied", "Trainer", "WorkerLost"]


class Trainer:
    """The driver. With `from_store=RUN_DIR` it starts no rollout or env workers: iteration i trains
    on the i-th trajectory shard of that run (for debugging a learner change on fixed data)."""

    def __init__(
        self,
        cfg: RunConfig,
        run_dir: str | Path,
        console: Console | None = None,
        from_store: str | Path | None = None,
    ):
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.console = console or Console(stderr=True)
        self.store = TrajectoryStore(self.run_dir)
        self.source = None
        if from_store is not None:
            self.source = TrajectoryStore(from_store)
            if not self.source.shards():
                raise FileNotFoundError(f"--from-store {from_store}: no trajectory shards there")
            bad = self.source.unreadable()
            if bad:  # found now, not after training on the shards before it
                raise FileNotFoundError(f"--from-store {from_store}: {bad[0]} ({len(bad)} in all)")
        self.start_iteration = 0
        self.actors = None
        self.weights = self.rollouts = self.held_out = None
        self.metrics = MetricsLog(cfg, self.run_dir, [])
        self.guard = LearningGuard(cfg, self.run_dir)  # stops a run that cannot learn
        self.warm = None  # the warm start phase, once run (rl/start/warm_start.py)
        self.warm_start_summary: dict = {}

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

    # --- set-up ---
    def start(self, resume: bool = False, checkpoint: str | None = None) -> None:
        """Start the actors (and, `resume`, continue from the newest checkpoint, or the one named
        `checkpoint`; a damaged one stops the run here, before anything starts: rl/learner/checkpoints.py)."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        ckpt = resume_point(self.run_dir, checkpoint) if resume else None
        if not resume and self.store.shards():
            raise FileExistsError(
                f"run directory {self.run_dir} already holds trajectories; pick a new --run-dir or --resume it"
            )
        dump_config(self.cfg, self.run_dir / "config.yaml")
        path = self.policy_path()
        init_ray(self.cfg.ray)
        c = self.cfg
        self.console.log(
            f"starting {c.rollout.num_workers} rollout worker(s), {c.env.workers} env worker(s) "
            f"and {c.learner.world_size} learner rank(s)"
        )
        rollouts = self.source is None  # training from a store needs no engines and no environments
        rubric = build_rubric(c.reward.parts)
        self.actors = start_actors(c, path, self.run_dir, rollouts, judged=bool(rubric.judges))
        self.weights = WeightSync(c, self.learner, self.workers, self.run_dir, self.console.log)
        self.held_out = HeldOut(c, self.workers, self.weights, self.run_dir, self.console.log)
        if rollouts:
            self.rollouts = Rollouts(
                c, self.workers, self.weights.restore, rubric, self.judge, self.console.log
            )
        self.metrics = MetricsLog(c, self.run_dir, self.workers)
        if self.weights.collective and self.workers:
            self.weights.form_group()
        self.learner.call("logprobs", [0, 0])
        self.console.log(
            f"learner malloc: {self.learner.call('allocator')} (learner.allocator: {c.learner.allocator})"
        )
        if ckpt is not None:
            self._resume_from(ckpt)
        elif c.warm_start.demos and self.source is None:
            self.warm = self.warm_start_phase(path)
            self.warm_start_summary = self.warm.run()
            self.version = self.learner.call("policy_version")

    def policy_path(self) -> str:
        """The policy the run starts from (before any warm start: that runs on the learner, `start`)."""
        return policy_path(
            self.cfg, self.run_dir, self.source.dir if self.source is not None else None
        )

    def warm_start_phase(self, path: str):
        """The warm start on the running learner (rl/start/warm_start.py), its rounds validated on the
        rollout workers when `warm_start.patience` asks; the phase object (for `more`)."""
        from transformers import AutoTokenizer

        from rl.start.warm_start import Source, WarmStart
        from rollout.chat import ChatFormat

        c, r = self.cfg, self.cfg.rollout
        # where a rebuilt context starts depends on a turn's room; in a full context an expert turn is
        # never cut (as before contexts were managed)
        loop = dict(
            max_turns=r.max_turns,
            max_episode_tokens=r.max_episode_tokens,
            context=r.context,
            max_model_len=r.max_model_len,
            max_new_tokens=None if r.context.mode == "full" else r.max_new_tokens,
        )
        envs = c.warm_start.envs or [c.env.id]
        sources = [Source(e, dict(c.env.kwargs) if e == c.env.id else {}, loop) for e in envs]
        return WarmStart(
            c.warm_start,
            sources,
            ChatFormat(AutoTokenizer.from_pretrained(path)),
            self.learner,
            publish=self.sync_now,
            validate=self.held_out.validate if self.workers else None,
            out=self.run_dir / "warm-start",
            log=self.console.log,
        )

    def _resume_from(self, ckpt: Path) -> None:
        """Learner state from the checkpoint, engines synced to it; later records set aside.

        Iterations after the checkpoint are run again, so their shards move to
        `trajectories/superseded/` (kept, never deleted) and their metrics lines are dropped."""
        state = self._learner(
            self.learner.load_checkpoint.remote(str(ckpt)), "loading the checkpoint"
        )
        self.version = state["version"]
        self.start_iteration = state["iteration"] + 1
        self.sync_now()
        aside = self.store.dir / "superseded"
        for shard in self.store.shards() + self.store.learner_shards():
            if int(shard.stem.split("-")[1]) >= self.start_iteration:
                aside.mkdir(exist_ok=True)
                prefix = "learner-" if shard.parent == self.store.learner_dir else ""
                os.replace(shard, aside / f"{prefix}{shard.stem}-{int(time.time())}.parquet")
        metrics = self.run_dir / "metrics.jsonl"
        if metrics.exists():
            kept = [
                line
                for line in metrics.read_text().splitlines()
                if line.strip() and json.loads(line)["iteration"] < self.start_iteration
            ]
            metrics.write_text("".join(line + "\n" for line in kept))
        self.console.log(
            f"resumed from {ckpt.name}: policy version {self.version}, next iteration {self.start_iteration}"
        )

    def close(self) -> None:
        """Stop the actors; what the run counted (restarts, reruns) stays readable."""
        self.metrics.close()
        if self.actors is not None:
            self.actors.kill()
        self.actors = None
        if self.weights is not None:
            self.weights.queued, self.weights.workers = [], []
        if self.rollouts is not None:
            self.rollouts.inflight, self.rollouts.workers = {}, []

    # --- the parts, as callers and tests see them ---
    @property
    def learner(self):
        return self.actors.learner if self.actors is not None else None

    @property
    def workers(self) -> list:
        return self.actors.workers if self.actors is not None else []

    @property
    def env_workers(self) -> list:
        return self.actors.env_workers if self.actors is not None else []

    @property
    def judge(self):
        return self.actors.judge if self.actors is not None else None

    @property
    def version(self) -> int:
        """The learner's newest policy version."""
        return self.weights.version if self.weights is not None else 0

    @version.setter
    def version(self, value: int) -> None:
        self.weights.version = value

    @property
    def worker_restarts(self) -> int:
        return self.weights.worker_restarts if self.weights is not None else 0

    def sync_now(self) -> dict:
        return self.weights.now()

    def play_held_out(self, *args, **kwargs) -> tuple[dict, list[Trajectory]]:
        return self.held_out.play(*args, **kwargs)

    def evaluate(self) -> dict:
        return self.held_out.evaluate()

    def latest_checkpoint(self) -> Path | None:
        return latest_checkpoint(self.run_dir)

    def _learner(self, refs, during: str):
        return learner_get(self.run_dir, refs, during)


def progress_line(row: dict) -> str:
    loss = f"loss {row['loss']:+.4f}" if "loss" in row else "no usable episodes"
    sync = f"  sync {row['sync_s'] * 1e3:.0f} ms" if "sync_s" in row else ""
    status = f"reward {row['mean_reward']:.3f}  {loss}  v{row['policy_version']}{sync}"
    if row.get("infra_errors"):
        status += f"  infra errors {row['infra_errors']}"
    return status


def rates_line(row: dict) -> str:
    busy = f"  engine busy {row['engine_busy']:.0%}" if "engine_busy" in row else ""
    return (
        f"{row['episodes_per_s']:.2f} episodes/s  gen {row['gen_tokens_per_s']:.0f} tok/s  "
        f"staleness {row['staleness_max']}{busy}"
    )

"""What the RL loop (rl/loop/trainer.py) stands on: the run's parts and how they start and stop.

`RunSetup` holds the driver's state (the actors, the weight sync, the episodes in flight, held-out
evaluation, the metrics log, the guard), starts the actors and the parts over them (`start`:
a new run, a warm start, or `--resume` from a checkpoint), and stops them (`close`). It also
gives callers and tests the parts by name (`learner`, `workers`, `version`, ...). The loop itself,
what happens in an iteration, is `Trainer`'s, in rl/loop/trainer.py.
"""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from rewards.rubric import build as build_rubric
from rl.config import RunConfig, dump_config, to_dict
from rl.faults import latest_checkpoint, learner_get
from rl.learner.checkpoints import resume_point
from rl.loop.actors import policy_path, start_actors
from rl.loop.guards import LearningGuard
from rl.loop.held_out import HeldOut
from rl.loop.metrics import MetricsLog
from rl.loop.rollouts import Rollouts
from rl.ray_utils import init_ray
from rl.store import TrajectoryStore
from rl.weight_sync.driver import WeightSync
from rollout.trajectory import Trajectory


class RunSetup:
    """The run's state and set-up. With `from_store=RUN_DIR` it starts no rollout or env workers:
    iteration i trains on the i-th trajectory shard of that run (for debugging a learner change on
    fixed data)."""

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
        self.metrics = MetricsLog(cfg.log, self.run_dir, [], to_dict(cfg))
        self.guard = LearningGuard(  # stops a run that cannot learn
            self.run_dir,
            max_infra_error_share=cfg.max_infra_error_share,
            stop_after_failed=cfg.stop_after_failed,
            stop_after_flat=cfg.stop_after_flat,
            ppo=cfg.algo.name == "ppo",
        )
        self.warm = None  # the warm start phase, once run (rl/start/warm_start.py)
        self.warm_start_summary: dict = {}

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
        log = self.console.log
        self.weights = WeightSync(
            c.sync,
            self.learner,
            self.workers,
            self.run_dir,
            log,
            backend=c.sync_backend(),
            stream=c.sync_streams(),
            max_restarts=c.ray.max_restarts,
        )
        self.held_out = HeldOut(
            c.eval, c.env, c.rollout.temperature, self.workers, self.weights, self.run_dir, log
        )
        if rollouts:
            self.rollouts = Rollouts(
                c.rollout,
                self.workers,
                self.weights.restore,
                rubric,
                self.judge,
                log,
                seed=c.seed,
                iterations=c.iterations,
                judge_timeout_s=c.reward.judge.timeout_s,
            )
        self.metrics = MetricsLog(c.log, self.run_dir, self.workers, to_dict(c))
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

        from rl.start.warm_start import WarmStart, run_sources
        from rollout.chat import ChatFormat

        c = self.cfg
        return WarmStart(
            c.warm_start,
            run_sources(c.warm_start.envs or [c.env.id], c.env, c.rollout),
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
        self.store.set_aside(self.start_iteration)
        self.metrics.drop_from(self.start_iteration)
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

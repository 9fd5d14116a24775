"""Held-out evaluation during a run: episodes on seeds no training episode uses, played by the
rollout workers with the weights they hold.

Two splits (rl/loop/evaluate.py): validation, for anything tuned or watched (the warm start's rounds,
`eval.every` during RL), and test, for what is reported (the demo's stages). `HeldOut.play` splits
the episodes evenly over the workers; a worker that dies is restored and its share played again, a
second loss stops the run (`WorkerLost`): an evaluation is never skipped. In the async schedule it
runs beside the rollouts in flight, with the weights loaded by then.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import ray

from envs.config import EnvConfig
from rl.config import EvalConfig
from rl.faults import WorkerLost
from rl.store import TrajectoryStore
from rl.weight_sync.driver import WeightSync
from rl.weight_sync.transport import WORKER_LOST
from rollout.trajectory import Trajectory


class HeldOut:
    def __init__(
        self,
        cfg: EvalConfig,
        env: EnvConfig,
        temperature: float,
        workers: list,
        weights: WeightSync,
        run_dir: Path,
        log: Callable[[str], None],
    ):
        """`env`: the training environment (evaluated on when `eval.env_id` is empty);
        `temperature`: the rollouts' (when `eval.temperature` is 0)."""
        self.env, self.temperature = env, temperature
        self.cfg, self.workers, self.weights, self.run_dir, self.log = (
            cfg,
            workers,
            weights,
            run_dir,
            log,
        )

    def play(
        self,
        split: str = "validation",
        episodes: int | None = None,
        env_kwargs: dict | None = None,
        loop: dict | None = None,
        keep: str | None = None,
    ) -> tuple[dict, list[Trajectory]]:
        """Held-out episodes of `split` on the rollout workers: (summary, trajectories). `env_kwargs`
        and `loop` (the agent loop's keywords, e.g. a `context` mode or `max_turns`) replace the
        run's for this evaluation. `keep` ("DIR/NAME"): the episodes are also stored, as shard NAME
        of a store at RUN_DIR/DIR (`longhorizon inspect RUN_DIR/DIR`)."""
        from rl.loop.evaluate import eval_tasks, summarise

        e = self.cfg
        env_id, kwargs = (
            (e.env_id, dict(e.env_kwargs)) if e.env_id else (self.env.id, dict(self.env.kwargs))
        )
        kwargs = kwargs if env_kwargs is None else {**kwargs, **env_kwargs}
        tasks = eval_tasks(episodes or e.episodes, e.k, split)
        temperature = e.temperature or self.temperature
        shares = {i: tasks[i :: len(self.workers)] for i in range(len(self.workers))}
        trajs: list[Trajectory] = []
        for attempt in range(2):
            refs = {
                i: self.workers[i].evaluate.remote(env_id, kwargs, share, temperature, loop)
                for i, share in shares.items()
                if share
            }
            lost = []
            for i, ref in refs.items():
                try:
                    trajs += ray.get(ref)
                except WORKER_LOST as exc:
                    lost.append((i, exc))
            if not lost:
                if keep:
                    where, name = keep.rsplit("/", 1)
                    TrajectoryStore(self.run_dir / where).write(name, trajs)
                return summarise(env_id, trajs, e.k), trajs
            names = ", ".join(f"{i} ({type(exc).__name__})" for i, exc in lost)
            if attempt:
                raise WorkerLost(
                    f"the held-out evaluation lost rollout worker(s) {names} twice; the run stops "
                    "rather than report an evaluation it did not finish"
                )
            self.log(
                f"[yellow]held-out evaluation: rollout worker(s) {names} died; restoring and playing "
                "their share again[/]"
            )
            for i, _ in lost:
                self.weights.restore(i, self.weights.version)
            shares = {i: shares[i] for i, _ in lost}
        raise AssertionError("unreachable")

    def evaluate(self) -> dict:
        """Held-out evaluation on validation seeds, as `eval/*` metrics."""
        t0 = time.perf_counter()
        s, trajs = self.play("validation")
        # the oldest version it sampled with (async: the weights loaded by then)
        version = min((turn.policy_version for t in trajs for turn in t.turns), default=-1)
        return eval_metrics(s, version, seconds=time.perf_counter() - t0)

    def validate(self, keep: str | None = None) -> dict:
        """Held-out success on validation seeds (the warm start's rounds), as `summarise` reports it;
        `keep`: where its episodes are stored (`play`)."""
        return self.play("validation", keep=keep)[0]


def eval_metrics(summary: dict, version: int, seconds: float | None = None) -> dict:
    """A validation summary (`summarise`'s) as the metrics row's `eval/*` keys; `seconds`: how long
    the evaluation took (None: taken from the warm start's best round, not played again)."""
    out = {
        "eval/success": summary["success"],
        "eval/ci95_low": summary["ci95"][0],
        "eval/ci95_high": summary["ci95"][1],
        "eval/milestones_mean": summary["milestones_mean"],
        "eval/reward_mean": summary["reward_mean"],
        "eval/episodes": summary["episodes"],
        "eval/policy_version": version,
    }
    if seconds is None:
        out["eval/from_warm_start"] = 1
    else:
        out["eval/s"] = seconds
    k = summary.get("k", 1)
    if k > 1:
        out[f"eval/pass@{k}"] = summary[f"pass@{k}"]
    return out

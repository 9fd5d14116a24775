"""The driver: wires rollout workers, the learner and the store, and runs the synchronous loop

    rollout (vLLM, version v) → store → GRPO update (→ v+1) → weight sync → next iteration.

It owns no state of the components: the weights live in the learner, the engines in the workers,
the episodes in the store. What it writes to the run directory:

    config.yaml          the config as run
    metrics.jsonl        one JSON line per iteration
    tensorboard/         the same metrics as TensorBoard event files
    trajectories/        Parquet shards, one per iteration
    checkpoints/         Hugging Face checkpoints, `version-NNNNNN/`
    policy-init/         the tiny random policy, when `policy.path` was empty
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from pathlib import Path

import ray
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from rl.config import RunConfig, dump_config
from rl.learner import LearnerActor
from rl.ray_utils import init_ray
from rl.store import TrajectoryStore
from rl.trajectory import Trajectory
from rollout.agent_loop import EpisodeTask
from envs.worker import EnvWorkerActor
from rl.plot import TensorBoardLog
from rollout.worker import RolloutWorkerActor

SYNC_TIMEOUT_S = 300


def iteration_tasks(cfg: RunConfig, iteration: int) -> list[EpisodeTask]:
    """The episodes of one iteration: `groups_per_iteration` tasks × `group_size` episodes."""
    r = cfg.rollout
    tasks = []
    for g in range(r.groups_per_iteration):
        group_id = iteration * r.groups_per_iteration + g
        env_seed = (cfg.seed * 1_000_003 + group_id) & 0x7FFFFFFF
        for k in range(r.group_size):
            tasks.append(EpisodeTask(f"i{iteration}-g{g}-e{k}", group_id, env_seed, iteration))
    return tasks


def summarise(trajs: list[Trajectory]) -> dict:
    n = max(1, len(trajs))
    reached = Counter(name for t in trajs for name in {m["name"] for m in t.milestones})
    out = {
        "episodes": len(trajs),
        "mean_reward": sum(t.reward for t in trajs) / n,
        "mean_turns": sum(len(t.turns) for t in trajs) / n,
        "generated_tokens": sum(t.num_generated for t in trajs),
        "episode_tokens_mean": sum(len(t.token_ids) for t in trajs) / n,
        "tool_errors": sum(turn.tool_errors for t in trajs for turn in t.turns),
        "infra_errors": sum(1 for t in trajs if t.infra_error),
        "stop_reasons": dict(Counter(t.stop_reason for t in trajs)),
    }
    out.update({f"milestone_rate/{k}": v / n for k, v in sorted(reached.items())})
    return out


class Trainer:
    """The driver. With `from_store=RUN_DIR` it starts no rollout or env workers: iteration i trains
    on the i-th trajectory shard of that run (for debugging a learner change on fixed data)."""

    def __init__(self, cfg: RunConfig, run_dir: str | Path, console: Console | None = None,
                 from_store: str | Path | None = None):
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.console = console or Console(stderr=True)
        self.store = TrajectoryStore(self.run_dir)
        self.source = None
        if from_store is not None:
            self.source = TrajectoryStore(from_store)
            if not self.source.shards():
                raise FileNotFoundError(f"--from-store {from_store}: no trajectory shards there")
        self.version = 0
        self.start_iteration = 0
        self.workers: list = []
        self.env_workers: list = []
        self.learner = None
        self.tensorboard = None

    # --- set-up ---
    def policy_path(self) -> str:
        if self.cfg.policy.path:
            return self.cfg.policy.path
        if self.source is not None:  # the stored token ids are that run's tokenizer's: train its policy
            init = self.source.dir.parent / "policy-init"
            if not (init / "config.json").exists():
                raise FileNotFoundError(f"--from-store: set policy.path; {init} holds no policy")
            return str(init)
        from policy.tiny_hf import make_tiny_qwen3_moe

        init = self.run_dir / "policy-init"
        if not (init / "config.json").exists():
            make_tiny_qwen3_moe(init, self.cfg.policy.tiny, seed=self.cfg.seed)
        return str(init)

    def latest_checkpoint(self) -> Path | None:
        ckpts = sorted((self.run_dir / "checkpoints").glob("version-*/trainer_state.pt"))
        return ckpts[-1].parent if ckpts else None

    def start(self, resume: bool = False) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        ckpt = self.latest_checkpoint() if resume else None
        if resume and ckpt is None:
            raise FileNotFoundError(f"nothing to resume in {self.run_dir}: no checkpoints/version-*/trainer_state.pt")
        if not resume and self.store.shards():
            raise FileExistsError(
                f"run directory {self.run_dir} already holds trajectories; pick a new --run-dir or --resume it"
            )
        dump_config(self.cfg, self.run_dir / "config.yaml")
        path = self.policy_path()
        init_ray(self.cfg.ray)
        c = self.cfg
        self.console.log(f"starting {c.rollout.num_workers} rollout worker(s), {c.env.workers} env worker(s) "
                         "and the learner")
        r = c.ray
        self.learner = LearnerActor.options(num_cpus=r.learner_cpus, resources=dict(r.learner_resources)).remote(
            path, c.algo, seed=c.seed, dtype=c.policy.dtype, temperature=c.rollout.temperature,
            max_generated_tokens=c.rollout.max_turns * c.rollout.max_new_tokens,
        )
        rollouts = self.source is None  # training from a store needs no engines and no environments
        self.env_workers = [
            EnvWorkerActor.options(num_cpus=c.env.cpus_per_worker, max_concurrency=c.env.worker_concurrency,
                                   resources=dict(r.env_worker_resources))
            .remote(c.env.id, c.env.kwargs)
            for _ in range(c.env.workers if rollouts else 0)
        ]
        self.workers = [
            RolloutWorkerActor.options(num_cpus=c.rollout.cpus_per_worker, resources=dict(r.rollout_resources)).remote(
                path, c.rollout, c.env, seed=c.seed + i, dtype=c.policy.dtype, env_actors=self.env_workers
            )
            for i in range(c.rollout.num_workers if rollouts else 0)
        ]
        ray.get([w.version.remote() for w in self.workers] + [self.learner.logprobs.remote([0, 0])])
        if ckpt is not None:
            self._resume_from(ckpt)

    def _resume_from(self, ckpt: Path) -> None:
        """Learner state from the checkpoint, engines synced to it; later records set aside.

        Iterations after the checkpoint are run again, so their shards move to
        `trajectories/superseded/` (kept, never deleted) and their metrics lines are dropped."""
        state = ray.get(self.learner.load_checkpoint.remote(str(ckpt)))
        self.version = state["version"]
        self.start_iteration = state["iteration"] + 1
        self.sync()
        aside = self.store.dir / "superseded"
        for shard in self.store.shards() + self.store.learner_shards():
            if int(shard.stem.split("-")[1]) >= self.start_iteration:
                aside.mkdir(exist_ok=True)
                prefix = "learner-" if shard.parent == self.store.learner_dir else ""
                os.replace(shard, aside / f"{prefix}{shard.stem}-{int(time.time())}.parquet")
        metrics = self.run_dir / "metrics.jsonl"
        if metrics.exists():
            kept = [line for line in metrics.read_text().splitlines()
                    if line.strip() and json.loads(line)["iteration"] < self.start_iteration]
            metrics.write_text("".join(line + "\n" for line in kept))
        self.console.log(f"resumed from {ckpt.name}: policy version {self.version}, "
                         f"next iteration {self.start_iteration}")

    # --- one iteration ---
    def rollout(self, iteration: int) -> list[Trajectory]:
        if self.source is not None:
            shards = self.source.shards()
            if iteration >= len(shards):
                raise FileNotFoundError(f"--from-store {self.source.dir.parent} holds {len(shards)} iteration(s); "
                                        f"iteration {iteration} has no data")
            return list(self.source.trajectories(shards[iteration]))
        tasks = iteration_tasks(self.cfg, iteration)
        shares = [tasks[i :: len(self.workers)] for i in range(len(self.workers))]
        results = ray.get([w.rollout.remote(s) for w, s in zip(self.workers, shares) if s])
        return [t for part in results for t in part]

    def sync(self) -> dict:
        """Publish the learner's weights once; every worker loads them in place."""
        if not self.workers:  # training from a store: nobody to sync
            return {"sync_s": 0.0, "load_s_max": 0.0, "sync_bytes": 0}
        t0 = time.perf_counter()
        ref = self.learner.weights.remote()  # stays in the object store; workers read it directly
        pending = {w.load_weights.remote(ref, self.version): i for i, w in enumerate(self.workers)}
        ready, not_ready = ray.wait(list(pending), num_returns=len(pending), timeout=SYNC_TIMEOUT_S)
        if not_ready:
            late = sorted(pending[r] for r in not_ready)
            raise TimeoutError(f"weight sync to version {self.version}: rollout worker(s) {late} "
                               f"did not finish within {SYNC_TIMEOUT_S}s")
        results = ray.get(ready)
        for r in results:
            if r["version"] != self.version:
                raise RuntimeError(f"a rollout worker reports version {r['version']}, expected {self.version}")
        return {"sync_s": time.perf_counter() - t0, "load_s_max": max(r["load_s"] for r in results),
                "sync_bytes": results[0]["bytes"]}  # the bytes each worker received

    def iteration(self, it: int) -> dict:
        t0 = time.perf_counter()
        trajs = self.rollout(it)
        rollout_s = time.perf_counter() - t0
        self.store.write(f"iter-{it:06d}", trajs)
        # how many versions behind the weights about to train on it the oldest token is (0 when synchronous)
        staleness = max((self.version - min(t.policy_version for t in tr.turns) for tr in trajs if tr.turns), default=0)
        stats = ray.get(self.learner.train_step.remote(trajs))
        self.version = stats.pop("policy_version")
        annotations = stats.pop("annotations", {})
        if annotations:
            self.store.write_learner(f"iter-{it:06d}", annotations, self.version - 1)
        sync = self.sync()
        row = {"iteration": it, "policy_version": self.version, **summarise(trajs), **stats, **sync,
               "rollout_s": rollout_s, "staleness_max": staleness,
               "episodes_per_s": len(trajs) / max(rollout_s, 1e-9),
               "gen_tokens_per_s": sum(t.num_generated for t in trajs) / max(rollout_s, 1e-9)}
        last = it + 1 == self.cfg.iterations
        if last or (it + 1) % self.cfg.checkpoint_every == 0:
            path = self.run_dir / "checkpoints" / f"version-{self.version:06d}"
            ray.get(self.learner.save_checkpoint.remote(str(path), {"iteration": it}))
        with open(self.run_dir / "metrics.jsonl", "a") as fh:
            fh.write(json.dumps(row) + "\n")
        if self.tensorboard is None:
            self.tensorboard = TensorBoardLog(self.run_dir)
        self.tensorboard.log(row)
        return row

    def run(self) -> list[dict]:
        rows = []
        columns = [TextColumn("[bold]iteration"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   TextColumn("{task.fields[status]}")]
        with Progress(*columns, console=self.console, transient=False) as progress:
            bar = progress.add_task("train", total=self.cfg.iterations, completed=self.start_iteration,
                                    status="rolling out")
            for it in range(self.start_iteration, self.cfg.iterations):
                row = self.iteration(it)
                rows.append(row)
                loss = f"loss {row['loss']:+.4f}" if "loss" in row else "no usable episodes"
                status = (f"reward {row['mean_reward']:.3f}  {loss}  "
                          f"v{row['policy_version']}  sync {row['sync_s'] * 1e3:.0f} ms")
                if row.get("infra_errors"):
                    status += f"  infra errors {row['infra_errors']}"
                progress.console.log(f"iter {it}: {status}  {row['episodes_per_s']:.2f} episodes/s  "
                                     f"gen {row['gen_tokens_per_s']:.0f} tok/s  staleness {row['staleness_max']}")
                progress.update(bar, advance=1, status=status)
        return rows

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
            self.tensorboard = None
        for actor in self.workers + self.env_workers + ([self.learner] if self.learner is not None else []):
            ray.kill(actor)
        self.workers, self.env_workers, self.learner = [], [], None

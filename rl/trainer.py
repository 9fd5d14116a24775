"""The driver: wires rollout workers, the learner and the store, and runs the loop

    rollout (vLLM, version v) → store → GRPO update (→ v+1) → weight sync → next iteration.

Two schedules (`schedule.mode`), one staleness model: every turn records the policy version
that generated it, and the learner's importance weights correct for whatever lag there is.
- sync: iteration i is rolled out by the weights trained on iteration i-1; staleness 0.
- async: rollouts of iterations i+1 … i+max_staleness are already running while the learner
  trains on iteration i. A worker runs these calls at once on one shared engine (its actor is
  threaded, rollout/engines/shared.py): while one iteration's episodes wait for their tools,
  another's generate, each turn joining the engine's running batch. A load runs once the requests
  in flight have ended, so the rollouts in flight continue with the newer weights (every turn
  records its version). Iteration j is submitted once the sync of version j - max_staleness is queued, and
  waits on the worker until that version is loaded: no token is more than `max_staleness`
  versions older than the weights it is trained at.

It owns no state of the components: the weights live in the learner, the engines in the workers,
the episodes in the store.

Partial rollouts (`rollout.iteration_token_budget`): a worker suspends the episodes still running
when its budget is spent and continues them in its next call; an iteration's shard holds the
episodes that ended in it, and a group trains once all its episodes have ended (`trainable`).

Faults. Rollout and env workers are Ray actors with `ray.max_restarts`: when a process or a whole
node dies, Ray starts the actor again wherever the resources allow. An env worker's in-flight
episodes end as infra errors (kept out of the group statistics) and its next episodes run on the
new process. A rollout worker's lost share of an iteration is run again, once Ray has restarted it
and the driver has synced it to the current version (a restarted worker holds the initial weights
and refuses to roll out with them, `StaleWorkerError`). Episodes are written only when an
iteration's every share is in, so each episode id is stored exactly once. The learner is not
restarted (its state is the run's): its death stops the run with `LearnerDied`, and
`longhorizon train --resume RUN_DIR` continues from the last checkpoint.

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
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import ray
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from envs.env_worker import EnvWorkerActor
from rewards.rubric import build as build_rubric
from rl import allocator
from rl.checkpoints import resume_point
from rl.config import RunConfig, dump_config
from rl.episodes import batch_metrics, iteration_tasks
from rl.guards import LearningGuard
from rl.learner_group import LearnerGroup, result
from rl.loggers import TensorBoardLog
from rl.ray_utils import init_ray
from rl.store import TrajectoryStore
from rl.sync import WORKER_LOST, PendingSync, form_group, start_collective_sync, start_sync
from rollout.judge_actor import JudgeActor, ask_groups, settle
from rollout.trajectory import EpisodeTask, Trajectory
from rollout.worker import RolloutWorkerActor, StaleWorkerError


# a worker's process or node died, or the result it produced was lost with its node
class WorkerLost(RuntimeError):
    """A rollout worker died and did not come back (Ray out of restarts or of room to place it)."""


class LearnerDied(RuntimeError):
    """The learner actor died; the message says what survived and how to continue."""

    def __init__(self, run_dir: Path, checkpoint: Path | None, during: str, exc: BaseException):
        where = (
            f"the last checkpoint is {checkpoint.name}"
            if checkpoint is not None
            else "no checkpoint was written yet"
        )
        super().__init__(
            f"the learner died during {during} ({type(exc).__name__}); the run stops here. Trajectories "
            f"and metrics written so far are kept in {run_dir} and {where}; continue with: "
            f"longhorizon train --resume {run_dir}"
        )


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
        self.version = 0
        self.start_iteration = 0
        self.workers: list = []
        self.env_workers: list = []
        self.learner = self.judge = None
        self._judge_row: dict = {}  # the judge's metrics of the iteration being collected
        self.tensorboard = None
        self.wandb = None
        # iteration → [(worker index, share, min version, future)]
        self._inflight: dict[int, list] = {}
        self.worker_restarts = 0  # rollout worker deaths this driver recovered from, so far
        # per rollout worker: episode id → task, given and not yet back
        self._outstanding: list[dict] = []
        self._busy_last: list[float] = []  # the engines' busy seconds at the last row
        # ended episodes whose group has not ended yet (partial rollouts)
        self._held: list[Trajectory] = []
        self.episodes_rerun = 0
        # (last iteration submitted before it, sync)
        self._syncs: list[tuple[int, PendingSync]] = []
        self._last_row_t = 0.0
        self.guard = LearningGuard(cfg, self.run_dir)  # stops a run that cannot learn
        self.warm = None  # the warm start phase, once run (rl/warm_start.py)
        self.warm_start_summary: dict = {}

    # --- set-up ---
    def policy_path(self) -> str:
        """The policy the run starts from (before any warm start: that runs on the learner, `start`)."""
        # converted and upcycled once, in the local cache (rl/pretrained.py)
        if self.cfg.policy.pretrained:
            from rl.pretrained import for_config

            return str(for_config(self.cfg.policy))
        if self.cfg.policy.path:
            return self.cfg.policy.path
        # the stored token ids are that run's tokenizer's: train its policy
        if self.source is not None:
            init = self.source.dir.parent / "policy-init"
            if not (init / "config.json").exists():
                raise FileNotFoundError(f"--from-store: set policy.path; {init} holds no policy")
            return str(init)
        init = self.run_dir / "policy-init"
        if not (init / "config.json").exists():
            if self.cfg.policy.flavour:
                from policy.args import load_model_args
                from rl.tiny import make_tiny_policy

                make_tiny_policy(init, load_model_args(self.cfg.policy.flavour), seed=self.cfg.seed)
            else:
                from rl.tiny import make_tiny_qwen3_moe

                make_tiny_qwen3_moe(init, self.cfg.policy.tiny, seed=self.cfg.seed)
        return str(init)

    def warm_start_phase(self, path: str):
        """The warm start on the running learner (rl/warm_start.py), its rounds validated on the
        rollout workers when `warm_start.patience` asks; the phase object (for `more`)."""
        from transformers import AutoTokenizer

        from rl.warm_start import Source, WarmStart
        from rollout.chat import ChatFormat

        c = self.cfg
        r = c.rollout
        # where a rebuilt context starts depends on a turn's room; in a full context an expert turn is
        # never cut (as before contexts were managed)
        loop = dict(
            max_turns=r.max_turns,
            max_episode_tokens=r.max_episode_tokens,
            context=r.context,
            max_model_len=r.max_model_len,
            max_new_tokens=None if r.context.mode == "full" else r.max_new_tokens,
        )
        sources = [
            Source(e, dict(c.env.kwargs) if e == c.env.id else {}, loop)
            for e in c.warm_start.envs or [c.env.id]
        ]
        return WarmStart(
            c.warm_start,
            sources,
            ChatFormat(AutoTokenizer.from_pretrained(path)),
            self.learner,
            publish=self.sync_now,
            validate=self.validate if self.workers else None,
            out=self.run_dir / "warm-start",
            log=self.console.log,
        )

    def staleness_bound(self) -> int:
        """How many versions older than the weights it trains at a token may be: the async schedule's
        lag, plus the iterations a partial rollout may span."""
        c = self.cfg
        lag = c.schedule.max_staleness if c.schedule.mode == "async" else 0
        return lag + (c.rollout.max_segments - 1 if c.rollout.iteration_token_budget else 0)

    def latest_checkpoint(self) -> Path | None:
        ckpts = sorted((self.run_dir / "checkpoints").glob("version-*/trainer_state.pt"))
        return ckpts[-1].parent if ckpts else None

    def start(self, resume: bool = False, checkpoint: str | None = None) -> None:
        """Start the actors (and, `resume`, continue from the newest checkpoint, or the one named
        `checkpoint`; a damaged one stops the run here, before anything starts: rl/checkpoints.py)."""
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
        r = c.ray
        # a GPU per rank for a cuda learner; auto: when the cluster has one for every rank (Ray hides
        # GPUs from an actor that asked for none, so the rank then trains on CPU)
        gpus = (
            c.learner.gpus_per_rank
            if c.learner.device == "cuda"
            or (
                c.learner.device == "auto"
                and ray.cluster_resources().get("GPU", 0) >= c.learner.world_size
            )
            else 0
        )
        # the learner holds the run's state: never restarted by Ray (max_restarts=0), resumed from a checkpoint
        env = allocator.actor_env(c.learner.allocator)
        self.learner = LearnerGroup(
            c.learner.world_size,
            dict(
                num_cpus=r.learner_cpus,
                num_gpus=gpus,
                resources=dict(r.learner_resources),
                max_restarts=0,
                **({"runtime_env": {"env_vars": env}} if env else {}),
            ),
            path,
            c.algo,
            seed=c.seed,
            dtype=c.policy.dtype,
            temperature=c.rollout.temperature,
            max_generated_tokens=c.rollout.max_turns * c.rollout.max_new_tokens,
            max_staleness=self.staleness_bound(),
            expert_parallel=c.learner.expert_parallel,
            backend=c.learner.backend,
            device="cuda" if gpus else "cpu",
            precision=c.learner.precision,
            lora=c.lora,
            engine_dtype=c.rollout.engine_dtype(c.policy.dtype),
        )
        rollouts = self.source is None  # training from a store needs no engines and no environments
        self.rubric = build_rubric(c.reward.parts)
        # a judge model for the rubric's judge parts: one actor, restarted if it dies
        j = c.reward.judge
        self.judge = (
            JudgeActor.options(
                num_cpus=j.cpus, num_gpus=j.gpus, max_restarts=r.max_restarts
            ).remote(
                c.reward.judge_path(),
                str(self.run_dir / "judge_cache.jsonl"),
                name=j.model,
                seed=c.seed,
                max_model_len=j.max_model_len,
                kv_cache_gib=j.kv_cache_gib,
            )
            if self.rubric.judges and rollouts
            else None
        )
        self.env_workers = [
            EnvWorkerActor.options(
                num_cpus=c.env.cpus_per_worker,
                max_concurrency=c.env.worker_concurrency,
                resources=dict(r.env_worker_resources),
                max_restarts=r.max_restarts,
            ).remote(c.env.id, c.env.kwargs)
            for _ in range(c.env.workers if rollouts else 0)
        ]
        # async: a worker runs its calls at once, so the rollouts of consecutive iterations share its engine
        # (one waits for its tools while another generates); room for them all, a load, an evaluation and
        # the driver's queries. A rollout waits there for the version its iteration needs.
        concurrent = c.schedule.mode == "async"
        self.workers = [
            RolloutWorkerActor.options(
                num_cpus=c.rollout.cpus_per_worker,
                num_gpus=c.rollout.gpus_per_worker,
                resources=dict(r.rollout_resources),
                max_restarts=r.max_restarts,
                max_concurrency=c.schedule.max_staleness + 4 if concurrent else 1,
            ).remote(
                path,
                c.rollout,
                c.env,
                seed=c.seed + i,
                dtype=c.rollout.engine_dtype(c.policy.dtype),
                env_actors=self.env_workers,
                reward_parts=c.reward.parts,
                judge=self.judge,
                judge_timeout_s=j.timeout_s,
                wait_for_version_s=c.sync.timeout_s if concurrent else 0.0,
            )
            for i in range(c.rollout.num_workers if rollouts else 0)
        ]
        self._outstanding = [{} for _ in self.workers]
        self._wait_started(c.ray.start_timeout_s)
        if self.collective and self.workers:
            self.form_sync_group()
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

    def _wait_started(self, timeout_s: float) -> None:
        """Every rollout worker up (its engine loaded). Ray never fails an actor it cannot place,
        it waits: a cluster without the CPUs or GPUs asked for would hang here without a word."""
        refs = [w.version.remote() for w in self.workers]
        ready, late = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        ray.get(ready)  # an engine that failed to start raises its error here
        if late:
            c = self.cfg.rollout
            raise TimeoutError(
                f"{len(late)} of {len(refs)} rollout workers did not start within {timeout_s:.0f}s; each asks for "
                f"{c.cpus_per_worker} CPU(s){f' and {c.gpus_per_worker} GPU(s)' if c.gpus_per_worker else ''}, and "
                f"the cluster has {ray.available_resources()} free: lower rollout.cpus_per_worker or "
                "rollout.num_workers, or add nodes"
            )

    def _resume_from(self, ckpt: Path) -> None:
        """Learner state from the checkpoint, engines synced to it; later records set aside.

        Iterations after the checkpoint are run again, so their shards move to
        `trajectories/superseded/` (kept, never deleted) and their metrics lines are dropped."""
        state = self._learner_get(
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
            f"resumed from {ckpt.name}: policy version {self.version}, "
            f"next iteration {self.start_iteration}"
        )

    # --- one iteration ---
    def submit(self, iteration: int) -> None:
        """Queue an iteration's episodes on the rollout workers (split evenly; returns at once)."""
        if (
            self.source is not None
            or iteration in self._inflight
            or iteration >= self.cfg.iterations
        ):
            return
        tasks = iteration_tasks(self.cfg, iteration)
        shares = [tasks[i :: len(self.workers)] for i in range(len(self.workers))]
        for i, share in enumerate(shares):
            self._outstanding[i].update((t.episode_id, t) for t in share)
        # a worker continues its suspended episodes in every call, so each gets one, even with no new task;
        # every rollout queued now runs after the loads queued before it: at least the current version
        self._inflight[iteration] = [
            (i, s, self.version, self._call_rollout(i, s, self.version, iteration))
            for i, s in enumerate(shares)
        ]

    def _call_rollout(self, i: int, share: list[EpisodeTask], min_version: int, iteration: int):
        tokens = self.cfg.rollout.episode_tokens_at(iteration)
        return self.workers[i].rollout.remote(share, min_version, tokens)

    def rollout(self, iteration: int) -> list[Trajectory]:
        if self.source is not None:
            shards = self.source.shards()
            if iteration >= len(shards):
                raise FileNotFoundError(
                    f"--from-store {self.source.dir.parent} holds {len(shards)} iteration(s); "
                    f"iteration {iteration} has no data"
                )
            return list(self.source.trajectories(shards[iteration]))
        self.submit(iteration)
        parts, out = self._inflight.pop(iteration), []
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
                    for p in self._inflight.values()
                    for j, s, _, _ in p
                    for t in s
                    if j == i
                }
                share = [t for eid, t in self._outstanding[i].items() if eid not in elsewhere]
                what = (
                    "restarted without the current weights"
                    if isinstance(exc, StaleWorkerError)
                    else "died"
                )
                self.console.log(
                    f"[yellow]rollout worker {i} {what} ({type(exc).__name__}); running its "
                    f"{len(share)} episode(s) of iteration {iteration} again[/]"
                )
                self.restore_worker(i, min_version)
                self.episodes_rerun += len(share)
                parts.append(
                    (i, share, min_version, self._call_rollout(i, share, min_version, iteration))
                )
                continue
            for t in done:
                self._outstanding[i].pop(t.episode_id, None)
            out.extend(done)
        # judge parts were sent to the judge as each worker finished (rank parts: now, with whole groups);
        # the rubric is applied once their scores are in
        ask_groups(self.rubric, out, self.judge)
        self._judge_row = settle(self.rubric, out, self.cfg.reward.judge.timeout_s)
        return out

    def trainable(self, ended: list[Trajectory]) -> list[Trajectory]:
        """The episodes whose whole group has ended, held ones first; the others are held back
        (partial rollouts end a group's episodes in different iterations)."""
        pool = self._held + ended
        counts = Counter(t.group_id for t in pool)
        ready = {g for g, n in counts.items() if n >= self.cfg.rollout.group_size}
        self._held = [t for t in pool if t.group_id not in ready]
        return [t for t in pool if t.group_id in ready]

    def restore_worker(self, i: int, min_version: int) -> None:
        """Wait until Ray has restarted rollout worker `i`, then sync it to the learner's current
        weights if it holds an older version than `min_version` (collective transport: the sync
        group is formed again with it and every worker is synced)."""
        self.worker_restarts += 1
        w, timeout = self.workers[i], self.cfg.sync.timeout_s
        deadline = time.monotonic() + timeout
        while True:
            try:
                version = ray.get(w.version.remote(), timeout=max(1.0, deadline - time.monotonic()))
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as exc:
                # unreachable while Ray notices the death and restarts it (vLLM takes a while to start)
                if time.monotonic() > deadline:
                    raise WorkerLost(
                        f"rollout worker {i} did not come back within sync.timeout_s={timeout:.0f}s (Ray restarts "
                        f"it at most ray.max_restarts={self.cfg.ray.max_restarts} times; last error: "
                        f"{type(exc).__name__}: {exc})"
                    ) from None
                time.sleep(1.0)
                continue
            if self.collective:  # the restarted worker is not in the old group
                self.form_sync_group()
                if version < min_version:
                    self.sync_now()
                return
            if version >= min_version:
                return
            with self._learner_alive("publishing weights"):
                pending = start_sync(
                    self.learner,
                    [w],
                    self.cfg.sync.bucket_mb,
                    [i],
                    self.cfg.sync_streams(),
                    shared=self.cfg.sync.shared_memory,
                )
            pending.finish(max(1.0, deadline - time.monotonic()))
            if not pending.lost:
                self.console.log(f"rollout worker {i} is back, at policy version {pending.version}")
                return

    def sync_now(self) -> dict:
        """Publish (or, collective transport, broadcast) the learner's weights and wait until every
        worker has loaded them. A worker that died meanwhile is restored, then synced on its own (on
        the collective transport its death broke the broadcast for all: the group is formed again
        and everyone is synced)."""
        if not self.workers:  # training from a store: nobody to sync
            return {}
        if self.collective:  # the learner broadcasts: it is busy until every worker has loaded
            with self._learner_alive("broadcasting weights"):
                pending = start_collective_sync(
                    self.learner, self.workers, self.cfg.sync.bucket_mb, self.version
                )
                out = pending.finish(self.cfg.sync.timeout_s)
        else:
            with self._learner_alive("publishing weights"):
                pending = start_sync(
                    self.learner,
                    self.workers,
                    self.cfg.sync.bucket_mb,
                    stream=self.cfg.sync_streams(),
                    shared=self.cfg.sync.shared_memory,
                )
            out = pending.finish(self.cfg.sync.timeout_s)
        for i in pending.lost:
            self.restore_worker(i, pending.version)
        return out

    @property
    def collective(self) -> bool:
        return self.cfg.sync.transport == "collective"

    def form_sync_group(self) -> None:
        with self._learner_alive("forming the weight-sync group"):
            form_group(self.learner, self.workers, self.cfg.sync_backend(), self.cfg.sync.timeout_s)

    def play_held_out(
        self,
        split: str = "validation",
        episodes: int | None = None,
        env_kwargs: dict | None = None,
        loop: dict | None = None,
        keep: str | None = None,
    ) -> tuple[dict, list[Trajectory]]:
        """Held-out episodes of `split` (rl/evaluate.py: validation seeds for anything tuned or
        watched, test seeds for what is reported) on the rollout workers, split evenly: (summary,
        trajectories). `env_kwargs` and `loop` (the agent loop's keywords, e.g. a `context` mode or
        `max_turns`) replace the run's for this evaluation. A worker that dies is restored and its
        share played again; a second loss stops the run (WorkerLost): an evaluation is never skipped.
        In async mode it runs beside the rollouts in flight, with the weights loaded by then. `keep`
        ("DIR/NAME"): the episodes are also stored, as shard NAME of a store at RUN_DIR/DIR
        (`longhorizon inspect RUN_DIR/DIR`), for a look at what held-out episodes did."""
        from rl.evaluate import eval_tasks, summarise

        e = self.cfg.eval
        env_id, kwargs = (
            (e.env_id, dict(e.env_kwargs))
            if e.env_id
            else (self.cfg.env.id, dict(self.cfg.env.kwargs))
        )
        kwargs = kwargs if env_kwargs is None else {**kwargs, **env_kwargs}
        tasks = eval_tasks(episodes or e.episodes, e.k, split)
        temperature = e.temperature or self.cfg.rollout.temperature
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
            self.console.log(
                f"[yellow]held-out evaluation: rollout worker(s) {names} died; restoring and playing "
                "their share again[/]"
            )
            for i, _ in lost:
                self.restore_worker(i, self.version)
            shares = {i: shares[i] for i, _ in lost}
        raise AssertionError("unreachable")

    def evaluate(self) -> dict:
        """Held-out evaluation on validation seeds, as `eval/*` metrics (`play_held_out`)."""
        t0, k = time.perf_counter(), self.cfg.eval.k
        s, trajs = self.play_held_out("validation")
        out = {
            "eval/success": s["success"],
            "eval/ci95_low": s["ci95"][0],
            "eval/ci95_high": s["ci95"][1],
            "eval/milestones_mean": s["milestones_mean"],
            "eval/reward_mean": s["reward_mean"],
            "eval/episodes": s["episodes"],
            "eval/s": time.perf_counter() - t0,
            # the oldest version it sampled with (async: the weights loaded by then)
            "eval/policy_version": min(
                (turn.policy_version for t in trajs for turn in t.turns), default=-1
            ),
        }
        if k > 1:
            out[f"eval/pass@{k}"] = s[f"pass@{k}"]
        return out

    def validate(self, keep: str | None = None) -> dict:
        """Held-out success on validation seeds (the warm start's rounds), as `summarise` reports it;
        `keep`: where its episodes are stored (`play_held_out`)."""
        return self.play_held_out("validation", keep=keep)[0]

    def _learner_get(self, refs, during: str):
        with self._learner_alive(during):
            return result(refs)

    @contextmanager
    def _learner_alive(self, during: str):
        """Turns the learner actor's death into `LearnerDied` (the only actor the calls inside reach)."""
        try:
            yield
        except ray.exceptions.RayActorError as exc:
            raise LearnerDied(self.run_dir, self.latest_checkpoint(), during, exc) from None

    def _finish_syncs(self, collected: int) -> dict:
        """Wait for the queued syncs that no longer sit behind a rollout still running (async);
        metrics of the newest one."""
        out = {}
        while self._syncs and self._syncs[0][0] <= collected:
            pending = self._syncs.pop(0)[1]
            out = pending.finish(self.cfg.sync.timeout_s)
            # a worker that died before this load: its queued rollouts fail and are rerun on collection;
            # syncing it now keeps rollouts submitted later from meeting an unsynced worker
            for i in pending.lost:
                self.restore_worker(i, pending.version)
        return out

    def iteration(self, it: int) -> dict:
        t0 = time.perf_counter()
        asynchronous = self.cfg.schedule.mode == "async"
        trajs = self.rollout(it)
        # async: only the wait for rollouts that were not done yet
        rollout_s = time.perf_counter() - t0
        sync = self._finish_syncs(it) if asynchronous else {}
        # what ended in this iteration, trained now or later
        self.store.write(f"iter-{it:06d}", trajs)
        batch = self.trainable(trajs) if self.source is None else trajs
        # how many versions behind the weights about to train on it the oldest token is (0 when synchronous)
        staleness = max(
            (self.version - min(t.policy_version for t in tr.turns) for tr in batch if tr.turns),
            default=0,
        )
        stats = self._learner_get(
            self.learner.train_step.remote(batch), f"the update of iteration {it}"
        )
        self.version = stats.pop("policy_version")
        annotations = stats.pop("annotations", {})
        if annotations:
            self.store.write_learner(f"iter-{it:06d}", annotations, self.version - 1)
        if asynchronous and self.workers:
            # the load queues behind every rollout already submitted; what is submitted next uses it
            with self._learner_alive("publishing weights"):
                pending = start_sync(
                    self.learner,
                    self.workers,
                    self.cfg.sync.bucket_mb,
                    stream=self.cfg.sync_streams(),
                    shared=self.cfg.sync.shared_memory,
                )
            self._syncs.append((max(self._inflight, default=it), pending))
            self.submit(it + 1 + self.cfg.schedule.max_staleness)
        else:
            sync = self.sync_now()
        last = it + 1 == self.cfg.iterations
        if last:
            while self._syncs:  # nothing is left to roll out: the last versions must still arrive
                sync = self._finish_syncs(self._syncs[0][0])
        every = self.cfg.eval.every
        held_out = (
            self.evaluate() if every and self.workers and ((it + 1) % every == 0 or last) else {}
        )
        if last or (it + 1) % self.cfg.checkpoint_every == 0:
            path = self.run_dir / "checkpoints" / f"version-{self.version:06d}"
            self._learner_get(
                self.learner.save_checkpoint.remote(str(path), {"iteration": it}),
                "a checkpoint save",
            )
        busy = self._engine_busy()  # read first: the clock below then spans what it spans
        now = time.perf_counter()
        iteration_s = now - (self._last_row_t or t0)
        self._last_row_t = now
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
            **self._judge_row,
            "worker_restarts": self.worker_restarts,
            "episodes_rerun": self.episodes_rerun,
            "episodes_trained": len(batch),
            "episodes_held": len(self._held),
            # episodes of this or earlier iterations still running: suspended by the token budget
            "episodes_suspended": sum(
                t.iteration <= it for o in self._outstanding for t in o.values()
            ),
            "episodes_per_s": len(trajs) / max(iteration_s, 1e-9),
            # the share of the iteration's wall time the engines spent in engine calls (mean over workers)
            **({"engine_busy": busy / max(iteration_s, 1e-9)} if busy is not None else {}),
            "gen_tokens_per_s": sum(t.num_generated for t in trajs) / max(iteration_s, 1e-9),
        }
        with open(self.run_dir / "metrics.jsonl", "a") as fh:
            fh.write(json.dumps(row) + "\n")
        self.guard.check(it, trajs, stats)  # after the row is written: what the run did is on disk
        if self.tensorboard is None:
            self.tensorboard = TensorBoardLog(self.run_dir)
        self.tensorboard.log(row)
        if self.cfg.log.wandb_project:
            if self.wandb is None:
                from rl.loggers import WandbLog

                self.wandb = WandbLog(self.cfg, self.run_dir)
            self.wandb.log(row)
        return row

    def _engine_busy(self) -> float | None:
        """Mean seconds the rollout workers' engines spent in engine calls since the last row; None
        when a worker cannot answer (dead, restarting) or when there are no workers."""
        if not self.workers:
            return None
        try:
            now = ray.get([w.engine_busy_s.remote() for w in self.workers], timeout=30)
        except (*WORKER_LOST, ray.exceptions.GetTimeoutError):
            return None
        last = self._busy_last if len(self._busy_last) == len(now) else [0.0] * len(now)
        self._busy_last = now
        # a restarted worker counts from zero again
        return sum(n - b if n >= b else n for n, b in zip(now, last)) / len(now)

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
            bar = progress.add_task(
                "train",
                total=self.cfg.iterations,
                completed=self.start_iteration,
                status="rolling out",
            )
            if self.cfg.eval.every and self.workers and self.start_iteration == 0:
                # the starting point (after any warm start: its best round was evaluated on the same
                # validation seeds with these weights), for comparison with the evaluations to come
                v = self.warm_start_summary.get("validation")
                initial = (
                    self.evaluate()
                    if not v
                    else {
                        "eval/success": v["success"],
                        "eval/ci95_low": v["ci95"][0],
                        "eval/ci95_high": v["ci95"][1],
                        "eval/milestones_mean": v["milestones_mean"],
                        "eval/reward_mean": v["reward_mean"],
                        "eval/episodes": v["episodes"],
                        "eval/policy_version": self.version,
                        "eval/from_warm_start": 1,
                    }
                )
                (self.run_dir / "eval-initial.json").write_text(json.dumps(initial))
                if initial:
                    progress.console.log(
                        f"held-out success before RL: {initial['eval/success']:.3f} "
                        f"({initial['eval/ci95_low']:.3f}–{initial['eval/ci95_high']:.3f})"
                    )
            self._engine_busy()  # the baseline: what the engines did before (an evaluation) is no iteration's
            self._last_row_t = time.perf_counter()
            # the first iterations all start from the current weights
            if self.cfg.schedule.mode == "async":
                for j in range(
                    self.start_iteration, self.start_iteration + self.cfg.schedule.max_staleness + 1
                ):
                    self.submit(j)
            for it in range(self.start_iteration, self.cfg.iterations):
                row = self.iteration(it)
                rows.append(row)
                loss = f"loss {row['loss']:+.4f}" if "loss" in row else "no usable episodes"
                sync = f"  sync {row['sync_s'] * 1e3:.0f} ms" if "sync_s" in row else ""
                status = f"reward {row['mean_reward']:.3f}  {loss}  v{row['policy_version']}{sync}"
                if row.get("infra_errors"):
                    status += f"  infra errors {row['infra_errors']}"
                progress.console.log(
                    f"iter {it}: {status}  {row['episodes_per_s']:.2f} episodes/s  "
                    f"gen {row['gen_tokens_per_s']:.0f} tok/s  staleness {row['staleness_max']}"
                    + (f"  engine busy {row['engine_busy']:.0%}" if "engine_busy" in row else "")
                )
                progress.update(bar, advance=1, status=status)
        if self.wandb is not None:  # W&B writes its run file out when the run finishes
            self.wandb.close()
            self.wandb = None
        self.guard.finish()  # a run whose last iteration could not learn does not end green
        return rows

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
            self.tensorboard = None
        if self.wandb is not None:
            self.wandb.close()
            self.wandb = None
        self._inflight, self._syncs = {}, []
        judge = [self.judge] if self.judge is not None else []
        for actor in (
            self.workers
            + self.env_workers
            + judge
            + (self.learner.actors if self.learner is not None else [])
        ):
            ray.kill(actor)
        self.workers, self.env_workers, self.learner, self.judge = [], [], None, None

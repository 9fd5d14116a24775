"""The run's Ray actors: the policy they start from, starting them (the learner group, the judge,
env workers, rollout workers), waiting until the engines are up, and stopping them.

The learner holds the run's state, so Ray never restarts it (`max_restarts=0`): its death stops
the run with `LearnerDied` (rl/faults.py). Rollout and env workers, the judge too, are restarted
by Ray (`ray.max_restarts`); bringing a restarted rollout worker back to the current weights is
rl/weight_sync/driver.py's job.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import ray

from envs.env_worker import EnvWorkerActor
from rl.config import RunConfig
from rl.learner import allocator
from rl.learner.learner_group import LearnerGroup
from rollout.judge_actor import JudgeActor
from rollout.worker import RolloutWorkerActor


def policy_path(cfg: RunConfig, run_dir: Path, source_dir: Path | None = None) -> str:
    """The policy the run starts from (before any warm start: that runs on the learner). `source_dir`:
    the trajectories of the run a `--from-store` run trains on (its stored ids are that run's
    tokenizer's, so it trains that run's policy)."""
    # converted and upcycled once, in the local cache (rl/start/pretrained.py)
    if cfg.policy.pretrained:
        from rl.start.pretrained import for_config

        return str(for_config(cfg.policy))
    if cfg.policy.path:
        return cfg.policy.path
    if source_dir is not None:
        init = source_dir.parent / "policy-init"
        if not (init / "config.json").exists():
            raise FileNotFoundError(f"--from-store: set policy.path; {init} holds no policy")
        return str(init)
    init = run_dir / "policy-init"
    if not (init / "config.json").exists():
        if cfg.policy.flavour:
            from policy.args import load_model_args
            from rl.start.tiny import make_tiny_policy

            make_tiny_policy(init, load_model_args(cfg.policy.flavour), seed=cfg.seed)
        else:
            from rl.start.tiny import make_tiny_qwen3_moe

            make_tiny_qwen3_moe(init, cfg.policy.tiny, seed=cfg.seed)
    return str(init)


def staleness_bound(cfg: RunConfig) -> int:
    """How many versions older than the weights it trains at a token may be: the async schedule's
    lag, plus the iterations a partial rollout may span."""
    lag = cfg.schedule.max_staleness if cfg.schedule.mode == "async" else 0
    budget = cfg.rollout.iteration_token_budget
    return lag + (cfg.rollout.max_segments - 1 if budget else 0)


@dataclass
class Actors:
    """What `start_actors` started; `kill` stops them all."""

    learner: LearnerGroup
    judge: object | None = None
    env_workers: list = field(default_factory=list)
    workers: list = field(default_factory=list)

    def kill(self) -> None:
        judge = [self.judge] if self.judge is not None else []
        for actor in self.workers + self.env_workers + judge + self.learner.actors:
            ray.kill(actor)


def start_actors(cfg: RunConfig, path: str, run_dir: Path, rollouts: bool, judged: bool) -> Actors:
    """The learner group on `path`, and with `rollouts` the env workers, the rollout workers (their
    engines loaded) and, `judged` (the rubric has judge parts), the judge model's actor."""
    c, r = cfg, cfg.ray
    # a GPU per rank for a cuda learner; auto: when the cluster has one for every rank (Ray hides
    # GPUs from an actor that asked for none, so the rank then trains on CPU)
    wants_gpu = c.learner.device == "cuda" or (
        c.learner.device == "auto" and ray.cluster_resources().get("GPU", 0) >= c.learner.world_size
    )
    gpus = c.learner.gpus_per_rank if wants_gpu else 0
    # the learner holds the run's state: never restarted by Ray (max_restarts=0), resumed from a checkpoint
    env = allocator.actor_env(c.learner.allocator)
    learner = LearnerGroup(
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
        c.learner,
        seed=c.seed,
        dtype=c.policy.dtype,
        temperature=c.rollout.temperature,
        max_generated_tokens=c.rollout.max_turns * c.rollout.max_new_tokens,
        max_staleness=staleness_bound(c),
        expert_parallel=c.learner.expert_parallel,
        backend=c.learner.backend,
        device="cuda" if gpus else "cpu",
        lora=c.lora,
        engine_dtype=c.rollout.engine_dtype(c.policy.dtype),
    )
    actors = Actors(learner)
    if not rollouts:  # training from a store needs no engines and no environments
        return actors
    # a judge model for the rubric's judge parts: one actor, restarted if it dies
    j = c.reward.judge
    if judged:
        actors.judge = JudgeActor.options(
            num_cpus=j.cpus, num_gpus=j.gpus, max_restarts=r.max_restarts
        ).remote(
            c.reward.judge_path(),
            str(run_dir / "judge_cache.jsonl"),
            name=j.model,
            seed=c.seed,
            max_model_len=j.max_model_len,
            kv_cache_gib=j.kv_cache_gib,
        )
    actors.env_workers = [
        EnvWorkerActor.options(
            num_cpus=c.env.cpus_per_worker,
            max_concurrency=c.env.worker_concurrency,
            resources=dict(r.env_worker_resources),
            max_restarts=r.max_restarts,
        ).remote(c.env.id, c.env.kwargs)
        for _ in range(c.env.workers)
    ]
    # async: a worker runs its calls at once, so the rollouts of consecutive iterations share its engine
    # (one waits for its tools while another generates); room for them all, a load, an evaluation and
    # the driver's queries. A rollout waits there for the version its iteration needs.
    concurrent = c.schedule.mode == "async"
    actors.workers = [
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
            env_actors=actors.env_workers,
            reward_parts=c.reward.parts,
            judge=actors.judge,
            judge_timeout_s=j.timeout_s,
            wait_for_version_s=c.sync.timeout_s if concurrent else 0.0,
        )
        for i in range(c.rollout.num_workers)
    ]
    wait_started(cfg, actors.workers)
    return actors


def wait_started(cfg: RunConfig, workers: list) -> None:
    """Every rollout worker up (its engine loaded). Ray never fails an actor it cannot place,
    it waits: a cluster without the CPUs or GPUs asked for would hang here without a word."""
    timeout_s = cfg.ray.start_timeout_s
    refs = [w.version.remote() for w in workers]
    ready, late = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    ray.get(ready)  # an engine that failed to start raises its error here
    if late:
        c = cfg.rollout
        gpus = f" and {c.gpus_per_worker} GPU(s)" if c.gpus_per_worker else ""
        raise TimeoutError(
            f"{len(late)} of {len(refs)} rollout workers did not start within {timeout_s:.0f}s; each asks for "
            f"{c.cpus_per_worker} CPU(s){gpus}, and "
            f"the cluster has {ray.available_resources()} free: lower rollout.cpus_per_worker or "
            "rollout.num_workers, or add nodes"
        )

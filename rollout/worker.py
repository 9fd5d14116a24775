"""RolloutWorker: one engine (vLLM, or the native one for the `policy/` model), a tokenizer-level
chat format and environment instances.

A plain class; `RolloutWorkerActor` is its thin Ray shell, so the same code runs in-process in
tests and debugging. Environments run in the worker's process, or, given `env_actors`, in
EnvWorker actors (`envs/env_worker.py`), one slot per episode, spread over the actors round-robin.

Its calls may run at once, on threads of their own (the async schedule makes its actor threaded):
the engine is a `SharedEngine` (rollout/engines/shared.py), whose thread batches the concurrent
calls' generate requests continuously (each episode's turn joins the running batch: the agent loop
runs every episode on its own) and runs a weight load once the requests in flight have ended. A rollout
that needs a version not loaded yet waits for it (`wait_for_version_s`) instead of refusing.
Agent programs' episodes are the exception: they share one OpenAI-compatible endpoint, whose
sampling an evaluation sets for its time, so their calls run one at a time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import threading
import time
import warnings

import ray

import envs
from envs.config import EnvConfig
from envs.env_worker import RemoteEnv
from rollout.agent_loop import continue_episodes
from rollout.chat import ChatFormat
from rollout.config import RolloutConfig
from rollout.engines import make_engine
from rollout.engines.base import Generation
from rollout.engines.shared import SharedEngine
from rollout.judge_actor import ask, ask_groups, settle
from rollout.program_episodes import run_agent_episodes
from rollout.trajectory import EpisodeTask, Trajectory
from rollout.weights import CheckpointTensors, Manifest, iter_weights, merge_adapters


class StaleWorkerError(RuntimeError):
    """A rollout worker was asked to generate with older weights than the caller's version."""


class RolloutWorker:
    def __init__(
        self,
        policy_path: str,
        rollout: RolloutConfig,
        env: EnvConfig,
        *,
        seed: int = 0,
        dtype: str | None = None,
        env_actors: list | None = None,
        reward_parts: list | None = None,
        judge=None,
        judge_timeout_s: float = 300.0,
        wait_for_version_s: float = 0.0,
    ):
        from transformers import AutoTokenizer

        self.cfg, self.env_cfg, self.seed = rollout, env, seed
        self.policy_path = policy_path
        from rewards.rubric import build

        # the default: the environment's milestones, as paid
        self.rubric = build(reward_parts or [])
        self.judge, self.judge_timeout_s = (
            judge,
            judge_timeout_s,
        )  # the run's JudgeActor, for judge parts
        self._base = None  # the checkpoint's tensors, opened at the first adapter sync (LoRA)
        self.sync_group = None  # the collective transport's group, once the driver forms it
        self.env_actors = list(env_actors or [])
        self.suspended: list = []  # partial rollouts: episodes whose budget ran out, continued next call
        # concurrent calls (a threaded actor): how long a rollout waits for the version it needs (a load
        # queued by the same caller but started after it); 0: refuse at once, as a worker whose calls
        # run one at a time must (the load could only run after it)
        self.wait_for_version_s = wait_for_version_s
        # the state concurrent calls share: suspended episodes, the endpoint
        self._lock = threading.Lock()
        self._loaded = threading.Condition()  # notified after every load
        # agent programs' calls run one at a time: they share one endpoint, whose sampling an evaluation sets
        self._programs = threading.Lock()
        self._loads = 0
        # slots on shared EnvWorkers: a random 32-bit prefix per rollout worker keeps them apart
        self._slots = itertools.count(int.from_bytes(os.urandom(4), "little") << 32)
        envs.spec(env.id)  # fail here, by name, if the environment is unknown
        self.endpoint = (
            None  # the OpenAI-compatible API over the engine, started for agent programs
        )
        self.chat = ChatFormat(AutoTokenizer.from_pretrained(policy_path))
        self.engine = SharedEngine(
            lambda: make_engine(
                rollout.engine,
                policy_path,
                seed=seed,
                max_model_len=rollout.max_model_len,
                # the run's engine dtype (an `auto` rollout dtype follows the policy's, which the trainer
                # passes); else the rollout section's own
                dtype=dtype or rollout.engine_dtype(),
                kv_cache_gib=rollout.kv_cache_gib,
                enforce_eager=rollout.enforce_eager,
                max_batch=rollout.max_batch,
                gpu_memory_utilization=rollout.gpu_memory_utilization,
            )
        )

    def version(self) -> int:
        return self.engine.version

    def rollout(
        self, tasks: list[EpisodeTask], min_version: int = 0, max_episode_tokens: int | None = None
    ) -> list[Trajectory]:
        """Run the episodes, after continuing the ones suspended in earlier calls (partial rollouts,
        `rollout.iteration_token_budget`); returns the trajectories of the episodes that ended.

        `min_version`: the policy version the caller expects this worker to hold at least; a worker
        that Ray restarted after a crash comes back at the initial weights and refuses
        (`StaleWorkerError`) rather than generate with them. `max_episode_tokens`: the limit of the
        episodes started now (a staged schedule), default `rollout.max_episode_tokens`."""
        self._await_version(min_version)
        c = self.cfg
        # user code, through the endpoint
        if envs.is_agent_program(envs.env_class(self.env_cfg.id)):
            with self._programs:
                done = run_agent_episodes(
                    self.serve(), self.env_cfg.id, self.env_cfg.kwargs, tasks, self.chat, "policy"
                )
            return ask(self.rubric, done, self.judge, self.env_cfg.kwargs)
        with self._lock:  # on an error they are closed, not handed back
            carried, self.suspended = self.suspended, []
        done, suspended = continue_episodes(
            self.engine,
            self.chat,
            self.make_env,
            self.env_cfg.id,
            tasks,
            **c.loop(max_episode_tokens=max_episode_tokens or c.max_episode_tokens),
            run_seed=self.seed,
            suspended=carried,
            token_budget=c.iteration_token_budget,
            max_segments=c.max_segments,
        )
        with self._lock:
            self.suspended += suspended
        # judged: the trainer settles them
        return ask(self.rubric, done, self.judge, self.env_cfg.kwargs)

    def _await_version(self, min_version: int) -> None:
        """Return once the engine holds `min_version` or newer; `StaleWorkerError` if it will not. A
        worker that Ray restarted after a crash comes back at the initial weights: until the driver
        syncs it, it refuses at once."""
        if self.engine.version >= min_version:
            return
        restarted = (
            ray.is_initialized() and ray.get_runtime_context().was_current_actor_reconstructed
        )
        wait = self.wait_for_version_s > 0 and not (restarted and self._loads == 0)
        if wait:
            with self._loaded:
                if self._loaded.wait_for(
                    lambda: self.engine.version >= min_version, timeout=self.wait_for_version_s
                ):
                    return
        raise StaleWorkerError(
            f"holds policy version {self.engine.version}, the rollout needs {min_version} "
            + (
                f"(waited {self.wait_for_version_s:.0f} s for it)"
                if wait
                else "(a restarted worker, not yet synced)"
            )
        )

    def _loaded_version(self) -> None:
        with self._loaded:
            self._loads += 1
            self._loaded.notify_all()

    def evaluate(
        self,
        env_id: str,
        env_kwargs: dict,
        tasks: list[EpisodeTask],
        temperature: float,
        loop: dict | None = None,
    ) -> list[Trajectory]:
        """Held-out episodes (rl/loop/evaluate.py) with the current weights, in this process's environments;
        nothing suspended, nothing kept. `loop`: agent-loop keywords that replace the run's for these
        episodes (`context` as a mapping of rollout.context fields that replace the run's)."""
        from rollout.agent_loop import play

        c = self.cfg
        loop = dict(loop or {})
        if isinstance(loop.get("context"), dict):
            loop["context"] = dataclasses.replace(c.context, **loop["context"])
        if envs.is_agent_program(envs.env_class(env_id)):
            with (
                self._programs,
                self.serve().sampling(temperature) as endpoint,
            ):  # eval.temperature, not the run's
                done = run_agent_episodes(endpoint, env_id, env_kwargs, tasks, self.chat, "policy")
        else:
            done = play(
                self.engine,
                self.chat,
                env_id,
                env_kwargs,
                tasks,
                **c.loop(temperature=temperature, **loop),
                run_seed=self.seed,
            )
        ask(self.rubric, done, self.judge, env_kwargs)
        ask_groups(self.rubric, done, self.judge)
        settle(self.rubric, done, self.judge_timeout_s)
        return done

    def serve(self):
        """The OpenAI-compatible API over this worker's engine, on loopback (started once; rollout/openai_api.py),
        sampling as the run does."""
        with self._lock:
            return self._serve()

    def _serve(self):
        if self.endpoint is None:
            from rollout.openai_api import OpenAIServer

            c = self.cfg
            self.endpoint = OpenAIServer(
                self.engine,
                self.chat.tok,
                "policy",
                max_model_len=c.max_model_len,
                default_max_tokens=c.max_new_tokens,
                training={
                    "temperature": c.temperature,
                    "top_p": c.top_p,
                    "max_tokens": c.max_new_tokens,
                },
                own_thread=False,
            )  # driven by the calling thread; the engine runs on its own
            self.endpoint.start()
        return self.endpoint

    def engine_busy_s(self) -> float:
        """Seconds the engine has spent in calls since the worker started (its utilisation)."""
        return self.engine.busy_s

    def make_env(self):
        if not self.env_actors:
            return envs.make(self.env_cfg.id, **self.env_cfg.kwargs)
        slot = next(self._slots)
        return RemoteEnv(self.env_actors[slot % len(self.env_actors)], slot)

    def load_weights(self, manifest: Manifest) -> dict:
        """Load a published version (rollout/weights.py) in place, fetching its buckets one at a time while
        the engine loads them; returns the new version, seconds, bytes and buckets received, and the
        engine's counts (`tensors`, `direct`). An adapter manifest (LoRA) is added to the base weights
        this worker started from."""
        t0 = time.perf_counter()
        with warnings.catch_warnings(), self._node_load_turn():
            # Arrays from Ray's object store are read-only views; vLLM copies them into its params.
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            waited = time.perf_counter() - t0
            loaded = self._load(
                self._served(iter_weights(manifest), manifest.adapter), manifest.version
            )
        return {
            "version": manifest.version,
            "load_s": time.perf_counter() - t0,
            "load_wait_s": waited,
            "bytes": manifest.nbytes,
            "buckets": len(manifest.buckets),
            **loaded,
        }

    def _load(self, named, version: int) -> dict:
        """Load a version into the engine, unless a newer one is there already: concurrent calls (a
        threaded actor) may start out of order, and a version must never go back. The answer of a
        load that was skipped so says `superseded` (the newer version)."""

        def load(engine):
            if version < engine.version:
                return {"superseded": engine.version}
            return engine.load_weights(named, version)

        # a load that fails partway leaves the engine refusing requests until one completes
        loaded = self.engine.load(load, version)
        self._loaded_version()
        return loaded

    @contextlib.contextmanager
    def _node_load_turn(self):
        """On CPU, one engine of this node loads at a time. Every CPU engine's OpenMP threads run on
        all of the node's cores (rollout/engines/vllm_engine.py), so two loading at once contend:
        two workers on 2 cores took 0.75 s for a load one alone does in 0.13 s. One after the other
        costs the sum of the single loads instead. A file lock, so workers of any run on the node
        take turns and a dead holder releases it with its process; GPU engines load in parallel."""
        if self.cfg.gpus_per_worker > 0 or not self.cfg.serial_cpu_loads:
            yield
            return
        import fcntl
        import tempfile

        with open(
            os.path.join(tempfile.gettempdir(), "longhorizon-cpu-weight-load.lock"), "a"
        ) as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)

    def _served(self, named, adapter: bool):
        """What the engine loads: the received tensors, or (LoRA) the base weights this worker started
        from with the received factors added."""
        if not adapter:
            return named
        if self._base is None:
            self._base = CheckpointTensors(self.policy_path)
        return merge_adapters(self._base, named)

    def join_sync_group(
        self, master: str, rank: int, world: int, backend: str, timeout_s: float
    ) -> None:
        """Join the weight-sync process group as a receiver (`sync.transport: collective`)."""
        from rollout.collective import SyncGroup

        self.sync_group = None  # a group formed again replaces the old one
        self.sync_group = SyncGroup(master, rank, world, backend, timeout_s)

    def receive_weights(self) -> dict:
        """Receive the version the learner broadcasts to the sync group and load it in place, each
        bucket as it arrives (rollout/collective.py); the same answer as `load_weights`."""
        from rollout.collective import NotInGroup, received_weights

        if self.sync_group is None:
            raise NotInGroup(
                "this rollout worker is not in the weight-sync group (restarted since it was formed)"
            )
        t0, meta = time.perf_counter(), {}
        named = received_weights(self.sync_group, meta)
        first = next(named, None)  # the first bucket's description says the version and the kind
        if first is None:
            raise RuntimeError("weight sync: the learner broadcast a version with no tensors")
        # every member must receive what is broadcast, so this load is never skipped (collective syncs
        # run in the sync schedule, one call at a time)
        loaded = self.engine.load_weights(
            self._served(itertools.chain([first], named), meta["adapter"]), meta["version"]
        )
        self._loaded_version()
        return {
            "version": self.engine.version,
            "load_s": time.perf_counter() - t0,
            "bytes": meta["bytes"],
            "buckets": meta["buckets"],
            **loaded,
        }

    def generate(self, prompt_ids: list[int], max_tokens: int, seed: int) -> Generation:
        """One sampled continuation (tests and probes)."""
        return self.engine.generate([prompt_ids], max_tokens=max_tokens, seeds=[seed])[0]

    def score(self, token_ids: list[int]) -> list[float]:
        return self.engine.score(token_ids)

    def placement(self) -> dict:
        """The Ray node this worker runs on and the UUIDs of the GPUs its engine uses (rl/weight_sync/transport.py: whether
        it can read the learner's shared memory, and whether in the learner's GPU)."""
        from rollout.shared_memory import visible_gpus

        gpus = visible_gpus() if self.cfg.gpus_per_worker > 0 else []
        return {"node": ray.get_runtime_context().get_node_id(), "gpus": gpus}


RolloutWorkerActor = ray.remote(RolloutWorker)

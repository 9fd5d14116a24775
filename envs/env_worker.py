"""EnvWorker: many environment instances in one process, stepped concurrently.

A plain class (tests and debugging run it in-process); `EnvWorkerActor` is its thin Ray shell
(start it with `.options(max_concurrency=N)` so calls from many rollout threads overlap), and
`RemoteEnv` is one of its slots seen as an ordinary environment.
Instances live in slots (`reset(slot, seed)` makes one when the slot is new). `step_many` steps
several slots at once on a thread pool: the slow part of a tool environment is its sandboxed
subprocesses, which release the GIL.

Failures are sorted for the learner: whatever an environment raises in `reset` or `step`, and any
`info["infra_error"]` it reports, comes back as a result with `info["infra_error"]` set (the slot
is dropped, so the next `reset` builds a fresh instance); the worker itself never raises for an
environment's failure, so one broken sandbox does not take the other episodes down.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import ray

import envs


class EnvWorker:
    def __init__(self, env_id: str, kwargs: dict | None = None, *, threads: int = 8):
        envs.spec(env_id)  # an unknown id fails here, by name
        self.env_id, self.kwargs = env_id, dict(kwargs or {})
        self.slots: dict[int, object] = {}
        self.pool = ThreadPoolExecutor(max_workers=threads)
        self.failures = 0

    def _fail(self, slot: int, where: str, exc: BaseException) -> tuple:
        self.failures += 1
        self.close(slot)
        return (
            "",
            0.0,
            False,
            True,
            {
                "infra_error": f"{where}: {type(exc).__name__}: {exc}",
                "messages": [],
                "milestones": [],
                "tool_errors": 0,
            },
        )

    def reset(self, slot: int, seed: int) -> tuple[str, dict]:
        """`(observation, info)`; `info["infra_error"]` instead when the environment could not start."""
        try:
            if slot not in self.slots:
                self.slots[slot] = envs.make(self.env_id, **self.kwargs)
            return self.slots[slot].reset(seed=seed)
        except Exception as exc:
            return "", self._fail(slot, "reset", exc)[4]

    def step(self, slot: int, action: str) -> tuple:
        try:
            out = self.slots[slot].step(action)
        except Exception as exc:  # KeyError for an unknown slot included: reported, never raised
            return self._fail(slot, "step", exc)
        if out[4].get("infra_error"):
            self.failures += 1
            self.close(slot)
        return out

    def step_many(self, items: list[tuple[int, str]]) -> list[tuple]:
        """Step `(slot, action)` pairs concurrently; results in the same order."""
        return list(self.pool.map(lambda item: self.step(*item), items))

    def stats(self) -> dict:
        return {"slots": len(self.slots), "failures": self.failures}

    def close(self, slot: int | None = None) -> None:
        """Close one slot's environment (its sandbox and workspace), or all of them."""
        for s in [slot] if slot is not None else list(self.slots):
            env = self.slots.pop(s, None)
            if env is not None:
                try:
                    env.close()
                except Exception:
                    pass


EnvWorkerActor = ray.remote(EnvWorker)


class RemoteEnv:
    """One environment slot on an EnvWorker actor, behind the env's own reset/step/close, so the
    agent loop cannot tell it from an in-process environment."""

    def __init__(self, actor, slot: int):
        self.actor, self.slot = actor, slot

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        return ray.get(self.actor.reset.remote(self.slot, seed))

    def step(self, action: str):
        return ray.get(self.actor.step.remote(self.slot, action))

    def close(self) -> None:
        ray.get(self.actor.close.remote(self.slot))

"""How a run hosts its environment: which one, its arguments, and the EnvWorker actors that step it."""

from __future__ import annotations

from dataclasses import dataclass, field

from typed_yaml import bounded


@dataclass
class EnvConfig:
    id: str = "tools/calculator-v0"
    """Registered environment id (`namespace/name-vN`)."""
    kwargs: dict = field(default_factory=dict)
    """Keyword arguments for the environment constructor."""
    workers: int = bounded(0, ge=0)
    """EnvWorker actors hosting the environments (each steps many at once); 0 runs them inside the rollout workers."""
    cpus_per_worker: float = bounded(0.25, ge=0)
    """Ray CPUs reserved per EnvWorker actor (its sandboxed subprocesses are not counted by Ray)."""
    worker_concurrency: int = bounded(16, ge=1)
    """Calls one EnvWorker serves at once (threads)."""

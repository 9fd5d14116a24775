"""What the driver says when an actor is lost: `LearnerDied` (the learner holds the run's state,
so its death stops the run, naming the last checkpoint and the command that resumes from it) and
`WorkerLost` (a rollout worker Ray could not bring back). `learner_alive` turns a learner call's
`RayActorError` into `LearnerDied`; every driver-side call to the learner goes through it.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import ray

from rl.ray_utils import result


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
            f"the learner died during {during} ({type(exc).__name__}"
            f"{': killed for memory' if isinstance(exc, ray.exceptions.OutOfMemoryError) else ''}); "
            "the run stops here. Trajectories "
            f"and metrics written so far are kept in {run_dir} and {where}; continue with: "
            f"longhorizon train --resume {run_dir}"
        )


def latest_checkpoint(run_dir: Path) -> Path | None:
    ckpts = sorted((run_dir / "checkpoints").glob("version-*/trainer_state.pt"))
    return ckpts[-1].parent if ckpts else None


@contextmanager
def learner_alive(run_dir: Path, during: str):
    """Turns the learner actor's death into `LearnerDied` (the only actor the calls inside reach),
    also when Ray's memory monitor killed it (`OutOfMemoryError`: seen in make demo, where it came out
    as a raw traceback)."""
    try:
        yield
    except (ray.exceptions.RayActorError, ray.exceptions.OutOfMemoryError) as exc:
        raise LearnerDied(run_dir, latest_checkpoint(run_dir), during, exc) from None


def learner_get(run_dir: Path, refs, during: str):
    """The answer of a learner call (rank 0's), or `LearnerDied`."""
    with learner_alive(run_dir, during):
        return result(refs)

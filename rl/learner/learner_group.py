"""The learner as N Ray actors that train one model together (`learner.world_size`).

Each rank is a plain `Learner` in its own actor. Rank 0 reports an address on its node, every
rank joins one gloo process group there, and each wraps its model with FSDP2 and expert
parallelism (`Learner.join` → `policy/parallelize.py`). From then on every call the driver makes
(`train_step`, `publish`, `save_checkpoint`, ...) goes to all ranks at once, because each one runs
collectives that need every rank, and the answer is rank 0's.

With world_size 1 the group is one actor and no process group: exactly the single learner.

Not covered: placement. Ranks go wherever Ray has room for `ray.learner_cpus` and
`ray.learner_resources` each; a multi-node group needs the nodes to reach each other on the
chosen port, and its sharded checkpoints need a directory every rank can write (shared storage).
Each rank loads the full checkpoint once before sharding it (no meta-device initialisation).
"""

from __future__ import annotations

import ray

from rl.learner.learner import Learner
from rl.ray_utils import result

LearnerActor = ray.remote(Learner)


class _Call:
    def __init__(self, actors: list, name: str):
        self.actors, self.name = actors, name

    def remote(self, *args, **kwargs) -> list:
        """The call on every rank; the arguments go into the object store once, not once per rank."""
        if len(self.actors) > 1:
            args = tuple(ray.put(a) for a in args)
            kwargs = {k: ray.put(v) for k, v in kwargs.items()}
        return [getattr(a, self.name).remote(*args, **kwargs) for a in self.actors]


class LearnerGroup:
    """`world_size` Learner actors as one learner: `group.train_step.remote(batch)` returns one
    ref per rank (pass them to `result`), `group.call("logprobs", ids)` waits and returns rank 0's
    answer."""

    def __init__(
        self,
        world_size: int,
        options: dict,
        *args,
        expert_parallel: bool = True,
        backend: str = "gloo",
        **kwargs,
    ):
        self.actors = [
            LearnerActor.options(**options).remote(*args, **kwargs) for _ in range(world_size)
        ]
        if world_size > 1:
            master = ray.get(self.actors[0].address.remote())
            result(
                [
                    a.join.remote(
                        master, rank, world_size, expert_parallel=expert_parallel, backend=backend
                    )
                    for rank, a in enumerate(self.actors)
                ]
            )

    def __getattr__(self, name: str) -> _Call:
        if name.startswith("_"):
            raise AttributeError(name)
        return _Call(self.actors, name)

    def call(self, name: str, *args, **kwargs):
        return result(_Call(self.actors, name).remote(*args, **kwargs))

    def kill(self) -> None:
        for actor in self.actors:
            ray.kill(actor)

"""Rubrics: an episode's reward as a weighted sum of named parts, each a function of the recorded
episode, so the same code scores in rollouts and afterwards (`longhorizon replay --rescore`).

A reward part is any `fn(trajectory, **kwargs) -> float`. It reads what an episode recorded:
`trajectory.milestones` (the events the environment paid), `.turns` (each with `.text`,
`.failures`, `.tool_calls`), `.loss_mask` (1 on generated tokens), `.task`, `.stop_reason`,
`.failure` — the fields of rollout/trajectory.py's `Trajectory`, which lives above this layer, so
parts take it as a plain object. A `Rubric` is a list of parts with weights:

    reward = Σ_i weight_i · part_i(trajectory)

and every part's own value is kept (`Trajectory.reward_parts`, the `reward/NAME` metrics,
`inspect --episode`), so a run shows which part moved. Built-in parts (`PARTS`):

- `milestones`: what the environment paid (the default reward: a run without a `reward:` section
  is the rubric `[milestones × 1]`);
- `solved`: 1.0 if the episode reached the `solved` milestone, else 0.0 (terminal-only);
- `format`: the share of turns whose tool call was well formed (no malformed block, no unknown
  tool, not plain text where a call was due);
- `length`: minus the share of `budget` tokens the episode generated (a length penalty, -1 at or
  beyond the budget);

- `judge`: a judge model's score (rewards/judge.py; kwargs `criteria`, `mode`, `show`,
  `max_chars`), computed in the run's judge actor and handed to `score` as `judged`;

and any `module:function` the config names (an import path, like `--rescore` takes).

How the learner credits a rubric's reward under milestone credit: the milestone events at their
turns, and whatever of the episode's reward they do not account for at its last turn
(rl/learner/credit.py).

A judge part is the one part that cannot score itself: the rollout worker asks the judge actor
(rollout/judge_actor.py) without waiting, and the rubric is applied once the scores are there.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field

from rewards.judge import Judge
from rewards.milestones import milestone_sum, terminal_only

# Turn failure kinds (rollout/trajectory.py TURN_FAILURES) that say the tool call itself was badly formed.
FORMAT_FAILURES = ("no_tool_call", "malformed_call", "unknown_tool")


def well_formed(trajectory) -> float:
    """The share of turns with a well-formed tool call (1.0 for an episode with no turns)."""
    turns = trajectory.turns
    if not turns:
        return 1.0
    return sum(not any(f in FORMAT_FAILURES for f in t.failures) for t in turns) / len(turns)


def length(trajectory, budget: int = 1024) -> float:
    """Minus the share of `budget` generated tokens, floored at -1."""
    if budget < 1:
        raise ValueError(f"length: budget must be >= 1, got {budget}")
    return -min(1.0, sum(trajectory.loss_mask) / budget)


PARTS: dict[str, Callable] = {
    "milestones": milestone_sum,
    "solved": terminal_only,
    "format": well_formed,
    "length": length,
    "judge": Judge,
}


@dataclass(frozen=True)
class Part:
    name: str
    """Its metric and record name (`reward/NAME`)."""
    fn: Callable
    """fn(trajectory) -> float (keyword arguments already bound)."""
    weight: float = 1.0


@dataclass(frozen=True)
class Rubric:
    parts: tuple[Part, ...] = field(default_factory=tuple)

    def score(
        self, trajectory, judged: dict[str, float] | None = None
    ) -> tuple[float, dict[str, float]]:
        """(reward, each part's own value); `judged`: the judge parts' scores, by part name."""
        values = {}
        for p in self.parts:
            if isinstance(p.fn, Judge):
                if judged is None or p.name not in judged:
                    raise ValueError(f"judge part {p.name!r} has no score from the judge")
                v = float(judged[p.name])
            else:
                v = float(p.fn(trajectory))
            if v != v:  # NaN would poison every advantage of the group
                raise ValueError(
                    f"reward part {p.name!r} returned NaN for episode {getattr(trajectory, 'episode_id', '?')}"
                )
            values[p.name] = v
        return sum(p.weight * values[p.name] for p in self.parts), values

    @property
    def judges(self) -> tuple[Part, ...]:
        """The parts a judge model scores."""
        return tuple(p for p in self.parts if isinstance(p.fn, Judge))

    @property
    def is_default(self) -> bool:
        """Just the environment's milestones, unweighted: what a run without `reward:` trains on."""
        return (
            len(self.parts) == 1
            and self.parts[0].fn is milestone_sum
            and self.parts[0].weight == 1.0
        )


DEFAULT = Rubric((Part("milestones", milestone_sum, 1.0),))


def resolve(fn: str) -> Callable:
    """A built-in part by name, or `module:function`."""
    if fn in PARTS:
        return PARTS[fn]
    module, _, attr = fn.partition(":")
    if not module or not attr:
        raise ValueError(
            f"unknown reward part {fn!r}: one of {', '.join(PARTS)}, or module:function"
        )
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"reward part {fn!r} cannot be imported: {exc}") from None


def build(specs: list) -> Rubric:
    """A rubric from config entries `{fn, weight, name, kwargs}` (`fn` required; `name` defaults to
    `fn`'s; `weight` to 1.0). An empty list is the default rubric. Errors name the entry."""
    if not specs:
        return DEFAULT
    parts, names = [], set()
    for i, spec in enumerate(specs):
        where = f"reward.parts[{i}]"
        if not isinstance(spec, dict) or "fn" not in spec:
            raise ValueError(
                f"{where} must be a mapping with fn (and weight, name, kwargs), got {spec!r}"
            )
        unknown = set(spec) - {"fn", "weight", "name", "kwargs"}
        if unknown:
            raise ValueError(
                f"{where} has unknown key(s) {sorted(unknown)}: fn, weight, name, kwargs"
            )
        weight, kwargs = spec.get("weight", 1.0), spec.get("kwargs") or {}
        if isinstance(weight, bool) or not isinstance(weight, (int, float)):
            raise ValueError(f"{where}.weight must be a number, got {weight!r}")
        if not isinstance(kwargs, dict):
            raise ValueError(f"{where}.kwargs must be a mapping, got {kwargs!r}")
        try:
            fn = resolve(str(spec["fn"]))
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
        name = str(spec.get("name") or str(spec["fn"]).rpartition(":")[2])
        if name in names:
            raise ValueError(f"{where}: two parts named {name!r} (give one a name)")
        names.add(name)
        if fn is Judge:  # a judge is its kwargs, checked by the Judge itself
            try:
                parts.append(Part(name, Judge(**kwargs), float(weight)))
            except TypeError as exc:
                raise ValueError(
                    f"{where}: judge takes criteria, mode, show, max_chars: {exc}"
                ) from None
            except ValueError as exc:
                raise ValueError(f"{where}: {exc}") from None
            continue
        try:  # kwargs the function does not take fail here, not in every episode's scoring
            inspect.signature(fn).bind(None, **kwargs)
        except TypeError as exc:
            raise ValueError(f"{where}: {spec['fn']} does not take these kwargs: {exc}") from None
        except ValueError:  # no signature to read (a builtin): checked when it runs
            pass
        parts.append(Part(name, functools.partial(fn, **kwargs) if kwargs else fn, float(weight)))
    return Rubric(tuple(parts))

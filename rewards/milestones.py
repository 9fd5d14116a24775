"""Sparse milestone rewards: how an episode's milestone events are paid and turned into rewards.

An environment declares milestones (`reach("solved", 0.25)`): named steps towards its task, each
paid at most once per episode (`MilestoneLedger`), at the step where it happened. The events an
episode recorded, `[{"name", "reward", "turn", "token"}, ...]` (the agent loop adds the turn and
the token), are the whole reward signal; everything else here is a function of them:

- `step_reward(events)`: what a step pays, the sum of its events (Gymnasium's reward);
- `episode_reward(milestones, scheme, gamma)`: an episode's reward under a scheme —
  `sum` (what rollouts pay and the learner trains on), `terminal` (1.0 if it reached `solved`,
  else 0.0: the terminal-only baseline milestone rewards are compared against), `discounted`
  (each milestone discounted by `gamma` per turn it came after the first);
- `turn_rewards(milestones, turns)`: the rewards per turn that milestone credit assigns from
  (rl/learner/credit.py);
- `solved(milestones)`: whether the task was solved (evaluation's success rate, by default).

The environments pay through `MilestoneLedger` and `step_reward` while they run (envs/base.py; the
agent loop adds up the steps), and `longhorizon replay --rescore rewards.milestones:NAME` scores a
recorded trajectory afterwards through the same functions: `milestone_sum` (what the rollout paid),
`terminal_only` and `discounted` are `episode_reward` over its milestones. Not covered: rewards that are not
milestones (judges, learned reward models), which would score a trajectory the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

SOLVED = "solved"
Scheme = Literal["sum", "terminal", "discounted"]


@dataclass(frozen=True)
class Milestone:
    """A milestone an environment declares in code (`ToolEnv.milestones`), for people and tools
    (`envs show`, `envs check`, the viewer) to read without running an episode."""

    name: str
    """The name `reach` pays it under; `*` stands for a part that varies (`pass:*`, `waypoint_*`)."""
    reward: float | None
    """What it pays; None when that depends on the task (e.g. 1 / number of broken tests)."""
    description: str
    """When it is reached, in a sentence."""

    def matches(self, name: str) -> bool:
        from fnmatch import fnmatchcase

        return fnmatchcase(name, self.name)


class MilestoneLedger:
    """One episode's milestones: each name is paid once, the first time it is reached."""

    def __init__(self):
        self.hit: set[str] = set()

    def reach(self, name: str, reward: float, events: list[dict]) -> bool:
        """Append the event `{"name", "reward"}` to `events` unless `name` was paid already this
        episode; True when it was paid now."""
        if name in self.hit:
            return False
        self.hit.add(name)
        events.append({"name": name, "reward": float(reward)})
        return True


def step_reward(events: list[dict]) -> float:
    return float(sum(e["reward"] for e in events))


def solved(milestones: list[dict]) -> bool:
    return any(m["name"] == SOLVED for m in milestones)


def episode_reward(milestones: list[dict], scheme: Scheme = "sum", gamma: float = 1.0) -> float:
    """An episode's reward from the milestones it recorded, under `scheme` (see the module doc)."""
    if scheme == "sum":
        return step_reward(milestones)
    if scheme == "terminal":
        return 1.0 if solved(milestones) else 0.0
    if scheme == "discounted":
        if not 0 < gamma <= 1:
            raise ValueError(f"gamma must be in (0, 1], got {gamma}")
        return float(sum(m["reward"] * gamma ** m.get("turn", 0) for m in milestones))
    raise ValueError(f"unknown reward scheme {scheme!r}: sum, terminal or discounted")


def turn_rewards(milestones: list[dict], turns: int) -> list[float]:
    """Reward per turn: each milestone paid at the turn it was reached (events outside the
    episode's `turns` are dropped)."""
    r = [0.0] * turns
    for m in milestones:
        if 0 <= m["turn"] < turns:
            r[m["turn"]] += float(m["reward"])
    return r


# --- rescoring functions over a recorded trajectory (`longhorizon replay --rescore MODULE:NAME`) ---


def milestone_sum(trajectory) -> float:
    """What the environments paid during the rollout."""
    return episode_reward(trajectory.milestones, "sum")


def terminal_only(trajectory) -> float:
    return episode_reward(trajectory.milestones, "terminal")


def discounted(trajectory, gamma: float = 0.9) -> float:
    return episode_reward(trajectory.milestones, "discounted", gamma)

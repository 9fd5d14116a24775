"""Reward functions over a recorded trajectory's milestones, usable with
`longhorizon replay DIR --all --rescore rewards.milestones:NAME`.

- `milestone_sum`: the sum of milestone rewards (what the environments pay during rollouts);
- `terminal_only`: 1.0 when the episode reached a milestone named `solved`, else 0.0 — the
  terminal-only baseline that milestone rewards are compared against.
"""

from __future__ import annotations


def milestone_sum(trajectory) -> float:
    return float(sum(m["reward"] for m in trajectory.milestones))


def terminal_only(trajectory) -> float:
    return 1.0 if any(m["name"] == "solved" for m in trajectory.milestones) else 0.0

"""Milestone credit: rewards at the turns where milestones happened, and advantages per turn.

An episode's reward is the sum of its milestone rewards, each paid at a turn. With `episode`
credit every generated token of the episode gets one advantage from the episode total (GRPO as
usual). With `milestone` credit, the tokens of turn t get the discounted reward-to-go from t,

    G_t = Σ_{t' ≥ t} γ^{t'−t} r_{t'}          (r_t: milestone rewards reached on turn t)

minus a baseline from the *other* episodes of the group at the same turn index: a turn is
credited only with what happened from it onwards, so a milestone reached early does not reward
the turns after it, and one reached late rewards every turn that led to it.
When the reward is a rubric (rewards/rubric.py), what its milestones do not account for is paid at
the episode's last turn (`episode_turn_rewards`).

Baselines (per group, per turn index t, over the episodes that reached turn t):
- `loo` (leave-one-out, as RLOO): the mean of the others' G_t. The baseline does not depend on
  the episode's own actions, so the estimator is unbiased.
- `mean`: the mean including the episode itself (GRPO's). This scales the expected gradient by
  (1 − 1/n) for a group of n — a known, measured bias (tests/test_credit.py).
An episode alone at its turn index has no comparison and gets advantage 0 there. `scale="group"`
divides by the std of the group's G_t at that index (as GRPO does for episode rewards; it biases
the gradient's scale per group).
"""

from __future__ import annotations

import torch

from rewards.milestones import turn_rewards
from rollout.trajectory import Trajectory


def rewards_to_go(rewards: list[float], gamma: float = 1.0) -> list[float]:
    out, acc = [0.0] * len(rewards), 0.0
    for t in range(len(rewards) - 1, -1, -1):
        acc = rewards[t] + gamma * acc
        out[t] = acc
    return out


def turn_advantages(
    returns: list[list[float]], baseline: str = "loo", scale: str = "none", eps: float = 1e-4
) -> list[list[float]]:
    """Advantages per episode per turn for ONE group, from each episode's per-turn returns."""
    if baseline not in ("loo", "mean"):
        raise ValueError(f"unknown baseline {baseline!r}")
    adv = [[0.0] * len(r) for r in returns]
    depth = max((len(r) for r in returns), default=0)
    for t in range(depth):
        idx = [i for i, r in enumerate(returns) if len(r) > t]
        if len(idx) < 2:
            continue
        vals = torch.tensor([returns[i][t] for i in idx], dtype=torch.float64)
        n = len(idx)
        base = (vals.sum() - vals) / (n - 1) if baseline == "loo" else vals.mean().expand(n)
        a = vals - base
        if scale == "group":
            a = a / (vals.std(unbiased=True) + eps)
        for j, i in enumerate(idx):
            adv[i][t] = float(a[j])
    return adv


def episode_turn_rewards(t: Trajectory) -> list[float]:
    """Reward per turn: each milestone at the turn that reached it, and whatever of the episode's
    reward the milestones do not account for (a rubric's other parts, its weights) at the last turn.
    Without a rubric the reward is the milestones' sum and nothing is added."""
    r = turn_rewards(t.milestones, len(t.turns))
    if r:
        r[-1] += t.reward - sum(r)
    return r


def token_advantages(
    batch: list[Trajectory], *, gamma: float = 1.0, baseline: str = "loo", scale: str = "none"
) -> list[list[float]]:
    """Per-token advantages (aligned with each trajectory's token_ids) under milestone credit."""
    groups: dict[int, list[int]] = {}
    for i, t in enumerate(batch):
        groups.setdefault(t.group_id, []).append(i)
    out = [[0.0] * len(t.token_ids) for t in batch]
    for members in groups.values():
        rets = [rewards_to_go(episode_turn_rewards(batch[i]), gamma) for i in members]
        adv = turn_advantages(rets, baseline, scale)
        for i, a in zip(members, adv):
            for turn, value in zip(batch[i].turns, a):
                for p in range(turn.gen_start, turn.gen_end):
                    out[i][p] = value
    return out

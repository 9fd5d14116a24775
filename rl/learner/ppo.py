"""PPO's parts that GRPO does not have: a value head, GAE, the clipped value loss.

The policy loss is GRPO's (`rl.learner.grpo.policy_loss`, with the same clipping, importance weights and
aggregation); PPO replaces group-relative advantages with GAE over a learned value:

    δ_i = r_i + γ V_{i+1} − V_i          A_i = Σ_k (γλ)^k δ_{i+k}          R_i = A_i + V_i

over the episode's decision points, in order, the last one bootstrapping from 0:
- `level="token"`: every generated token is a decision point; observation tokens are not
  (the last token of turn t is followed by the first token of turn t+1);
- `level="turn"`: one decision point per turn, valued at its first generated token; the turn's
  advantage is given to all of its tokens.
Milestone rewards sit on the last generated token of the turn that reached them.

Value head: a linear layer on the policy's final hidden states (a shared trunk; no second model
in memory), trained with the clipped value loss ½·max((V − R)², (V_old + clip(V − V_old, ±ε_v) − R)²)
averaged over the decision points, weighted by `vf_coef` in the learner's loss.
"""

from __future__ import annotations

import torch

from rollout.trajectory import Trajectory


class ValueHead(torch.nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.proj = torch.nn.Linear(dim, 1)
        torch.nn.init.zeros_(self.proj.weight)
        torch.nn.init.zeros_(self.proj.bias)

    def forward(self, hidden_BTD: torch.Tensor) -> torch.Tensor:
        return self.proj(hidden_BTD.to(self.proj.weight.dtype)).squeeze(-1).float()


def gae(rewards: list[float], values: list[float], gamma: float = 1.0, lam: float = 0.95):
    """Advantages and returns over one episode's decision points (the last bootstraps from 0)."""
    adv, last = [0.0] * len(rewards), 0.0
    for i in range(len(rewards) - 1, -1, -1):
        nxt = values[i + 1] if i + 1 < len(values) else 0.0
        delta = rewards[i] + gamma * nxt - values[i]
        last = delta + gamma * lam * last
        adv[i] = last
    return adv, [a + v for a, v in zip(adv, values)]


def decision_points(traj: Trajectory, level: str) -> tuple[list[int], list[list[int]], list[float]]:
    """Token positions of the decision points, the tokens each one's advantage covers, and the
    reward at each point (milestones on their turn's last generated token)."""
    turn_reward = [0.0] * len(traj.turns)
    for m in traj.milestones:
        if 0 <= m["turn"] < len(turn_reward):
            turn_reward[m["turn"]] += float(m["reward"])
    points, covers, rewards = [], [], []
    for t, turn in enumerate(traj.turns):
        gen = [p for p in range(turn.gen_start, turn.gen_end) if traj.loss_mask[p]]
        if not gen:
            continue
        if level == "turn":
            points.append(gen[0])
            covers.append(gen)
            rewards.append(turn_reward[t])
        else:
            points += gen
            covers += [[p] for p in gen]
            rewards += [0.0] * (len(gen) - 1) + [turn_reward[t]]
    return points, covers, rewards


def episode_targets(
    traj: Trajectory, values_T: list[float], *, level: str, gamma: float, lam: float
):
    """Per-token advantages and (at decision points) returns for one episode from its old values.
    Returns (advantage per token, {position: return})."""
    points, covers, rewards = decision_points(traj, level)
    adv, ret = gae(rewards, [values_T[p] for p in points], gamma, lam)
    per_token = [0.0] * len(traj.token_ids)
    for a, cover in zip(adv, covers):
        for p in cover:
            per_token[p] = a
    return per_token, dict(zip(points, ret))


def value_loss(
    v_N: torch.Tensor, old_v_N: torch.Tensor, returns_N: torch.Tensor, clip: float
) -> torch.Tensor:
    """Clipped value loss, summed over decision points (the caller normalises)."""
    clipped = old_v_N + torch.clamp(v_N - old_v_N, -clip, clip)
    return 0.5 * torch.maximum((v_N - returns_N) ** 2, (clipped - returns_N) ** 2).sum()

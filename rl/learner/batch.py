"""What of a batch the learner trains on: the usable episodes (group statistics exclude infra
errors and stale episodes), the sequences it runs (`Row`: an episode, or one sample of an episode
stored as several, `Trajectory.sample_starts`), each token's policy version, right padding.

Statistics and advantages belong to episodes; forwards run over rows. `episode_values` puts what
the rows' forwards computed back in episode coordinates, and a row takes its slice of whatever was
computed per episode token (`Row.start`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from rollout.trajectory import Trajectory


@dataclass
class Row:
    """One sequence the learner runs: a whole episode, or one of a split episode's samples."""

    episode: int
    """Index of its episode in the batch."""
    start: int
    """Where its first token is in the episode's `token_ids`."""
    seq: Trajectory
    """The sequence itself, as a trajectory (the episode's own record when it is not split)."""


def sample_of(t: Trajectory, start: int, end: int) -> Trajectory:
    """The tokens [start, end) of `t` as a trajectory of their own: its turns, routed experts and
    milestones moved to the sample's positions (turn indices stay the episode's)."""
    if (start, end) == (0, len(t.token_ids)):
        return t
    turns = [
        dataclasses.replace(
            u, gen_start=u.gen_start - start, gen_end=u.gen_end - start, obs_end=u.obs_end - start
        )
        for u in t.turns
        if start <= u.gen_start < end
    ]
    first_gen = turns[0].gen_start if turns else end - start
    return dataclasses.replace(
        t,
        token_ids=t.token_ids[start:end],
        loss_mask=t.loss_mask[start:end],
        rollout_logprobs=t.rollout_logprobs[start:end],
        turns=turns,
        sample_starts=[],
        prompt_len=first_gen,
        routed_experts=None if t.routed_experts is None else t.routed_experts[start:end],
        milestones=[
            {**m, "token": m["token"] - start} for m in t.milestones if start < m["token"] <= end
        ],
    )


def training_rows(batch: list[Trajectory]) -> list[Row]:
    """Every episode's samples, in batch order (one row per episode that is not split)."""
    return [Row(i, s, sample_of(t, s, e)) for i, t in enumerate(batch) for s, e in t.sample_spans()]


def episode_values(rows: list[Row], batch: list[Trajectory], per_micro: dict) -> list[list[float]]:
    """Per episode, the values a forward computed per row (`per_micro`: micro-batch index tuple →
    rows × positions, aligned to next-token targets: column c is token c + 1), in episode
    coordinates (entry p - 1 is token p's; 0.0 for the first token of each sample, which no
    forward predicts)."""
    out = [[0.0] * max(len(t.token_ids) - 1, 0) for t in batch]
    for micro, values in per_micro.items():
        for r, i in enumerate(micro):
            row = rows[i]
            n = len(row.seq.token_ids) - 1
            vals = (
                values[r, :n].tolist() if isinstance(values, torch.Tensor) else list(values[r][:n])
            )
            out[row.episode][row.start : row.start + n] = vals
    return out


def pad(rows: list[list], value) -> list[list]:
    width = max(len(r) for r in rows)
    return [list(r) + [value] * (width - len(r)) for r in rows]


def token_versions(t: Trajectory) -> list[int]:
    """The policy version that generated each token (-1 for prompt and observation tokens)."""
    v = [-1] * len(t.token_ids)
    for turn in t.turns:
        v[turn.gen_start : turn.gen_end] = [turn.policy_version] * (turn.gen_end - turn.gen_start)
    return v


def usable_episodes(
    batch: list[Trajectory], min_version: int | None = None
) -> tuple[list[Trajectory], dict]:
    """Episodes that may enter group statistics: infrastructure failures are left out (they are
    not reward 0), so is an episode with a token older than `min_version` (the staleness bound;
    the driver's schedule should never let one through), and so is every group left with fewer
    than two episodes to compare."""
    too_old = [
        t
        for t in batch
        if min_version is not None
        and t.turns
        and min(turn.policy_version for turn in t.turns) < min_version
    ]
    ok = [t for t in batch if not t.infra_error and t.num_generated > 0 and t not in too_old]
    sizes: dict[int, int] = {}
    for t in ok:
        sizes[t.group_id] = sizes.get(t.group_id, 0) + 1
    kept = [t for t in ok if sizes[t.group_id] >= 2]
    groups = {t.group_id for t in batch}
    rewards: dict[int, set[float]] = {}
    for t in kept:
        rewards.setdefault(t.group_id, set()).add(t.reward)
    return kept, {
        "infra_errors_dropped": sum(1 for t in batch if t.infra_error),
        "stale_episodes_dropped": len(too_old),
        "groups_dropped": len(groups) - len({t.group_id for t in kept}),
        # a group whose episodes all earned the same reward has zero GRPO advantage: no signal
        "groups_with_signal": sum(len(r) > 1 for r in rewards.values()),
        "reward_spread": max((t.reward for t in kept), default=0.0)
        - min((t.reward for t in kept), default=0.0),
    }


def annotations(batch, rows: list[Row], plan, old, adv_of) -> dict:
    """Per episode, token-aligned like `token_ids`: the learner's log-prob of each generated token
    before the update and the advantage it was trained with (0.0 elsewhere: the head runs on
    generated tokens only), for the store's learner records and the token views."""
    logps = episode_values(rows, batch, old)
    advs = [[0.0] * len(t.token_ids) for t in batch]
    for micro in (m for mb in plan for m in mb):
        adv = adv_of(micro)
        for r, i in enumerate(micro):
            row, a = rows[i], adv[r]
            n = len(row.seq.token_ids)
            advs[row.episode][row.start : row.start + n] = (
                [float(a)] * n if a.dim() == 0 else [0.0] + a[: n - 1].tolist()
            )
    return {
        t.episode_id: {
            "learner_logprobs": [0.0] + logps[i],
            "advantages": [x if m else 0.0 for x, m in zip(advs[i], t.loss_mask)],
        }
        for i, t in enumerate(batch)
    }


def recorded_routing(
    mb: list[Trajectory], width: int, n_layers: int, k: int
) -> torch.Tensor | None:
    """The recorded expert ids of a micro-batch as L × B × T × k (-1 where a token has none), for
    rollout routing replay; None with nothing recorded. A record of another shape than the policy's
    (`n_layers` MoE layers, `k` experts a token) is refused, naming the episode and token."""
    if not any(t.routed_experts for t in mb):
        return None
    out = torch.full((n_layers, len(mb), width, k), -1, dtype=torch.long)
    for b, t in enumerate(mb):
        pos = [p for p, per_layer in enumerate(t.routed_experts or []) if per_layer]
        for p in pos:
            per_layer = t.routed_experts[p]
            if len(per_layer) != n_layers or any(len(ids) != k for ids in per_layer):
                raise ValueError(
                    f"episode {t.episode_id}: token {p} records {len(per_layer)} MoE layer(s) of "
                    f"{[len(ids) for ids in per_layer]} experts; the policy has {n_layers} × {k}"
                )
        if pos:  # one copy per episode: positions × layers × k → layers × positions × k
            out[:, b, pos] = torch.tensor([t.routed_experts[p] for p in pos]).transpose(0, 1)
    return out

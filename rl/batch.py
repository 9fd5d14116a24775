"""What of a batch the learner trains on: the usable episodes (group statistics exclude infra
errors and stale episodes), each token's policy version, right padding."""

from __future__ import annotations

from rollout.trajectory import Trajectory


def _pad(rows: list[list], value) -> list[list]:
    width = max(len(r) for r in rows)
    return [list(r) + [value] * (width - len(r)) for r in rows]


def token_versions(t: Trajectory) -> list[int]:
    """The policy version that generated each token (-1 for prompt and observation tokens)."""
    v = [-1] * len(t.token_ids)
    for turn in t.turns:
        v[turn.gen_start : turn.gen_end] = [turn.policy_version] * (turn.gen_end - turn.gen_start)
    return v


def usable_episodes(batch: list[Trajectory], min_version: int | None = None) -> tuple[list[Trajectory], dict]:
    """Episodes that may enter group statistics: infrastructure failures are left out (they are
    not reward 0), so is an episode with a token older than `min_version` (the staleness bound;
    the driver's schedule should never let one through), and so is every group left with fewer
    than two episodes to compare."""
    too_old = [t for t in batch if min_version is not None and t.turns
               and min(turn.policy_version for turn in t.turns) < min_version]
    ok = [t for t in batch if not t.infra_error and t.num_generated > 0 and t not in too_old]
    sizes: dict[int, int] = {}
    for t in ok:
        sizes[t.group_id] = sizes.get(t.group_id, 0) + 1
    kept = [t for t in ok if sizes[t.group_id] >= 2]
    groups = {t.group_id for t in batch}
    rewards: dict[int, set[float]] = {}
    for t in kept:
        rewards.setdefault(t.group_id, set()).add(t.reward)
    return kept, {"infra_errors_dropped": sum(1 for t in batch if t.infra_error),
                  "stale_episodes_dropped": len(too_old),
                  "groups_dropped": len(groups) - len({t.group_id for t in kept}),
                  # a group whose episodes all earned the same reward has zero GRPO advantage: no signal
                  "groups_with_signal": sum(len(r) > 1 for r in rewards.values()),
                  "reward_spread": max((t.reward for t in kept), default=0.0) - min((t.reward for t in kept), default=0.0)}

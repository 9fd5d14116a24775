"""What an iteration is made of: the episodes it asks for (`iteration_tasks`) and the metrics of
the ones that ended (`batch_metrics`, a row of metrics.jsonl before the learner's and the sync's)."""

from __future__ import annotations

from collections import Counter

from rollout.config import RolloutConfig
from rollout.trajectory import FAILURE_KINDS, EpisodeTask, Trajectory


def iteration_tasks(r: RolloutConfig, seed: int, iteration: int) -> list[EpisodeTask]:
    """The episodes of one iteration: `groups_per_iteration` tasks × `group_size` episodes, their
    environment seeds drawn from the run's `seed`."""
    tasks = []
    for g in range(r.groups_per_iteration):
        group_id = iteration * r.groups_per_iteration + g
        env_seed = (seed * 1_000_003 + group_id) & 0x7FFFFFFF
        for k in range(r.group_size):
            tasks.append(EpisodeTask(f"i{iteration}-g{g}-e{k}", group_id, env_seed, iteration))
    return tasks


def batch_metrics(trajs: list[Trajectory]) -> dict:
    n = max(1, len(trajs))
    reached = Counter(name for t in trajs for name in {m["name"] for m in t.milestones})
    out = {
        "episodes": len(trajs),
        "mean_reward": sum(t.reward for t in trajs) / n,
        "mean_turns": sum(len(t.turns) for t in trajs) / n,
        "generated_tokens": sum(t.num_generated for t in trajs),
        "episode_tokens_mean": sum(len(t.token_ids) for t in trajs) / n,
        "tool_errors": sum(turn.tool_errors for t in trajs for turn in t.turns),
        "infra_errors": sum(1 for t in trajs if t.infra_error),
        # agent programs whose history was rewritten: stored and trained as one sample per sequence
        "split_episodes": sum(1 for t in trajs if t.sample_starts),
        "stop_reasons": dict(Counter(t.stop_reason for t in trajs)),
    }
    out.update({f"milestone_rate/{k}": v / n for k, v in sorted(reached.items())})
    # a rubric's parts, each on its own (rewards/rubric.py)
    scored = [t for t in trajs if t.reward_parts]
    for name in dict.fromkeys(k for t in scored for k in t.reward_parts):
        out[f"reward/{name}"] = sum(t.reward_parts.get(name, 0.0) for t in scored) / max(
            1, len(scored)
        )
    # every kind, zeros included, so a curve exists from the first iteration on
    kinds = Counter(t.failure for t in trajs)
    out.update({f"failure/{k}": kinds.get(k, 0) / n for k in FAILURE_KINDS})
    return out

"""Evaluation on held-out seeds: success rate with a 95% interval, mean milestones, pass@k.

Held-out means never trained on: training draws environment seeds below 2^31
(`rl.loop.episodes.iteration_tasks` masks them to 31 bits); evaluation has two splits of its own,
`validation` (2^31 + i: what anything is tuned or watched on, the warm start's stopping rule and the
evaluations during RL) and `test` (2^31 + 2^30 + i: what is reported, looked at once at the end). Each of
`episodes / k` seeds is played `k` times (different sampling seeds); success is the environment's
own `succeeded(milestones, reward)` (by default: the milestone `solved` was reached). Episodes that
ended in an infrastructure error count neither way; they are reported.

The success interval is Wilson's score interval (well behaved at 0 and 1, unlike the normal
approximation). pass@k is the share of seeds with at least one success among their k episodes.

`evaluate` runs the episodes with any engine (vLLM, or a scripted policy in tests) in this process;
`evaluate_policy` first builds the engine a run's rollout settings name for a checkpoint (what
`longhorizon eval` and bench row 2 call), and the trainer runs the same tasks on its rollout workers
every `eval.every` iterations.
"""

from __future__ import annotations

import math
from collections import defaultdict

import envs
from rollout.agent_loop import play
from rollout.trajectory import EpisodeTask, Trajectory

HELD_OUT = 1 << 31
SPLITS = {"validation": HELD_OUT, "test": HELD_OUT + (1 << 30)}
"""The first seed of each held-out split."""


def wilson(successes: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion (95% for the default z)."""
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def eval_tasks(episodes: int, k: int = 1, split: str = "validation") -> list[EpisodeTask]:
    """`ceil(episodes / k)` held-out seeds of `split`, `k` episodes each (group id = the seed's index)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(SPLITS)}, not {split!r}")
    seeds, first = -(-episodes // k), SPLITS[split]
    name = "eval" if split == "validation" else split
    return [
        EpisodeTask(f"{name}-s{i}-k{j}", i, first + i, -1) for i in range(seeds) for j in range(k)
    ]


def summarise(env_id: str, trajs: list[Trajectory], k: int = 1) -> dict:
    ok = [t for t in trajs if not t.infra_error]
    wins = [envs.succeeded(env_id, t.milestones, t.reward) for t in ok]
    lo, hi = wilson(sum(wins), len(wins))
    out = {
        "env_id": env_id,
        "episodes": len(ok),
        "success": sum(wins) / len(wins) if wins else 0.0,
        "ci95": [lo, hi],
        "milestones_mean": sum(len({m["name"] for m in t.milestones}) for t in ok)
        / max(1, len(ok)),
        "reward_mean": sum(t.reward for t in ok) / max(1, len(ok)),
        "infra_errors": len(trajs) - len(ok),
        "k": k,
    }
    if k > 1:
        by_seed: dict[int, list[bool]] = defaultdict(list)
        for t, w in zip(ok, wins):
            by_seed[t.group_id].append(w)
        out[f"pass@{k}"] = sum(any(ws) for ws in by_seed.values()) / max(1, len(by_seed))
    return out


def evaluate(
    engine,
    chat,
    env_id: str,
    episodes: int,
    *,
    k: int = 1,
    env_kwargs: dict | None = None,
    seed: int = 0,
    split: str = "validation",
    **loop,
) -> tuple[dict, list[Trajectory]]:
    """Play the held-out episodes of `split` with `engine`; (summary, trajectories). `loop`: the agent
    loop's limits, sampling and context management (`RolloutConfig.loop()`, or any of its keywords)."""
    trajs = play(
        engine,
        chat,
        env_id,
        env_kwargs,
        eval_tasks(episodes, k, split),
        run_seed=seed,
        **{"max_turns": 4, "max_new_tokens": 48, "max_episode_tokens": 2048, **loop},
    )
    return summarise(env_id, trajs, k), trajs


def evaluate_policy(
    policy: str,
    rollout,
    env_id: str,
    episodes: int,
    *,
    k: int = 1,
    env_kwargs: dict | None = None,
    temperature: float | None = None,
    seed: int = 0,
    split: str = "validation",
) -> tuple[dict, list[Trajectory]]:
    """`evaluate` on a fresh engine of checkpoint `policy`, built and played with the `rollout`
    settings (a `RolloutConfig`); `temperature` None: the rollout's."""
    from transformers import AutoTokenizer

    from rollout.chat import ChatFormat
    from rollout.engines import make_engine

    r = rollout
    engine = make_engine(
        r.engine,
        policy,
        seed=seed,
        max_model_len=r.max_model_len,
        kv_cache_gib=r.kv_cache_gib,
        enforce_eager=r.enforce_eager,
        max_batch=r.max_batch,
        dtype=r.engine_dtype(),
    )
    chat = ChatFormat(AutoTokenizer.from_pretrained(policy))
    return evaluate(
        engine,
        chat,
        env_id,
        episodes,
        k=k,
        env_kwargs=env_kwargs,
        seed=seed,
        split=split,
        **r.loop(**({} if temperature is None else {"temperature": temperature})),
    )

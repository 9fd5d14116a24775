"""Replay: re-run an episode's recorded actions in a fresh environment and check what it returns.

The environment is made from the episode's env id with the run's `env.kwargs` and reset with the
recorded seed; the first observation must equal the recorded task, and each recorded turn's text
is stepped in order. Every observation, milestone and the total reward must match the record;
the first difference is reported (turn, what, recorded vs replayed). Episodes that ended in an
infrastructure error are replayed up to the failing turn; one that failed before its first turn
completed (at reset, or in its first step) has nothing to check and is reported as not replayed.

An episode the agent loop ran under `window` or `compact` context management (rollout/context.py)
is replayed through the loop itself, with the run's rollout settings and tokenizer: an engine
answers each call with the turn recorded for it once the context it is given is exactly the
recorded one, so every context segment, the summaries' place and every kept turn are rebuilt and
compared token for token with the stored ids (the first departure is named, with its segment).

An agent program's episode (envs/agent_program.py) is replayed by running the program again against
an endpoint whose engine answers each call with the completion recorded for it (rollout/recorded.py):
each call's prompt ids must be the recorded ones, the program must make as many calls, and its
milestones and reward must match. This needs the run's tokenizer (`tokenizer=`).

`rescore(trajectories, SPEC)` recomputes rewards and reports old against new, each rubric part on
its own, without touching the store. SPEC is a rubric (rewards/rubric.py): a YAML file holding one
(a list of parts, or `parts: [...]`), `run` for the run's own `reward:` section (which reproduces
what was stored), a built-in part (`format`) or any `module:function`. Judge parts are scored by
the run's judge model (its `reward.judge` section) through the run's score cache
(`judge_cache.jsonl`): what the run judged comes back from the cache, exactly and without starting a
judge engine; only what it never asked (another rubric, other episodes) starts one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import envs
from rollout.trajectory import Trajectory


@dataclass
class ReplayResult:
    episode_id: str
    ok: bool
    turns_checked: int
    divergence: str = ""
    not_replayed: str = ""
    """Why nothing could be checked (an episode that never ran), else empty."""

    def to_dict(self) -> dict:
        return dict(vars(self))


def _short(x, n: int = 200) -> str:
    s = repr(x)
    return s if len(s) <= n else s[:n] + "…"


def replay_episode(
    traj: Trajectory,
    env_kwargs: dict | None = None,
    make_env: Callable | None = None,
    tokenizer=None,
    rollout=None,
) -> ReplayResult:
    """`rollout`: the run's `RolloutConfig` (with `tokenizer`, what a context-managed episode needs)."""
    if make_env is None and envs.is_agent_program(envs.env_class(traj.env_id)):
        return replay_agent(traj, env_kwargs, tokenizer)
    if traj.infra_error and len(traj.turns) <= 1:  # the failing turn has no record: nothing to step
        return ReplayResult(
            traj.episode_id, True, 0, not_replayed=f"it never ran: {traj.infra_error}"
        )
    if segmented(traj) and not traj.infra_error:
        if tokenizer is None or rollout is None:
            raise ValueError(
                f"replaying {traj.episode_id} (context {traj.context}, {len(traj.sample_starts)} segments) "
                "needs the run's tokenizer and rollout settings"
            )
        make = make_env or (lambda: envs.make(traj.env_id, **(env_kwargs or {})))
        return replay_segments(traj, lambda: as_recorded(make(), traj), tokenizer, rollout)
    env = make_env() if make_env is not None else envs.make(traj.env_id, **(env_kwargs or {}))
    try:
        return _replay(env, traj)
    finally:
        env.close()  # a sandboxed environment's workspace goes with it


ARGUMENTS_CHECKED = 6
"""The store schema from which tool calls' arguments were checked against their schemas before the
tool ran (envs/base.py `check_arguments`): an older record is replayed without the check, as it ran."""


def as_recorded(env, traj: Trajectory):
    """`env` behaving as environments did when `traj` was written."""
    if 0 < traj.stored_schema < ARGUMENTS_CHECKED and hasattr(env, "check_arguments"):
        env.check_arguments = False
    return env


def _replay(env, traj: Trajectory) -> ReplayResult:
    fail = lambda turn, what, rec, got: ReplayResult(  # noqa: E731
        traj.episode_id,
        False,
        turn,
        f"turn {turn}: {what} differs: recorded {_short(rec)}, replayed {_short(got)}",
    )
    env = as_recorded(env, traj)
    obs, _ = env.reset(seed=traj.seed)
    if traj.task and obs != traj.task:
        return fail(0, "task", traj.task, obs)
    recorded = {}
    for m in traj.milestones:
        recorded.setdefault(m["turn"], []).append((m["name"], m["reward"]))
    total = 0.0
    # the failing turn has no record
    last = len(traj.turns) - (1 if traj.infra_error and traj.turns else 0)
    for i, turn in enumerate(traj.turns[:last]):
        obs, reward, _, _, info = env.step(turn.text)
        total += reward
        if obs != turn.observation:
            return fail(i, "observation", turn.observation, obs)
        got = [(m["name"], m["reward"]) for m in info.get("milestones", [])]
        if got != recorded.get(i, []):
            return fail(i, "milestones", recorded.get(i, []), got)
    if not traj.infra_error and abs(total - traj.reward) > 1e-9:
        return fail(last, "total reward", traj.reward, total)
    return ReplayResult(traj.episode_id, True, last)


def segmented(traj: Trajectory) -> bool:
    """Whether the agent loop rebuilt the episode's context (several context segments)."""
    return bool(traj.sample_starts) and traj.context in ("window", "compact")


def replay_segments(traj: Trajectory, make_env: Callable, tokenizer, rollout) -> ReplayResult:
    """The agent loop run again over the recorded turns (see the module doc)."""
    from rollout.agent_loop import run_episodes
    from rollout.chat import ChatFormat
    from rollout.engines.base import Generation
    from rollout.recorded import RecordedEngine
    from rollout.trajectory import EpisodeTask, first_difference

    calls = []
    # what the engine was given and what it answered: the turn's sampled ids
    for turn in traj.turns:
        start = max(s for s, _ in traj.sample_spans() if s <= turn.gen_start)
        ids = [
            x
            for x, m in zip(
                traj.token_ids[turn.gen_start : turn.gen_end],
                traj.loss_mask[turn.gen_start : turn.gen_end],
            )
            if m
        ]
        calls.append(
            (
                list(traj.token_ids[start : turn.gen_start]),
                Generation(
                    ids,
                    [
                        lp
                        for lp, m in zip(
                            traj.rollout_logprobs[turn.gen_start : turn.gen_end],
                            traj.loss_mask[turn.gen_start : turn.gen_end],
                        )
                        if m
                    ],
                    turn.finish_reason,
                ),
            )
        )
    engine = RecordedEngine(calls, tokenizer.decode)
    loop = rollout.loop(max_episode_tokens=rollout.episode_tokens_at(traj.iteration))
    task = EpisodeTask(traj.episode_id, traj.group_id, traj.seed, traj.iteration)
    try:
        (again,) = run_episodes(
            engine, ChatFormat(tokenizer), make_env, traj.env_id, [task], **loop
        )
    except Exception as exc:
        if engine.departure:
            n = engine.answered
            segment = (
                sum(s <= traj.turns[n].gen_start for s in traj.sample_starts)
                if n < len(traj.turns)
                else "-"
            )
            return ReplayResult(
                traj.episode_id, False, n, f"turn {n} (segment {segment}): {engine.departure}"
            )
        return ReplayResult(
            traj.episode_id,
            False,
            engine.answered,
            f"the loop failed on replay: {type(exc).__name__}: {exc}",
        )
    at = first_difference(traj.token_ids, again.token_ids)
    if at is not None:
        segment = sum(s <= at for s in traj.sample_starts) or 1
        turn = next((i for i, u in enumerate(traj.turns) if at < u.obs_end), len(traj.turns))
        return ReplayResult(
            traj.episode_id,
            False,
            turn,
            f"token {at} (segment {segment}, turn {turn}) differs: recorded "
            f"{tokenizer.decode(traj.token_ids[at : at + 12])!r}, replayed {tokenizer.decode(again.token_ids[at : at + 12])!r}",
        )
    rec, got = ([(m["name"], m["reward"], m["turn"]) for m in t.milestones] for t in (traj, again))
    for what, a, b in (
        ("segment starts", traj.sample_starts, again.sample_starts),
        ("loss mask", traj.loss_mask, again.loss_mask),
        ("milestones", rec, got),
        ("stop reason", traj.stop_reason, again.stop_reason),
    ):
        if a != b:
            return ReplayResult(
                traj.episode_id,
                False,
                len(traj.turns),
                f"{what} differ: recorded {_short(a)}, replayed {_short(b)}",
            )
    if abs(traj.reward - again.reward) > 1e-9 and not traj.reward_parts:
        return ReplayResult(
            traj.episode_id,
            False,
            len(traj.turns),
            f"total reward differs: recorded {traj.reward!r}, replayed {again.reward!r}",
        )
    return ReplayResult(traj.episode_id, True, len(traj.turns))


def replay_agent(traj: Trajectory, env_kwargs: dict | None, tokenizer) -> ReplayResult:
    """The agent program run again on the recorded completions (see the module doc)."""
    from rollout.chat import ChatFormat
    from rollout.openai_api import OpenAIServer
    from rollout.program_episodes import run_agent_episodes
    from rollout.recorded import RecordedEngine, recorded_calls
    from rollout.trajectory import EpisodeTask

    if not traj.turns:
        return ReplayResult(
            traj.episode_id, True, 0, not_replayed=f"it made no call: {traj.infra_error}"
        )
    if tokenizer is None:
        raise ValueError(f"replaying {traj.env_id} (an agent program) needs the run's tokenizer")
    fail = lambda n, why: ReplayResult(traj.episode_id, False, n, why)  # noqa: E731
    engine = RecordedEngine(recorded_calls(traj), tokenizer.decode)
    server = OpenAIServer(engine, tokenizer, "replay", max_model_len=1 << 30)
    server.start()
    try:
        task = EpisodeTask(traj.episode_id, traj.group_id, traj.seed, traj.iteration)
        again = run_agent_episodes(
            server, traj.env_id, env_kwargs or {}, [task], ChatFormat(tokenizer), "replay"
        )[0]
    finally:
        server.stop()
    n, calls = engine.answered, len(traj.turns)
    if engine.departure:
        return fail(n, engine.departure)
    if traj.infra_error:  # replayed as far as the record goes
        return ReplayResult(traj.episode_id, True, n)
    if again.infra_error:
        return fail(n, f"the agent program failed on replay: {again.infra_error}")
    if n != calls:
        return fail(n, f"calls differ: recorded {calls}, replayed {n}")
    if traj.task and again.task != traj.task:
        return fail(0, f"task differs: recorded {_short(traj.task)}, replayed {_short(again.task)}")
    rec, got = ([(m["name"], m["reward"]) for m in t.milestones] for t in (traj, again))
    if rec != got:
        return fail(n, f"milestones differ: recorded {_short(rec)}, replayed {_short(got)}")
    if abs(again.reward - traj.reward) > 1e-9 and not traj.reward_parts:
        return fail(n, f"total reward differs: recorded {traj.reward!r}, replayed {again.reward!r}")
    return ReplayResult(traj.episode_id, True, n)


def rubric_of(spec: str, run_dir: str | Path | None = None):
    """The rubric `--rescore SPEC` names (see the module doc)."""
    from rewards.rubric import build

    if spec == "run":
        if run_dir is None:
            raise ValueError("--rescore run needs the run directory")
        from rl.config import load_config

        return build(load_config(Path(run_dir) / "config.yaml").reward.parts)
    path = Path(spec)
    if path.suffix in (".yaml", ".yml", ".json") or path.is_file():
        import yaml

        from typed_yaml import load_yaml

        try:
            raw = load_yaml(path.read_text())
        except yaml.YAMLError as exc:
            raise ValueError(f"{path}: not YAML: {' '.join(str(exc).split())}") from None
        parts = raw.get("parts") if isinstance(raw, dict) else raw
        if not isinstance(parts, list) or not parts:
            raise ValueError(
                f"{path}: a rubric is a list of parts (or `parts: [...]`), each {{fn, weight, name, kwargs}}"
            )
        return build(parts)
    return build([{"fn": spec}])


def judge_scores(rubric, trajectories, run_dir: str | Path | None) -> tuple[dict, dict]:
    """Each episode's judge part scores ({episode id: {part: score}}) and the judge's counts: by the
    run's judge model, through the run's cache (see the module doc)."""
    from rl.config import RunConfig, load_config
    from rollout.judge_actor import JudgeScorer, judge_requests, ran, ranked_groups

    config = Path(run_dir or ".") / "config.yaml"
    cfg = load_config(config) if config.is_file() else RunConfig()
    cache = Path(run_dir) / "judge_cache.jsonl" if run_dir else None
    j = cfg.reward.judge
    scorer = JudgeScorer(
        cfg.reward.judge_path(),
        cache,
        name=j.model,
        seed=cfg.seed,
        max_model_len=j.max_model_len,
        kv_cache_gib=j.kv_cache_gib,
    )
    alone = [p for p in rubric.judges if p.fn.mode != "rank"]
    trajectories = [t for t in trajectories if ran(t)]
    scores = iter(
        scorer.score([r for t in trajectories for r in judge_requests(rubric, t, cfg.env.kwargs)])
    )
    out = {t.episode_id: {p.name: next(scores) for p in alone} for t in trajectories}
    # rank parts: each group of the episodes given, as the run asked (the whole group only with --all)
    groups = ranked_groups(trajectories)
    for p in [p for p in rubric.judges if p.fn.mode == "rank"]:
        scores = iter(scorer.score([p.fn.group_request(g) for g in groups]))
        for g in groups:
            for t in g:
                out[t.episode_id][p.name] = next(scores)
    return out, {k: scorer.stats[k] for k in ("requests", "cache_hits")}


def rescore(
    trajectories, spec: str, run_dir: str | Path | None = None, stats: dict | None = None
) -> list[dict]:
    """Each episode's recorded and rescored reward and parts; `stats` (if given) gets the judge's
    request and cache-hit counts."""
    from rollout.judge_actor import ran

    rubric = rubric_of(spec, run_dir)
    judged, counts = judge_scores(rubric, trajectories, run_dir) if rubric.judges else ({}, {})
    if stats is not None:
        stats.update(counts)
    out = []
    for t in trajectories:
        if not ran(t):  # an environment's failure: nothing to score (the run did not either)
            out.append(
                {
                    "episode_id": t.episode_id,
                    "recorded": t.reward,
                    "rescored": None,
                    "parts": {},
                    "recorded_parts": t.reward_parts,
                    "not_scored": t.infra_error,
                }
            )
            continue
        total, parts = rubric.score(t, judged.get(t.episode_id))
        out.append(
            {
                "episode_id": t.episode_id,
                "recorded": t.reward,
                "rescored": total,
                "parts": parts,
                "recorded_parts": t.reward_parts,
            }
        )
    return out


def run_env_kwargs(run_dir: str | Path) -> dict:
    """`env.kwargs` of the config the run was made with (loaded and checked like any config)."""
    from rl.config import load_config

    return load_config(Path(run_dir) / "config.yaml").env.kwargs


def run_rollout(run_dir: str | Path):
    """The `rollout` section of the config the run was made with."""
    from rl.config import load_config

    return load_config(Path(run_dir) / "config.yaml").rollout


def agent_tokenizer(run_dir: str | Path, trajectories) -> object | None:
    """The run's tokenizer when one of `trajectories` is an agent program's (its calls are rendered
    again on replay) or has several context segments (they are rebuilt), else None (nothing loaded)."""
    if not any(
        envs.is_agent_program(envs.env_class(t.env_id)) or segmented(t) for t in trajectories
    ):
        return None
    from transformers import AutoTokenizer

    from longhorizon.serve import policy_of

    return AutoTokenizer.from_pretrained(policy_of(str(run_dir))[0])

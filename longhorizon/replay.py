"""Replay: re-run an episode's recorded actions in a fresh environment and check what it returns.

The environment is made from the episode's env id with the run's `env.kwargs` and reset with the
recorded seed; the first observation must equal the recorded task, and each recorded turn's text
is stepped in order. Every observation, milestone and the total reward must match the record;
the first difference is reported (turn, what, recorded vs replayed). Episodes that ended in an
infrastructure error are replayed up to the failing turn; one that failed before its first turn
completed (at reset, or in its first step) has nothing to check and is reported as not replayed.

`rescore(trajectories, SPEC)` recomputes rewards and reports old against new, each rubric part on
its own, without touching the store. SPEC is a rubric (rewards/rubric.py): a YAML file holding one
(a list of parts, or `parts: [...]`), `run` for the run's own `reward:` section (which reproduces
what was stored), a built-in part (`format`) or any `module:function`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

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


def replay_episode(traj: Trajectory, env_kwargs: dict | None = None, make_env: Callable | None = None) -> ReplayResult:
    if traj.infra_error and len(traj.turns) <= 1:  # the failing turn has no record: nothing to step
        return ReplayResult(traj.episode_id, True, 0, not_replayed=f"it never ran: {traj.infra_error}")
    env = make_env() if make_env is not None else envs.make(traj.env_id, **(env_kwargs or {}))
    try:
        return _replay(env, traj)
    finally:
        env.close()  # a sandboxed environment's workspace goes with it


def _replay(env, traj: Trajectory) -> ReplayResult:
    fail = lambda turn, what, rec, got: ReplayResult(  # noqa: E731
        traj.episode_id, False, turn, f"turn {turn}: {what} differs: recorded {_short(rec)}, replayed {_short(got)}")
    obs, _ = env.reset(seed=traj.seed)
    if traj.task and obs != traj.task:
        return fail(0, "task", traj.task, obs)
    recorded = {}
    for m in traj.milestones:
        recorded.setdefault(m["turn"], []).append((m["name"], m["reward"]))
    total = 0.0
    last = len(traj.turns) - (1 if traj.infra_error and traj.turns else 0)  # the failing turn has no record
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

        try:
            raw = yaml.safe_load(path.read_text())
        except yaml.YAMLError as exc:
            raise ValueError(f"{path}: not YAML: {' '.join(str(exc).split())}") from None
        parts = raw.get("parts") if isinstance(raw, dict) else raw
        if not isinstance(parts, list) or not parts:
            raise ValueError(f"{path}: a rubric is a list of parts (or `parts: [...]`), each {{fn, weight, name, kwargs}}")
        return build(parts)
    return build([{"fn": spec}])


def rescore(trajectories, spec: str, run_dir: str | Path | None = None) -> list[dict]:
    rubric = rubric_of(spec, run_dir)
    out = []
    for t in trajectories:
        total, parts = rubric.score(t)
        out.append({"episode_id": t.episode_id, "recorded": t.reward, "rescored": total, "parts": parts,
                    "recorded_parts": t.reward_parts})
    return out


def run_env_kwargs(run_dir: str | Path) -> dict:
    """`env.kwargs` of the config the run was made with (loaded and checked like any config)."""
    from rl.config import load_config

    return load_config(Path(run_dir) / "config.yaml").env.kwargs

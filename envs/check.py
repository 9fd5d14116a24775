"""`check_env(env)`: does an environment keep the contract the agent loop and the learner rely on?

Like Gymnasium's `check_env`, but for tool environments: every problem found is reported at once,
each message saying what to fix. `EnvCheckError` carries the list.
"""

from __future__ import annotations

import json
import math

from envs.base import StepInfo, ToolEnv, ToolSpec
from rewards.milestones import Milestone


class EnvCheckError(AssertionError):
    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("environment check failed:\n" + "\n".join(f"- {p}" for p in problems))


def _check_step_output(out, where: str, problems: list[str]) -> dict | None:
    if not (isinstance(out, tuple) and len(out) == 5):
        problems.append(
            f"{where}: step() must return (observation, reward, terminated, truncated, info), got {type(out).__name__}"
        )
        return None
    obs, reward, terminated, truncated, info = out
    if not isinstance(obs, str):
        problems.append(f"{where}: the observation must be str, got {type(obs).__name__}")
    if (
        not isinstance(reward, (int, float))
        or isinstance(reward, bool)
        or not math.isfinite(reward)
    ):
        problems.append(f"{where}: reward must be a finite number, got {reward!r}")
    if not isinstance(terminated, bool) or not isinstance(truncated, bool):
        problems.append(
            f"{where}: terminated and truncated must be bools (keep them apart, as Gymnasium does)"
        )
    if not isinstance(info, dict):
        problems.append(f"{where}: info must be a dict")
        return None
    missing = sorted(StepInfo.__required_keys__ - set(info))
    if missing:  # the typed contract with the agent loop (envs.StepInfo)
        problems.append(
            f"{where}: info lacks {', '.join(missing)} (envs.StepInfo says what each is)"
        )
    msgs = info.get("messages")
    if not isinstance(msgs, list) or not all(
        isinstance(m, dict) and {"role", "content"} <= set(m) for m in msgs
    ):
        problems.append(
            f'{where}: info["messages"] must be a list of {{"role", "content"}} chat messages'
        )
    ms = info.get("milestones")
    if not isinstance(ms, list) or not all(
        isinstance(m, dict)
        and isinstance(m.get("name"), str)
        and isinstance(m.get("reward"), (int, float))
        for m in ms
    ):
        problems.append(
            f'{where}: info["milestones"] must be a list of {{"name": str, "reward": float}}'
        )
    elif isinstance(reward, (int, float)) and abs(sum(m["reward"] for m in ms) - reward) > 1e-9:
        problems.append(
            f"{where}: the step's reward {reward} is not the sum of its milestones' rewards "
            "(rewards are paid only at milestones)"
        )
    if not isinstance(info.get("tool_errors", 0), int):
        problems.append(f'{where}: info["tool_errors"] must be an int')
    return info


def check_env(env, *, seed: int = 0, expert: bool = True) -> dict:
    """Check `env`; returns a report (`tools`, `expert_reward`, `expert_milestones`) or raises
    `EnvCheckError` naming every problem."""
    problems: list[str] = []
    report: dict = {"tools": [], "expert_reward": None, "expert_milestones": []}
    if not isinstance(env, ToolEnv):
        raise EnvCheckError(
            [f"{type(env).__name__} must subclass envs.ToolEnv (a gymnasium.Env of tool turns)"]
        )
    names = [t.name for t in env.tools]
    if not env.tools and getattr(env, "max_turns", None) != 1:  # a one-turn reply task needs none
        problems.append(
            "the environment declares no tools: set the class attribute `tools` to a list of ToolSpec "
            "(only a single-turn environment, max_turns = 1, may have none)"
        )
    if len(set(names)) != len(names):
        problems.append(f"tool names must be unique: {names}")
    for t in env.tools:
        if not isinstance(t, ToolSpec):
            problems.append(f"tools must be ToolSpec instances, got {t!r}")
            continue
        if t.parameters.get("type") != "object":
            problems.append(
                f'tool {t.name!r}: parameters must be a JSON schema with "type": "object"'
            )
        try:
            json.dumps(t.to_openai())
        except TypeError as exc:
            problems.append(f"tool {t.name!r}: its spec is not JSON-serialisable ({exc})")
    functions = env.tool_functions() if hasattr(env, "tool_functions") else {}
    missing = [n for n in names if n not in functions]
    if missing:
        problems.append(f"tools without a function in tool_functions(): {missing}")
    report["tools"] = names

    try:
        obs, info = env.reset(seed=seed)
        obs2, _ = env.reset(seed=seed)
    except Exception as exc:
        raise EnvCheckError(
            problems + [f"reset(seed={seed}) raised {type(exc).__name__}: {exc}"]
        ) from exc
    if not isinstance(obs, str) or not obs:
        problems.append("reset() must return a non-empty task text as the observation")
    if not isinstance(info, dict) or "tools" not in info:
        problems.append(
            'reset() info must hold "tools" (the OpenAI-format specs the chat template renders)'
        )
    if obs != obs2:
        problems.append(
            "reset() with the same seed gave different tasks: the environment must be deterministic given a seed"
        )

    try:
        out = env.step('<tool_call>{"name": oops</tool_call>')
    except Exception as exc:
        problems.append(
            f"step() with a malformed tool call raised {type(exc).__name__}: {exc}; "
            "it must return an error observation instead"
        )
    else:
        info = _check_step_output(out, "malformed call", problems)
        if info is not None and info.get("tool_errors", 0) < 1:
            problems.append('a malformed tool call must be counted in info["tool_errors"]')

    declared = getattr(env, "milestones", ())
    if not declared:
        problems.append(
            "the environment declares no milestones: set the class attribute `milestones` to the "
            "Milestone(name, reward, description) entries that `reach` pays (envs show lists them)"
        )
    elif not all(isinstance(m, Milestone) for m in declared):
        problems.append("`milestones` must be a tuple of envs.Milestone(name, reward, description)")
    report["milestones"] = [m.name for m in declared if isinstance(m, Milestone)]
    if expert and not hasattr(env, "expert_turns"):
        problems.append(
            "no scripted expert: define expert_turns(), the turns that solve the task just reset "
            "(the warm start, this check and the tests play it); `envs check --no-expert` skips this"
        )
    if expert and hasattr(env, "expert_turns"):
        env.reset(seed=seed)
        total, reached, terminated = 0.0, [], False
        for i, turn in enumerate(env.expert_turns()):
            try:
                out = env.step(turn)
            except Exception as exc:
                problems.append(f"expert turn {i} raised {type(exc).__name__}: {exc}")
                break
            info = _check_step_output(out, f"expert turn {i}", problems)
            total += float(out[1]) if isinstance(out, tuple) and len(out) == 5 else 0.0
            reached += [m["name"] for m in (info or {}).get("milestones", [])]
            terminated = isinstance(out, tuple) and len(out) == 5 and bool(out[2])
            if isinstance(out, tuple) and len(out) == 5 and (out[2] or out[3]):
                break
        if not terminated:
            problems.append(
                "the expert's episode did not terminate: its last turn should finish the task"
            )
        if total <= 0:
            problems.append("the expert earned no reward: its turns should reach the milestones")
        undeclared = [m for m in reached if declared and not any(d.matches(m) for d in declared)]
        if undeclared:
            problems.append(
                f"the expert reached milestones the environment does not declare: {undeclared}; add them "
                f"to its `milestones` (declared: {', '.join(d.name for d in declared)})"
            )
        report["expert_reward"], report["expert_milestones"] = total, reached
    if hasattr(env, "close"):
        env.close()
    if problems:
        raise EnvCheckError(problems)
    return report

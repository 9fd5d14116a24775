"""Environments: the tool-use `Env` API, a registry of versioned ids, and built-in environments.

`register(id, entry_point="module:Class", **defaults)` and `make(id, **kwargs)` work like
Gymnasium's. Third-party packages announce environments through the `longhorizon.envs`
entry-point group (name = env id, value = "module:Class"); they are imported only when made.
"""

from __future__ import annotations

import importlib
import inspect
import re
from dataclasses import dataclass, field
from importlib.metadata import entry_points

import gymnasium as gym

from envs.agent_program import AgentResult, AgentTask, is_agent_program
from envs.base import ResetInfo, StepInfo, ToolEnv, ToolFailure, ToolSpec
from rewards.milestones import Milestone

_ID = re.compile(r"^[a-z0-9_\-]+/[A-Za-z0-9_\-]+-v\d+$")


@dataclass
class EnvSpec:
    id: str
    entry_point: str
    kwargs: dict = field(default_factory=dict)


_REGISTRY: dict[str, EnvSpec] = {}


def register(env_id: str, entry_point: str, **kwargs) -> None:
    """Register `env_id` here and in Gymnasium's registry (so `gymnasium.make(env_id)` works too; an
    agent program, envs/agent_program.py, is registered there as well but is no Gymnasium environment)."""
    if not _ID.match(env_id):
        raise ValueError(f"env id {env_id!r} must look like 'namespace/name-v0'")
    _REGISTRY[env_id] = EnvSpec(env_id, entry_point, kwargs)
    if env_id not in gym.registry:
        # no step limit of Gymnasium's: an episode ends at the environment's own max_turns
        gym.register(env_id, entry_point=entry_point, kwargs=kwargs, disable_env_checker=False)


def _load_plugins() -> None:
    for ep in entry_points(group="longhorizon.envs"):
        if ep.name not in _REGISTRY:
            register(ep.name, ep.value)


def spec(env_id: str) -> EnvSpec:
    if env_id not in _REGISTRY:
        _load_plugins()
    if env_id not in _REGISTRY:
        known = ", ".join(sorted(_REGISTRY)) or "none"
        raise KeyError(f"unknown environment {env_id!r}; registered: {known}")
    return _REGISTRY[env_id]


def list_specs() -> list[EnvSpec]:
    """Every registered environment, plugins included (listed without importing them)."""
    _load_plugins()
    return [_REGISTRY[k] for k in sorted(_REGISTRY)]


def env_class(env_id: str) -> type:
    """The class registered for `env_id` (imported now)."""
    module, _, attr = spec(env_id).entry_point.partition(":")
    return getattr(importlib.import_module(module), attr)


def config_problem(env_id: str, kwargs: dict | None = None) -> tuple[str, str] | None:
    """Why `make(env_id, **kwargs)` would fail before it runs, or None: ("id", why) for an unknown id
    or a plugin that does not import, ("kwargs", why) for keyword arguments the constructor does not
    take. Config validation calls this on the driver so a mistake stops the run before Ray or an
    engine starts (the constructor itself is not run: a sandboxed environment may need its backend,
    which is the workers' business)."""
    try:
        cls = env_class(env_id)
    except KeyError as exc:
        return "id", str(exc.args[0])
    except Exception as exc:  # a plugin whose module fails to import
        return "id", f"environment {env_id!r} cannot be imported: {type(exc).__name__}: {exc}"
    signature = inspect.signature(cls)
    merged = {**spec(env_id).kwargs, **(kwargs or {})}
    # an agent program takes its AgentTask first (envs/agent_program.py)
    program = is_agent_program(cls)
    try:
        signature.bind(*([None] if program else []), **merged)
    except TypeError as exc:
        named = [
            p.name
            for p in list(signature.parameters.values())[1 if program else 0 :]
            if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
        return (
            "kwargs",
            f"environment {env_id!r} does not accept them ({exc}); it takes: {', '.join(named) or 'none'}",
        )
    # an environment's (or a program's) own checks of its values
    check = getattr(cls, "kwargs_problem", None)
    problem = check(merged) if check else None
    return ("kwargs", f"environment {env_id!r}: {problem}") if problem else None


def host_problem(env_id: str, kwargs: dict | None = None) -> str | None:
    """Why this machine cannot run `env_id` with `kwargs` (its sandbox backend is missing), or None.
    For an id and kwargs that `config_problem` has passed."""
    cls = env_class(env_id)
    check = getattr(cls, "host_problem", None)
    return check({**spec(env_id).kwargs, **(kwargs or {})}) if check else None


def make(env_id: str, **kwargs) -> ToolEnv:
    cls = env_class(env_id)
    if is_agent_program(cls):
        raise TypeError(
            f"{env_id} is an agent program, not an environment to step: a rollout worker runs it "
            "against its OpenAI-compatible endpoint (envs/agent_program.py)"
        )
    return cls(**{**spec(env_id).kwargs, **kwargs})


register("tools/calculator-v0", "envs.calculator:CalculatorEnv")
register("tools/shell-v0", "envs.shell:ShellEnv")
register("code/fix-tests-v0", "envs.fix_tests:FixTestsEnv")
register("long/needle-v0", "envs.needle:NeedleEnv")
register("long/oncall-v0", "envs.oncall:OncallEnv")
register("vision/maze-v0", "envs.maze:MazeEnv")
register("text/digits-v0", "envs.digits:DigitsEnv")
register("text/incident-v0", "envs.incident:IncidentEnv")
register("reasoning/gym-v0", "envs.reasoning:ReasoningGymEnv")
register("agents/calculator-openai-v0", "envs.calculator_agent:calculator_agent")
register("agents/calculator-agents-sdk-v0", "envs.calculator_agents_sdk:calculator_agents_sdk")
register("agents/command-v0", "envs.agent_command:command_agent")
register("agents/calculator-command-v0", "envs.agent_command:calculator_command")
register("verifiers/env-v0", "envs.verifiers_env:verifiers_env")


def succeeded(env_id: str, milestones: list[dict], reward: float) -> bool:
    """The environment's own success test (`ToolEnv.succeeded`); for an agent program, reaching
    the milestone `solved`."""
    cls = env_class(env_id)
    if is_agent_program(cls):
        from rewards.milestones import solved

        return solved(milestones)
    return cls.succeeded(milestones, reward)


def judge_reference(env_id: str, seed: int, kwargs: dict | None = None) -> str:
    """The reference answer a judge compares an episode of `env_id` reset with `seed` against
    (`ToolEnv.judge_reference`; "" for environments without one). The task is made again from the
    seed, so this resets an environment: a sandboxed one starts its sandbox."""
    cls = env_class(env_id)
    if is_agent_program(cls) or cls.judge_reference is ToolEnv.judge_reference:
        return ""
    env = make(env_id, **(kwargs or {}))
    try:
        env.reset(seed=seed)
        return env.judge_reference()
    finally:
        env.close()


def check_env(env, **kwargs) -> dict:
    from envs.check import check_env as _check

    return _check(env, **kwargs)


__all__ = [
    "register",
    "make",
    "judge_reference",
    "succeeded",
    "AgentTask",
    "AgentResult",
    "is_agent_program",
    "config_problem",
    "host_problem",
    "Milestone",
    "env_class",
    "spec",
    "list_specs",
    "check_env",
    "EnvSpec",
    "ToolEnv",
    "ToolSpec",
    "ToolFailure",
    "ResetInfo",
    "StepInfo",
]

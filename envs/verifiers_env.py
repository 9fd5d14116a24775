"""`verifiers/env-v0`: an installed verifiers environment, unchanged, as an agent program.

verifiers (prime-rl's environment format; https://github.com/PrimeIntellect-ai/verifiers) defines an
environment as a *taskset* (an installed package exporting a `vf.Taskset`: its tasks, tools and
`@vf.reward` functions) played by a *harness* (the agent program) through an OpenAI client. Here a
rollout worker runs one verifiers episode per longhorizon episode, pointed at the episode's session
on the worker's engine (rollout/openai_api.py), so every call the harness makes is recorded with
its exact tokens and trained like a native episode (rollout/program_episodes.py).

Keyword arguments (`env.kwargs`), checked when a run's config loads — the taskset is imported and
its config validated by verifiers itself, so a misspelt id or a bad value stops the run in seconds:
- `taskset`: the taskset id, as `vf-eval` takes it (an installed package, e.g. `reverse-text`);
- `config`: the taskset's config values (its `TasksetConfig` fields, e.g. `{num_tasks: 50}`);
- `harness`: the verifiers harness every role plays on (default `null`: chat with the taskset's
  tools, which verifiers serves over MCP);
- `max_turns`: each role's most model turns (default 0: verifiers' own limit, the taskset's);
- `python`: the interpreter of the environment where verifiers and the taskset are installed
  (default: LONGHORIZON_VERIFIERS_PYTHON, else the `.venv-verifiers` that `make install` makes);
- `env`: extra environment variables for it (a judge's API key, a PYTHONPATH);
- `solved_at`: the reward at which an episode counts as solved (the milestone `solved`, which is
  what success rates count); default 1.0;
- `timeout_s`: the most an episode may take, killed after (an infrastructure error).

The seed picks the task: task `seed mod N` of a finite taskset, the `seed`-th of an infinite one.
The episode's reward is verifiers' (the weighted sum of its reward functions); each named reward
that paid is a milestone of that name. A verifiers episode that ends in an error is an
infrastructure error, kept out of group statistics like a crashed agent program.

Why a second Python environment: verifiers 0.4 pins `openai<3`, the project's environment has
`openai>=3` (openai-agents), so verifiers runs in its own interpreter (envs/verifiers_bridge.py,
one process per episode, ~4 s of imports and start-up each). What is not covered: verifiers'
container runtimes (every role plays in its `subprocess` runtime, so harnesses that execute
model-written code, such as `bash`, are refused); a taskset's tool servers run the taskset's own
code with the worker's rights, unsandboxed, as they would under `vf-eval`.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
from pathlib import Path

from envs.agent_command import command_agent
from envs.agent_program import AgentResult, AgentTask

BRIDGE = Path(__file__).with_name("verifiers_bridge.py")
SIDECAR = Path(__file__).resolve().parents[1] / ".venv-verifiers" / "bin" / "python"


def interpreter(python: str = "") -> str:
    """The Python that runs verifiers (see the module doc)."""
    return python or os.environ.get("LONGHORIZON_VERIFIERS_PYTHON") or str(SIDECAR)


def _argv(
    mode: str, taskset: str, config: dict, harness: str, max_turns: int, python: str
) -> list[str]:
    return [
        interpreter(python),
        str(BRIDGE),
        mode,
        "--taskset",
        taskset,
        "--config",
        json.dumps(config, sort_keys=True),
        "--harness",
        harness,
        "--max-turns",
        str(max_turns),
    ]


def verifiers_env(
    task: AgentTask,
    taskset: str,
    config: dict | None = None,
    harness: str = "null",
    max_turns: int = 0,
    python: str = "",
    env: dict | None = None,
    solved_at: float = 1.0,
    timeout_s: float = 600.0,
) -> AgentResult:
    """One episode of the verifiers environment (see the module doc)."""
    result = command_agent(
        task,
        _argv("run", taskset, config or {}, harness, max_turns, python),
        timeout_s=timeout_s,
        env=env,
    )
    names = {m["name"] for m in result.milestones}
    if result.total() >= solved_at and "solved" not in names:
        # what success rates count (rewards.milestones.solved); it pays nothing more
        result.milestones.append({"name": "solved", "reward": 0.0})
    return result


def kwargs_problem(kwargs: dict) -> str | None:
    """Config-time checks (envs.config_problem): the values' types here, then the taskset and its
    config as verifiers itself builds them, where its interpreter is on this machine (elsewhere,
    on a cluster's driver, the workers find out)."""
    taskset, config = kwargs.get("taskset"), kwargs.get("config") or {}
    if not isinstance(taskset, str) or not taskset.strip():
        return "taskset must be a verifiers taskset id (an installed package, e.g. reverse-text)"
    if not isinstance(config, dict):
        return "config must be a mapping of the taskset's config values"
    try:
        json.dumps(config)
    except (TypeError, ValueError):
        return "config must hold plain values (numbers, strings, lists, mappings)"
    for key in ("harness", "python"):
        if not isinstance(kwargs.get(key, ""), str):
            return f"{key} must be a string"
    if not isinstance(kwargs.get("env") or {}, dict):
        return "env must be a mapping of environment variables"
    max_turns = kwargs.get("max_turns", 0)
    if type(max_turns) is not int or max_turns < 0:
        return f"max_turns must be an integer >= 0 (0: verifiers' own limit), not {max_turns!r}"
    for key, default in (("solved_at", 1.0), ("timeout_s", 600.0)):
        value = kwargs.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return f"{key} must be a number, not {value!r}"
    if not kwargs.get("timeout_s", 600.0) > 0:
        return "timeout_s must be > 0"
    if host_problem(kwargs):
        return None
    return _checked(
        taskset,
        json.dumps(config, sort_keys=True),
        kwargs.get("harness", "null"),
        max_turns,
        kwargs.get("python", ""),
        json.dumps(kwargs.get("env") or {}, sort_keys=True),
    )


@functools.lru_cache(maxsize=32)
def _checked(
    taskset: str, config: str, harness: str, max_turns: int, python: str, env: str
) -> str | None:
    """verifiers' own verdict on the taskset and its config (cached: a run's config is checked more
    than once, and each check is a process that imports verifiers)."""
    try:
        proc = subprocess.run(
            _argv("check", taskset, json.loads(config), harness, max_turns, python),
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, **{k: str(v) for k, v in json.loads(env).items()}},
        )
    except subprocess.TimeoutExpired:
        return f"verifiers did not load taskset {taskset!r} within 120 s"
    if proc.returncode == 0:
        return None
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    return f"verifiers taskset {taskset!r}: " + (lines[-1] if lines else f"exit {proc.returncode}")


def host_problem(kwargs: dict) -> str | None:
    """Why this machine cannot run verifiers (no interpreter where the kwargs or defaults say)."""
    python = interpreter(kwargs.get("python", ""))
    if os.access(python, os.X_OK):
        return None
    return (
        f"no Python with verifiers at {python} (`make install` makes .venv-verifiers; "
        "or name one with python: or LONGHORIZON_VERIFIERS_PYTHON)"
    )


verifiers_env.kwargs_problem = kwargs_problem  # envs.config_problem and host_problem look for them
verifiers_env.host_problem = host_problem

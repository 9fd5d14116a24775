"""Agent programs as external commands: an agent in any language, or one that must run in its own
process, talks to the session through the standard OpenAI environment variables.

`agents/command-v0` (kwargs: `command`, `timeout_s`, `cwd`, `env`) runs `command` once per episode
with, in its environment:

    OPENAI_BASE_URL          the session's base URL (.../sessions/EPISODE_ID/v1)
    OPENAI_API_KEY           the session's key
    OPENAI_MODEL             the model name the endpoint answers to
    LONGHORIZON_SEED         the task's seed (the same seed must give the same task)
    LONGHORIZON_EPISODE_ID   the episode's id

The `openai` clients (Python, TypeScript, ...) and most agent frameworks read the first two
themselves. The command prints its result as the last non-empty line of stdout: a number (the
reward) or a JSON object with `reward`, `milestones` and `task`, as an agent program returns them
(envs/agent_program.py); what it prints before that is ignored. A non-zero exit, a timeout (its
whole process group is killed) or a last line that is not a result fails the episode with an
infrastructure error that says which, with the end of its stderr.

Not a sandbox: the command is the user's own program and runs with the rollout worker's rights
(the model's text reaches it only as chat completions). `agents/calculator-command-v0` is the
calculator agent run this way (envs/calculator_command.py).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys

from envs.agent_program import AgentResult, AgentTask, result_of


def command_env(task: AgentTask, extra: dict | None = None) -> dict:
    """The command's environment: the worker's, `extra`, and the session's variables (see the module doc)."""
    return {
        **os.environ,
        **{k: str(v) for k, v in (extra or {}).items()},
        "OPENAI_BASE_URL": task.base_url,
        "OPENAI_API_KEY": task.api_key,
        "OPENAI_MODEL": task.model,
        "LONGHORIZON_SEED": str(task.seed),
        "LONGHORIZON_EPISODE_ID": task.episode_id,
    }


def command_agent(
    task: AgentTask,
    command: list[str] | str,
    timeout_s: float = 600.0,
    cwd: str = "",
    env: dict | None = None,
) -> AgentResult:
    """One episode of an external agent command (see the module doc)."""
    argv = _argv(command)
    if not argv:
        raise ValueError(f"agents/command-v0: {kwargs_problem({'command': command})}")
    try:
        proc = subprocess.Popen(
            argv,
            cwd=cwd or None,
            env=command_env(task, env),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
    except OSError as exc:
        raise RuntimeError(
            f"agent command {argv[0]!r} could not start: {exc.strerror or exc}"
        ) from None
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the command and whatever it started
        proc.communicate()
        raise TimeoutError(f"agent command timed out after {timeout_s:g} s (killed)") from None
    tail = " ".join(err.split())[-300:]
    if proc.returncode != 0:
        raise RuntimeError(
            f"agent command exited {proc.returncode}" + (f": {tail}" if tail else "")
        )
    lines = [line for line in out.splitlines() if line.strip()]
    if not lines:
        raise ValueError(
            "agent command printed no result (its last line of stdout must be a number or a JSON object)"
        )
    try:
        value = json.loads(lines[-1])
    except ValueError:
        raise ValueError(
            f"agent command's last line is not a number or a JSON object: {lines[-1][:200]!r}"
        ) from None
    return result_of(value)


def _argv(command) -> list[str] | None:
    if isinstance(command, str):
        try:
            return shlex.split(command)
        except ValueError:
            return None
    if isinstance(command, list) and all(
        isinstance(a, (str, int, float)) and not isinstance(a, bool) for a in command
    ):
        return [str(a) for a in command]
    return None


def kwargs_problem(kwargs: dict) -> str | None:
    """Config-time checks of `agents/command-v0`'s kwargs (envs.config_problem)."""
    argv = _argv(kwargs.get("command"))
    if not argv:
        return "command must be a non-empty list of arguments or a shell-quoted string"
    timeout = kwargs.get("timeout_s", 600.0)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        return f"timeout_s must be a number of seconds > 0, not {timeout!r}"
    if not isinstance(kwargs.get("env") or {}, dict):
        return "env must be a mapping of environment variables"
    return None


def host_problem(kwargs: dict) -> str | None:
    """Why this machine cannot start the command (its program is not found), or None."""
    program = _argv(kwargs.get("command"))[0]
    cwd = kwargs.get("cwd") or "."
    if os.sep in program:
        found = os.access(os.path.join(cwd, program), os.X_OK)
    else:
        found = shutil.which(program) is not None
    return None if found else f"agent command {program!r} is not an executable program here"


command_agent.kwargs_problem = kwargs_problem  # envs.config_problem and host_problem look for them
command_agent.host_problem = host_problem


def calculator_command(
    task: AgentTask, max_turns: int = 4, max_tokens: int = 64, timeout_s: float = 600.0
) -> AgentResult:
    """`agents/calculator-command-v0`: the calculator agent as an external process."""
    return command_agent(
        task,
        [
            sys.executable,
            "-m",
            "envs.calculator_command",
            "--max-turns",
            str(max_turns),
            "--max-tokens",
            str(max_tokens),
        ],
        timeout_s=timeout_s,
    )

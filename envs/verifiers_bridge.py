"""One episode of a verifiers environment, run in the Python environment where `verifiers` is installed.

This file is a script, not a module of the project: envs/verifiers_env.py runs it with the
interpreter of a separate virtual environment (`make install` makes `.venv-verifiers`), because
verifiers 0.4 needs `openai<3` and the project's own environment has `openai>=3` (openai-agents).
It imports only the standard library and verifiers, and talks to the project only through its
arguments, the OpenAI variables of `agents/command-v0` and the one line it prints.

    python verifiers_bridge.py check --taskset ID [--config JSON] [--harness ID] [--max-turns N]
    python verifiers_bridge.py run   --taskset ID [--config JSON] [--harness ID] [--max-turns N]

`check` builds the environment and its taskset from the config (verifiers validates the values)
and prints `{"tasks": N | null, "harness": ID}`; `run` plays one episode of the task the seed
picks (LONGHORIZON_SEED: task `seed mod N` of a finite taskset, the `seed`-th of an infinite one)
against the session in OPENAI_BASE_URL, and prints `{"reward", "milestones", "task"}`: the
episode's reward (every trace's weighted rewards), each named reward that paid as a milestone,
and the task's prompt. A problem is one line on stderr and exit status 2 (`check`) or 1 (`run`).

Each role of the environment plays in verifiers' `subprocess` runtime (no container engine is
needed), so a harness that executes model-written code is refused: such a harness would run the
model's commands with this process's rights.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import os
import sys


def _env_config(taskset: str, config: dict, harness: str, max_turns: int):
    """The verifiers `EnvConfig` of the taskset's own environment: every role on `harness` (empty:
    the taskset's default) in the subprocess runtime, with at most `max_turns` model turns (0: no
    cap of ours)."""
    from verifiers.v1.configs.agent import AgentConfig
    from verifiers.v1.utils.loaders import env_config_type, resolve_env_config

    cls = env_config_type(taskset)
    roles = [name for name, f in cls.model_fields.items() if isinstance(f.default, AgentConfig)]
    data: dict = {"taskset": {**config, "id": taskset}}
    for role in roles:
        data[role] = {"runtime": {"type": "subprocess"}}
        if harness:
            data[role]["harness"] = {"id": harness}
        if max_turns:
            data[role]["max_turns"] = max_turns
    return resolve_env_config(data)


def _code_harnesses(cfg) -> list[str]:
    """The roles' harnesses that execute model-written code."""
    from verifiers.v1.utils.loaders import harness_class

    return sorted(
        {h.id for h in cfg.agent_harnesses().values() if harness_class(h.id).EXECUTES_CODE}
    )


def _load(args):
    from verifiers.v1.utils.loaders import load_environment

    config = json.loads(args.config)
    if not isinstance(config, dict):
        raise ValueError("the taskset config must be a JSON object")
    cfg = _env_config(args.taskset, config, args.harness, args.max_turns)
    risky = _code_harnesses(cfg)
    if risky:
        raise ValueError(
            f"harness {', '.join(risky)} runs model-written commands, and longhorizon runs verifiers "
            "environments in a plain subprocess: use a harness that executes no code "
            "(harness: null, the chat harness with the taskset's tools)"
        )
    return cfg, load_environment(cfg)


def _task(taskset, seed: int):
    if taskset.bounded:
        tasks = list(taskset)
        if not tasks:
            raise ValueError("the taskset has no tasks")
        return tasks[seed % len(tasks)]
    return next(itertools.islice(iter(taskset), seed, None))


def check(args) -> dict:
    cfg, env = _load(args)
    n = len(list(env.taskset)) if env.taskset.bounded else None
    if n == 0:
        raise ValueError("the taskset has no tasks")
    return {"tasks": n, "harness": sorted({h.id for h in cfg.agent_harnesses().values()})}


async def _play(env, task, base_url: str, model: str):
    from verifiers.v1.clients import ModelContext
    from verifiers.v1.configs.client import EvalClientConfig

    # the client reads its key from a variable, by name: the session's key is in OPENAI_API_KEY
    client = EvalClientConfig(base_url=base_url, api_key_var="OPENAI_API_KEY")
    ctx = ModelContext(model=model, client=client)
    async with env.serving():
        (slot,) = env.slots(task, 1)
        return await env.run_slot(slot, ctx)


def run(args) -> dict:
    _, env = _load(args)
    seed = int(os.environ["LONGHORIZON_SEED"])
    task = _task(env.taskset, seed)
    episode = asyncio.run(
        _play(env, task, os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_MODEL"])
    )
    if not episode.ok:
        err = episode.last_error or next((e for t in episode.traces for e in t.errors), None)
        raise RuntimeError(f"the verifiers episode failed: {_error_line(err)}")
    paid: dict[str, float] = {}
    for trace in episode.traces:
        for name, r in trace.rewards.items():
            if r is not None:
                paid[name] = paid.get(name, 0.0) + r.value
    return {
        "reward": sum(t.reward for t in episode.traces),
        "milestones": [{"name": k, "reward": v} for k, v in paid.items() if v > 0],
        "task": task.data.prompt_text if hasattr(task.data, "prompt_text") else "",
    }


def _error_line(err) -> str:
    if err is None:
        return "no error recorded"
    text = getattr(err, "message", None) or getattr(err, "error", None) or str(err)
    return " ".join(str(text).split())[:300]


def _field(loc) -> str:
    """A verifiers config field as the run's config names it: the taskset's values are `config`."""
    names = [str(p) for p in loc]
    return ".".join(["config", *names[1:]] if names[:1] == ["taskset"] else names)


def _problem_line(exc: Exception) -> str:
    errors = getattr(exc, "errors", None)
    if callable(errors):  # pydantic's ValidationError: each field and what is wrong with it
        try:
            return "; ".join(
                f"{_field(e['loc'])}: {e['msg']} (got {e.get('input')!r:.60})" for e in errors()
            )
        except Exception:
            pass
    return f"{type(exc).__name__}: {' '.join(str(exc).split()) or 'no message'}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="verifiers_bridge")
    p.add_argument("mode", choices=["check", "run"])
    p.add_argument("--taskset", required=True)
    p.add_argument("--config", default="{}")
    p.add_argument("--harness", default="")
    p.add_argument("--max-turns", type=int, default=0)
    args = p.parse_args(argv)
    # verifiers' harnesses prepare their chat program with `uv`, looked up on PATH (and installed
    # into ~/.local by pip when missing): the uv of this interpreter's environment comes first
    os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    # verifiers logs its progress at INFO; only what went wrong belongs on this process's stderr
    logging.basicConfig(level=logging.ERROR)
    try:
        out = check(args) if args.mode == "check" else run(args)
    except Exception as exc:  # one line for the caller, who shows it as the episode's error
        print(_problem_line(exc)[:600], file=sys.stderr)
        return 2 if args.mode == "check" else 1
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The `envs` and `sandbox` subcommands of `longhorizon` (wired in by `longhorizon.cli`).

longhorizon envs list [--json]
longhorizon envs show ID [--json]
longhorizon envs check ID [--seed N] [--policy DIR] [key=value ...]
longhorizon envs play ID [--seed N] [key=value ...]    # you type the turns
longhorizon sandbox run [--backend B] [--timeout S] [--memory MB] [--workspace DIR] -- CMD ...
"""

from __future__ import annotations

import json
import shlex
import sys

import yaml
from rich.text import Text

from longhorizon.errors import message
from typed_yaml import load_yaml, short


def _kwargs(pairs: list[str]) -> dict:
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"environment argument {short(pair)} must look like key=value")
        try:
            out[key] = load_yaml(value)
        except yaml.YAMLError as exc:
            raise ValueError(
                f"environment argument {short(pair)}: the value is not YAML ({' '.join(str(exc).split())})"
            ) from None
    return out


def _make(env_id: str, pairs: list[str]):
    """The environment, after the same checks a run's config gets (id, arguments, this machine's
    sandbox backend), so a mistake is one line, not a constructor's TypeError or a reset's failure."""
    import envs

    kwargs = _kwargs(pairs)
    problem = envs.config_problem(env_id, kwargs)
    if problem:
        raise ValueError(problem[1])
    why = envs.host_problem(env_id, kwargs)
    if why:
        raise ValueError(f"{env_id} cannot run on this machine: {why}")
    return envs.make(env_id, **kwargs)


def _list(args) -> int:
    import envs

    rows = [
        {"id": s.id, "entry_point": s.entry_point, "kwargs": s.kwargs} for s in envs.list_specs()
    ]
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        for r in rows:
            print(f"{r['id']:<28} {r['entry_point']}")
    return 0


def _show_program(args) -> int:
    """An agent program: what it is and what it takes (it has no tools or milestones to declare)."""
    import inspect

    import envs

    fn = envs.env_class(args.env_id)
    params = [
        p.name if p.default is p.empty else f"{p.name}={p.default!r}"  # a required one: its name
        for p in list(inspect.signature(fn).parameters.values())[1:]
    ]
    info = {
        "id": args.env_id,
        "agent_program": envs.spec(args.env_id).entry_point,
        "kwargs": params,
        "description": inspect.getdoc(sys.modules[fn.__module__]) or "",
    }
    print(
        json.dumps(info, indent=2)
        if args.json
        else f"{args.env_id}  (agent program {info['agent_program']}({', '.join(['task'] + params)}))\n\n"
        f"{info['description']}\n\nrun by a rollout worker against its OpenAI-compatible endpoint (envs/agent_program.py)"
    )
    return 0


def _show(args) -> int:
    import envs

    if envs.is_agent_program(envs.env_class(args.env_id)):
        return _show_program(args)
    env = _make(args.env_id, args.kwargs)
    doc = (sys.modules[type(env).__module__].__doc__ or "").strip()
    info = {
        "id": args.env_id,
        "class": f"{type(env).__module__}:{type(env).__name__}",
        "max_turns": env.max_turns,
        "tools": [t.to_openai()["function"] for t in env.tools],
        "milestones": [
            {"name": m.name, "reward": m.reward, "description": m.description}
            for m in getattr(env, "milestones", ())
        ],
        "description": doc,
    }
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        print(f"{info['id']}  ({info['class']}, max_turns {info['max_turns']})\n")
        print(doc + "\n\ntools:")
        for t in info["tools"]:
            params = ", ".join(t["parameters"].get("properties", {}))
            print(f"  {t['name']}({params}): {t['description']}")
        print("\nmilestones:" if info["milestones"] else "\nmilestones: none declared")
        for m in info["milestones"]:
            paid = "varies" if m["reward"] is None else f"{m['reward']:g}"
            print(f"  {m['name']} ({paid}): {m['description']}")
    if hasattr(env, "close"):
        env.close()
    return 0


def _check_program(args) -> int:
    """An agent program, run against an endpoint that answers every call with a fixed reply
    (rollout/program_episodes.py `check_agent_program`): no model, the tokenizer of `--policy`
    (default: the tiny policy's, which has the same chat template)."""
    import envs
    from envs.check import EnvCheckError
    from rollout.program_episodes import check_agent_program

    kwargs = _kwargs(args.kwargs)
    problem = envs.config_problem(args.env_id, kwargs) or envs.host_problem(args.env_id, kwargs)
    if problem:
        raise ValueError(
            problem[1]
            if isinstance(problem, tuple)
            else f"{args.env_id} cannot run on this machine: {problem}"
        )
    if args.policy:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.policy)
    else:
        from rl.start.tiny import build_tokenizer, default_corpus

        tokenizer = build_tokenizer(default_corpus())
    try:
        report = check_agent_program(args.env_id, kwargs, tokenizer, seed=args.seed)
    except EnvCheckError as exc:
        print(str(exc), file=sys.stderr)
        return 1
    split = sum(n > 1 for n in report["samples"])
    print(
        f"{args.env_id}: ok — an agent program; calls per episode {report['calls']}, rewards {report['rewards']}"
        + (
            f"; {split} of 3 episodes rewrote their history (trained as one sample per sequence)"
            if split
            else "; every episode one token sequence"
        )
    )
    return 0


def _check(args) -> int:
    import envs
    from envs.check import EnvCheckError, check_env

    if envs.is_agent_program(envs.env_class(args.env_id)):
        return _check_program(args)
    env = _make(args.env_id, args.kwargs)
    try:
        report = check_env(env, seed=args.seed, expert=not args.no_expert)
    except EnvCheckError as exc:
        print(str(exc), file=sys.stderr)
        return 1
    expert = (
        f"expert reward {report['expert_reward']} with milestones "
        f"{', '.join(report['expert_milestones']) or 'none'}"
        if not args.no_expert
        else "expert not checked"
    )
    print(f"{args.env_id}: ok — tools {', '.join(report['tools'])}; {expert}")
    return 0


def as_turn(line: str, tools: set[str] | None = None) -> str:
    """What a person types, as a model turn: `name key=value ...` or `name {json}`, where `name` is
    one of the environment's `tools`, becomes one tool call; anything else (plain text, raw
    <tool_call> blocks) is the turn as typed, as a model might write it."""
    from envs.tool_calls import format_tool_call

    line = line.strip()
    name, _, rest = line.partition(" ")
    if "<tool_call>" in line or not line or (tools is not None and name not in tools):
        return line
    rest = rest.strip()
    if rest.startswith("{"):
        return format_tool_call(name, **json.loads(rest))
    return format_tool_call(name, **_kwargs(shlex.split(rest)))


def _play(args) -> int:
    from longhorizon.terminal import SafeConsole

    console = SafeConsole()
    env = _make(args.env_id, args.kwargs)
    obs, info = env.reset(seed=args.seed)
    console.print(
        f"[bold]{args.env_id}[/] seed {args.seed}. Type a turn: `tool key=value ...`, `tool {{json}}`, "
        "or raw text with <tool_call> blocks; `quit` ends."
    )
    console.print("tools: " + ", ".join(t.name for t in env.tools))
    console.print("[cyan]task[/]:", end=" ")
    console.print(obs, markup=False, highlight=False)
    total, turns, reached, ended = 0.0, 0, [], "stopped"
    tools = {t.name for t in env.tools}
    while True:
        try:
            line = input("> ")
        except EOFError:
            console.print()  # end the prompt's line
            break
        if line.strip() in ("quit", "exit"):
            break
        try:
            turn = as_turn(line, tools)
        except (ValueError, json.JSONDecodeError) as exc:
            console.print(Text.assemble(("cannot read that turn", "red"), f": {exc}"))
            continue
        obs, reward, terminated, truncated, info = env.step(turn)
        total, turns = total + reward, turns + 1
        console.print(obs, markup=False, highlight=False)
        for m in info.get("milestones", []):
            reached.append(m["name"])
            console.print(Text(f"milestone {m['name']} +{m['reward']:g}", style="green"))
        if info.get("images"):
            img = info["images"][-1]
            console.print(Text(f"(image {img.shape[1]}x{img.shape[0]})", style="dim"))
        if terminated or truncated:
            ended = "terminated" if terminated else "truncated"
            break
    # the episode's summary however it ended (the environment, quit, or the end of input)
    console.print(
        Text(
            f"episode {ended} after {turns} turn(s); total reward {total:g}; milestones "
            f"{', '.join(reached) or 'none'}",
            style="bold",
        )
    )
    if hasattr(env, "close"):
        env.close()
    return 0


def _sandbox_run(args) -> int:
    from envs.sandbox import Limits, SandboxError, open_sandbox

    cmd = args.cmd[1:] if args.cmd and args.cmd[0] == "--" else args.cmd
    if not cmd:
        print(
            "error: give the command after --, e.g. longhorizon sandbox run -- echo hi",
            file=sys.stderr,
        )
        return 2
    try:
        limits = Limits.within(args.timeout, memory_mb=args.memory)
        with open_sandbox(args.backend, workspace=args.workspace, limits=limits) as sb:
            result = sb.run(cmd)
            cgroup = getattr(sb, "cgroup", None)
            scope = (
                "the container"
                if args.backend == "docker"
                else cgroup.scope
                if cgroup is not None
                else "each process (RLIMIT_AS)"
            )
    except (SandboxError, ValueError) as exc:
        print(f"error: {message(exc)}", file=sys.stderr)
        return 2
    print(json.dumps({**result.to_dict(), "memory_scope": scope}, indent=2))
    return 0


def _guarded(fn):
    """Bad ids and arguments end with one clear line, not a traceback."""

    def run(args) -> int:
        try:
            return fn(args)
        except (KeyError, ValueError, TypeError) as exc:
            print(f"error: {message(exc)}", file=sys.stderr)
            return 2

    return run


def add_parser(sub) -> None:
    p = sub.add_parser("envs", help="list, show, check and play environments")
    esub = p.add_subparsers(dest="envs_command", required=True)
    e = esub.add_parser("list", help="registered environments, plugins included")
    e.add_argument("--json", action="store_true")
    e.set_defaults(fn=_guarded(_list))
    for name, fn, help_ in (
        ("show", _show, "an environment's description and tools"),
        ("check", _check, "run check_env and the scripted expert's episode"),
        ("play", _play, "type the turns yourself"),
    ):
        e = esub.add_parser(name, help=help_)
        e.add_argument("env_id")
        e.add_argument("kwargs", nargs="*", help="constructor arguments as key=value")
        if name == "show":
            e.add_argument("--json", action="store_true")
        else:
            e.add_argument("--seed", type=int, default=0)
        if name == "check":
            e.add_argument(
                "--no-expert", action="store_true", help="an environment without a scripted expert"
            )
            e.add_argument(
                "--policy",
                help="an agent program's check: the tokenizer (chat template) of this "
                "checkpoint (default: the tiny policy's)",
            )
        e.set_defaults(fn=_guarded(fn))

    p = sub.add_parser("sandbox", help="run a command in a sandbox")
    ssub = p.add_subparsers(dest="sandbox_command", required=True)
    s = ssub.add_parser("run", help="run CMD in a sandbox and print a JSON result")
    s.add_argument("--backend", default="bwrap", help="bwrap (default), docker or none")
    s.add_argument("--timeout", type=float, default=10.0, help="wall-clock seconds (default 10)")
    s.add_argument(
        "--memory",
        type=int,
        default=512,
        help="memory limit in MiB (default 512): for the whole sandbox where a cgroup can be made (cgroup "
        "v2, else v1's memory controller; the result's memory_scope says which), else for each process "
        "(RLIMIT_AS), which a fork-heavy command can pass",
    )
    s.add_argument(
        "--workspace", help="directory to use as the workspace (default: a fresh temporary one)"
    )
    s.add_argument("cmd", nargs="*", help="-- CMD ARGS...")
    s.set_defaults(fn=_sandbox_run)

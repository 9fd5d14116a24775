"""`longhorizon demo`: the demo's stages on its configs (longhorizon/demo.py)."""

from __future__ import annotations

import sys
from pathlib import Path

from longhorizon.errors import message, unwritable
from longhorizon.terminal import SafeConsole


def run(args) -> int:
    from longhorizon.demo import DEMO_CONFIGS, run_demo
    from rl.config import ConfigError
    from rl.loop.guards import CannotLearn
    from rl.loop.trainer import LearnerDied, WorkerLost

    console = SafeConsole(stderr=True)
    problem = unwritable(Path(args.out))
    if problem:
        print(f"error: --out {problem}", file=sys.stderr)
        return 2
    try:
        rows = run_demo(args.out, args.config or DEMO_CONFIGS, args.overrides, console)
    except (ConfigError, ValueError, FileExistsError) as exc:
        print(f"error: {message(exc)}", file=sys.stderr)
        return 2
    except (
        LearnerDied,
        WorkerLost,
        CannotLearn,
    ) as exc:  # what was written is kept; the message says how to go on
        print(f"error: {message(exc)}", file=sys.stderr)
        return 1
    console.print((Path(args.out) / "results.md").read_text(), markup=False, highlight=False)
    console.print(
        f"wrote {Path(args.out) / 'eval.json'} ({len(rows)} test rows), results.md and curve.png"
    )
    return 0


def add_parser(sub) -> None:

    p = sub.add_parser(
        "demo",
        help="warm start + RL + held-out evaluation on the demo configs: eval.json, curve.png",
    )
    p.add_argument("--out", default="runs/demo", help="where the runs, eval.json and curve.png go")
    p.add_argument(
        "--config",
        action="append",
        help="a demo config (repeatable; default configs/demo/calculator.yaml and shell.yaml, the real policy)",
    )
    p.add_argument("overrides", nargs="*", help="section.key=value overrides for every config")
    p.set_defaults(fn=run)

"""`longhorizon plot`: PNG curves of a run's metrics (longhorizon/plot.py)."""

from __future__ import annotations

import sys

from longhorizon.errors import message


def run(args) -> int:
    from longhorizon.plot import plot_run

    try:
        paths = plot_run(args.run_dir, args.out)
    except (OSError, ValueError) as exc:
        print(f"error: {message(exc)}", file=sys.stderr)
        return 2
    for p in paths:
        print(f"wrote {p}")
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser(
        "plot", help="PNG curves of a run's metrics (reward, milestones, loss, sync, throughput)"
    )
    p.add_argument("run_dir")
    p.add_argument("--out", help="directory for the PNG files (default RUN_DIR/plots)")
    p.set_defaults(fn=run)

"""`longhorizon`: the command line. Each subcommand is a module of longhorizon/commands/ with its
own `add_parser`; this one parses and dispatches.

longhorizon train CONFIG [--run-dir DIR] [--iterations N] [--address HOST:PORT] [section.key=value ...]
longhorizon train --resume DIR [--iterations N] [--address HOST:PORT]
longhorizon train CONFIG --from-store RUN_DIR [...]   # learner only, on stored trajectories
longhorizon inspect DIR [--episode ID [--tokens]] [--episodes FILTERS] [--json] [--html OUT.html]
longhorizon replay DIR (--episode ID | --all) [--rescore RUBRIC] [--json]
longhorizon export DIR [--out FILE] [--format jsonl|datasets]
longhorizon plot DIR [--out DIR]
longhorizon eval RUN_DIR|CHECKPOINT --env ID --episodes N [--k K] [--json]   (rl/loop/evaluate.py)
longhorizon demo [--out runs/demo] [--config C ...] [key=value ...]          (longhorizon/demo.py)
longhorizon cluster up|down [--host H --port P --dashboard-port D]   # a Ray head (longhorizon/cluster.py)
longhorizon submit CONFIG --address http://HEAD:8265 [--token T] [--wait] [key=value ...]   (longhorizon/jobs.py)
longhorizon jobs status|logs|stop ID --address http://HEAD:8265 [--token T]
longhorizon policy info CONFIG [--json]
longhorizon policy upcycle SRC --experts E [--top-k K] --out DIR [--json]   (rl/start/pretrained.py)
longhorizon policy pretrained NAME [--experts E --top-k K]   # into the local cache; prints the path
longhorizon serve RUN_DIR|CHECKPOINT [--host H --port P --api-key K]   # OpenAI-compatible API (longhorizon/serve.py)
longhorizon envs list|show|check|play ...          (longhorizon/commands/envs.py)
longhorizon sandbox run [--backend B] ... -- CMD   (longhorizon/commands/envs.py)
"""

from __future__ import annotations

import argparse
import sys
import warnings

from longhorizon.commands import COMMANDS
from longhorizon.terminal import visible


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors as one line (it prints the usage block first); subcommands' parsers
    are of this class too."""

    def error(self, message: str):
        print(f"{self.prog}: error: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(2)


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """A warning as one line, its control characters visible (it may name a crafted file)."""
    print(visible(f"warning: {message}"), file=file or sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(prog="longhorizon", description="Agentic RL post-training of sparse-MoE LLMs.")
    sub = parser.add_subparsers(dest="command", required=True)
    # each subcommand: its own module, its own parser (longhorizon/commands/)
    for command in COMMANDS:
        command.add_parser(sub)

    # Overrides may come before or after the options; argparse alone stops collecting positionals
    # at the first option, so gather the leftovers here.
    args, extra = parser.parse_known_args(argv)
    bad = [
        x
        for x in extra
        if x.startswith("-") or args.command not in ("train", "submit", "demo") or "=" not in x
    ]
    if bad:
        parser.error(f"unrecognized arguments: {' '.join(bad)}")
    if extra:
        args.overrides = list(args.overrides) + extra
    warnings.showwarning = _show_warning
    try:
        code = args.fn(args)
        sys.stdout.flush()  # here, where a reader that left can be caught, not at interpreter exit
        return code
    # `longhorizon ... --json | head`: the reader left; no traceback for that
    except BrokenPipeError:
        import os

        # so the exit's flush cannot fail again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # what a shell reports for a command ended by SIGPIPE


if __name__ == "__main__":
    sys.exit(main())

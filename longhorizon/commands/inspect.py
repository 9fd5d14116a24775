"""`longhorizon inspect`: a run's summary, its episodes, one episode, a group, the HTML viewer."""

from __future__ import annotations

import json
import sys

from longhorizon.errors import message
from longhorizon.terminal import SafeConsole


def run(args) -> int:
    from longhorizon import inspect as insp

    # piped, rich would cut tables at 80 columns ("miles…"); a wide console keeps every cell whole
    console = SafeConsole() if sys.stdout.isatty() else SafeConsole(width=400)
    try:
        if args.group is not None:
            view = insp.group_view(args.run_dir, insp.parse_group(args.group))
            if args.json:
                print(json.dumps(view, indent=2))
            else:
                insp.print_group(view, console)
        elif args.html:
            from longhorizon.viewer import write_html

            print(f"wrote {write_html(args.run_dir, args.html)}")
        elif args.episodes:
            rows = insp.episode_list(
                args.run_dir,
                env=args.env,
                min_reward=args.min_reward,
                max_reward=args.max_reward,
                version=args.version,
                min_generated=args.min_generated,
                max_generated=args.max_generated,
                stop=args.stop,
                failure=args.failure,
                min_tool_errors=args.min_tool_errors,
            )
            if args.json:
                print(json.dumps(rows, indent=2))
            else:
                insp.print_episode_list(rows, console, limit=args.limit)
        elif args.episode and args.tokens:
            page = insp.token_rows(args.run_dir, args.episode, start=args.start, count=args.count)
            if args.json:
                print(json.dumps(page, indent=2))
            else:
                insp.print_tokens(page, console)
        elif args.json and args.episode:
            print(json.dumps(insp.episode_json(args.run_dir, args.episode)))
        elif args.json:
            print(json.dumps(insp.summary(args.run_dir), indent=2))
        elif args.episode:
            insp.print_episode(args.run_dir, args.episode, SafeConsole())
        else:
            insp.print_summary(args.run_dir, console)
    except (OSError, KeyError, ValueError) as exc:
        print(f"error: {message(exc)}", file=sys.stderr)
        return 2
    return 0


def add_parser(sub) -> None:
    from rollout.trajectory import FAILURE_KINDS, STOP_REASONS

    p = sub.add_parser("inspect", help="summarise a run, or show one episode")
    p.add_argument("run_dir")
    p.add_argument("--episode", help="episode id to show turn by turn")
    p.add_argument("--json", action="store_true", help="machine-readable summary")
    p.add_argument(
        "--html", metavar="OUT.html", help="write a self-contained HTML viewer of the run"
    )
    p.add_argument("--episodes", action="store_true", help="list episodes (filters below)")
    p.add_argument("--env", help="only this environment id")
    p.add_argument("--min-reward", type=float)
    p.add_argument("--max-reward", type=float)
    p.add_argument("--version", type=int, help="only episodes with a turn of this policy version")
    p.add_argument("--min-generated", type=int, help="at least this many generated tokens")
    p.add_argument("--max-generated", type=int)
    p.add_argument("--stop", help=f"only this stop reason ({', '.join(STOP_REASONS)})")
    p.add_argument("--failure", help=f"only this failure kind ({', '.join(FAILURE_KINDS)})")
    p.add_argument(
        "--min-tool-errors", type=int, help="only episodes with at least this many tool errors"
    )
    p.add_argument(
        "--group",
        help="one GRPO group side by side: rewards, advantages, failures, "
        "tools per turn, where each departs from the best; the group as episode ids print it "
        "(i1-g2: iteration 1's group 2) or its run-wide number",
    )
    p.add_argument("--limit", type=int, default=50, help="rows shown (default 50)")
    p.add_argument("--tokens", action="store_true", help="with --episode: a page of its tokens")
    p.add_argument("--start", type=int, default=0, help="first token of the page")
    p.add_argument("--count", type=int, default=200, help="tokens per page (default 200)")
    p.set_defaults(fn=run)

"""`longhorizon replay`: recorded episodes re-run in fresh environments and compared, or rescored."""

from __future__ import annotations

import json
import sys

from longhorizon.errors import message, report_skipped
from longhorizon.terminal import visible


def run(args) -> int:
    from longhorizon.replay import (
        agent_tokenizer,
        replay_episode,
        rescore,
        run_env_kwargs,
        run_rollout,
    )
    from rl.store import TrajectoryStore

    try:
        store = TrajectoryStore(args.run_dir)
        if not store.shards():
            raise FileNotFoundError(f"{args.run_dir} holds no trajectory shards")
        trajs = [
            t
            for t in store.trajectories(strict=not args.skip_corrupt)
            if args.all or t.episode_id == args.episode
        ]
        report_skipped(store)
        if not trajs:
            raise KeyError(f"no episode {args.episode!r} in {args.run_dir}")
        if args.rescore:
            judge: dict = {}
            rows = rescore(trajs, args.rescore, args.run_dir, judge)
            if judge:  # on stderr: --json output is the only thing on stdout
                print(
                    f"judge: {judge['cache_hits']} of {judge['requests']} scores from the run's cache",
                    file=sys.stderr,
                )
            parts = lambda r: (
                "  (" + ", ".join(f"{k} {v:g}" for k, v in r["parts"].items()) + ")"
                if len(r["parts"]) > 1
                else ""
            )  # noqa: E731
            print(
                json.dumps(rows, indent=2)
                if args.json
                else "\n".join(
                    f"{r['episode_id']}: not scored ({r['not_scored']})"
                    if r["rescored"] is None
                    else f"{r['episode_id']}: {r['recorded']:g} -> {r['rescored']:g}{parts(r)}"
                    for r in rows
                )
            )
            return 0
        kwargs = run_env_kwargs(args.run_dir)
        # None unless an agent program's episode, or one of several context segments, is replayed
        tokenizer = agent_tokenizer(args.run_dir, trajs)
        rollout = run_rollout(args.run_dir) if tokenizer is not None else None
        results = [replay_episode(t, kwargs, tokenizer=tokenizer, rollout=rollout) for t in trajs]
    except (OSError, KeyError, ValueError, ImportError, AttributeError) as exc:
        print(f"error: {message(exc)}", file=sys.stderr)
        return 2
    bad = [r for r in results if not r.ok]
    skipped = [r for r in results if r.not_replayed]
    if args.json:
        print(
            json.dumps(
                {
                    "replayed": len(results) - len(skipped),
                    "diverged": len(bad),
                    "not_replayed": len(skipped),
                    "results": [r.to_dict() for r in results],
                },
                indent=2,
            )
        )
    else:
        for r in bad:
            print(visible(f"{r.episode_id}: DIVERGED at {r.divergence}"))
        for r in skipped:
            print(visible(f"{r.episode_id}: not replayed: {r.not_replayed}"))
        print(
            f"replayed {len(results) - len(skipped)} episode(s): {len(results) - len(bad) - len(skipped)} identical, "
            f"{len(bad)} diverged"
            + (f"; {len(skipped)} never ran (infra errors), not replayed" if skipped else "")
        )
    return 1 if bad else 0


def add_parser(sub) -> None:
    p = sub.add_parser(
        "replay", help="re-run recorded episodes in fresh environments and check them"
    )
    p.add_argument("run_dir")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--episode", help="episode id")
    which.add_argument("--all", action="store_true", help="every episode of the run")
    p.add_argument(
        "--rescore",
        metavar="RUBRIC",
        help="recompute rewards instead: a rubric YAML file, `run` (the run's "
        "reward section), a built-in part (milestones, solved, format, length) or module:function",
    )
    p.add_argument(
        "--skip-corrupt",
        action="store_true",
        help="leave out unreadable shards (default: stop, naming them)",
    )
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=run)

"""`longhorizon submit` and `longhorizon jobs`: a training job on a Ray cluster (longhorizon/jobs.py)."""

from __future__ import annotations

import sys

from longhorizon.errors import message


def _submit(args) -> int:
    from longhorizon import jobs
    from rl.config import ConfigError

    try:
        job_id, run_dir = jobs.submit(
            args.config,
            args.address,
            overrides=args.overrides,
            run_dir=args.run_dir,
            python=args.python,
        )
    except (ConfigError, ConnectionError, FileNotFoundError) as exc:
        print(f"error: {message(exc)}", file=sys.stderr)
        return 2
    # the jobs API's refusal (e.g. "No available agent to submit job"), as one line
    except RuntimeError as exc:
        print(
            f"error: the cluster at {args.address} did not take the job: {message(exc)}",
            file=sys.stderr,
        )
        return 1
    print(f"submitted {job_id}; run directory on the head: {run_dir}")
    if not args.wait:
        print(f"follow it: longhorizon jobs logs {job_id} --address {args.address}")
        return 0
    try:
        state = jobs.wait(args.address, job_id, timeout_s=args.timeout)
    except (ConnectionError, RuntimeError) as exc:
        print(f"error: following job {job_id}: {message(exc)}", file=sys.stderr)
        return 1
    print(f"job {job_id}: {state}")
    return 0 if state == "SUCCEEDED" else 1


def _jobs(args) -> int:
    from longhorizon import jobs

    try:
        if args.action == "status":
            print(jobs.status(args.address, args.job_id))
        elif args.action == "logs":
            print(jobs.logs(args.address, args.job_id), end="")
        else:
            print("stopped" if jobs.stop(args.address, args.job_id) else "not running")
    except (
        ConnectionError,
        RuntimeError,
    ) as exc:  # RuntimeError: the jobs API's answer for an unknown id
        print(f"error: {message(exc)}", file=sys.stderr)
        return 2
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("submit", help="run a training job on a Ray cluster (Ray Jobs API)")
    p.add_argument("config")
    p.add_argument(
        "--address", required=True, help="the cluster's jobs endpoint, e.g. http://HEAD:8265"
    )
    p.add_argument(
        "--run-dir", help="run directory on the head (default ~/longhorizon-runs/NAME-TIME)"
    )
    p.add_argument(
        "--python",
        default=None,
        help="the cluster's Python with the project installed (default: the one running Ray on the head)",
    )
    p.add_argument(
        "--wait",
        action="store_true",
        help="follow the job's log until it ends; exit 1 unless it succeeded",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=24 * 3600,
        help="with --wait: give up after this many seconds",
    )
    p.add_argument("overrides", nargs="*", help="section.key=value overrides")
    p.set_defaults(fn=_submit)

    p = sub.add_parser("jobs", help="a submitted job's status, logs, or stop it")
    p.add_argument("action", choices=["status", "logs", "stop"])
    p.add_argument("job_id")
    p.add_argument(
        "--address", required=True, help="the cluster's jobs endpoint, e.g. http://HEAD:8265"
    )
    p.set_defaults(fn=_jobs)

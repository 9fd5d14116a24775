"""`longhorizon cluster up|down` (a Ray head to submit to: longhorizon/cluster.py), `longhorizon
submit` and `longhorizon jobs` (a training job on a Ray cluster: longhorizon/jobs.py)."""

from __future__ import annotations

import json
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
            token=args.token,
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
        state = jobs.wait(args.address, job_id, timeout_s=args.timeout, token=args.token)
    except (ConnectionError, RuntimeError) as exc:
        print(f"error: following job {job_id}: {message(exc)}", file=sys.stderr)
        return 1
    print(f"job {job_id}: {state}")
    return 0 if state == "SUCCEEDED" else 1


def _jobs(args) -> int:
    from longhorizon import jobs

    try:
        if args.action == "status":
            print(jobs.status(args.address, args.job_id, args.token))
        elif args.action == "logs":
            print(jobs.logs(args.address, args.job_id, args.token), end="")
        else:
            print("stopped" if jobs.stop(args.address, args.job_id, args.token) else "not running")
    except (
        ConnectionError,
        RuntimeError,
    ) as exc:  # RuntimeError: the jobs API's answer for an unknown id
        print(f"error: {message(exc)}", file=sys.stderr)
        return 2
    return 0


def _cluster(args) -> int:
    from longhorizon import cluster

    if args.action == "down":
        n = cluster.down(args.port)
        print(f"stopped {n} process(es) of the head on port {args.port}")
        return 0
    try:
        resources = json.loads(args.resources) if args.resources else None
        if resources is not None and not isinstance(resources, dict):
            raise ValueError("--resources must be a JSON object, e.g. '{\"learner\": 1}'")
        head = cluster.up(
            args.host, args.port, args.dashboard_port, args.num_cpus, resources, args.timeout
        )
    except (RuntimeError, ValueError, OSError) as exc:
        print(f"error: {message(exc)}", file=sys.stderr)
        return 2
    where = f" (in {head['token_file']})" if head["token_file"] else " (RAY_AUTH_TOKEN)"
    print(
        f"Ray head up on {head['host']}, token authentication on\n"
        f"  cluster address  {head['address']}   (longhorizon train --address, ray.address)\n"
        f"  jobs endpoint    {head['jobs']}   (longhorizon submit/jobs --address)\n"
        f"  token            {head['token']}{where}\n"
        f"  a node joins     RAY_AUTH_MODE=token RAY_AUTH_TOKEN=<token> ray start --address "
        f"{head['address']}\n"
        f"  submit           longhorizon submit configs/quickstart.yaml --address {head['jobs']}\n"
        f"  stop it          longhorizon cluster down --port {head['port']}"
    )
    return 0


TOKEN_HELP = (
    "the cluster's Ray token (default: what Ray reads: RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH, "
    "~/.ray/auth_token)"
)


def add_parser(sub) -> None:
    p = sub.add_parser("cluster", help="start or stop a Ray head to submit jobs to")
    p.add_argument("action", choices=["up", "down"])
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="the head's address (default 127.0.0.1: this machine only; a LAN address for nodes to join)",
    )
    p.add_argument("--port", type=int, default=6379, help="the cluster (GCS) port (default 6379)")
    p.add_argument(
        "--dashboard-port", type=int, default=8265, help="the jobs endpoint's port (default 8265)"
    )
    p.add_argument("--num-cpus", type=int, default=None, help="CPUs the head offers (default: all)")
    p.add_argument("--resources", help="custom resources the head offers, as JSON")
    p.add_argument(
        "--timeout", type=float, default=120.0, help="seconds for the head and its jobs endpoint"
    )
    p.set_defaults(fn=_cluster)

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
    p.add_argument("--token", help=TOKEN_HELP)
    p.add_argument("overrides", nargs="*", help="section.key=value overrides")
    p.set_defaults(fn=_submit)

    p = sub.add_parser("jobs", help="a submitted job's status, logs, or stop it")
    p.add_argument("action", choices=["status", "logs", "stop"])
    p.add_argument("job_id")
    p.add_argument(
        "--address", required=True, help="the cluster's jobs endpoint, e.g. http://HEAD:8265"
    )
    p.add_argument("--token", help=TOKEN_HELP)
    p.set_defaults(fn=_jobs)

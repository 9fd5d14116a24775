"""Per-call latency of each sandbox backend against a bare subprocess, measured in the same run.

    .venv/bin/python bench/sandbox_latency.py [--calls 30] [--docker-host unix:///path/docker.sock]

Two commands: `true` (pure start-up cost) and `python -c pass` (what a Python tool pays). bwrap runs
both ways: one sandbox per episode whose helper starts each call (the default as root), and a fresh
sandbox per call. Calls alternate between the variants, round-robin, so load on this noisy machine hits each alike. Prints a
Markdown table: median and p90 milliseconds, and each backend's median over the bare subprocess's.
The docker rows use a reachable engine (DOCKER_HOST, --docker-host, or the default socket), else a
private dockerd the script starts and stops (root, Debian's docker.io), with gVisor's runsc when installed.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from envs.sandbox import Limits, backend_status, open_sandbox  # noqa: E402
from envs.sandbox.docker_engine import (  # noqa: E402
    private_dockerd,
    private_dockerd_unavailable,
    unavailable_reason,
)

# The interpreter by its full path: a bare `python3` may be a pyenv shim (a shell script) outside and
# the venv's binary inside, which would compare two different programs.
COMMANDS = {"true": ["/bin/true"], "python -c pass": [sys.executable, "-c", "pass"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=30)
    ap.add_argument("--docker-host")
    ap.add_argument(
        "--no-private-dockerd",
        action="store_true",
        help="do not start a private dockerd when no engine is reachable",
    )
    args = ap.parse_args()
    from contextlib import nullcontext

    engine = nullcontext(args.docker_host)
    if unavailable_reason(args.docker_host) is not None and not args.no_private_dockerd:
        reason = private_dockerd_unavailable()
        if reason:
            print(f"no docker rows: {reason}", file=sys.stderr)
        else:
            engine = private_dockerd()
    with engine as docker_host:
        measure(args, docker_host)


def measure(args, docker_host: str | None) -> None:

    runners = {"bare subprocess": None}
    sandboxes = []
    # bwrap per episode (the default: one sandbox for the episode, a helper runs each call) and per call
    variants = [
        ("none", "none", {}),
        ("bwrap (episode)", "bwrap", {}),
        ("bwrap (per call)", "bwrap", {"per_episode": False}),
    ]
    if docker_host or unavailable_reason() is None:
        opts = {"docker_host": docker_host} if docker_host else {}
        variants += [
            ("docker", "docker", opts),
            ("docker + gVisor", "docker", {**opts, "runtime": "runsc"}),
        ]
    for name, backend, opts in variants:
        reason = backend_status(backend) if backend != "docker" else None
        try:
            if reason:
                raise RuntimeError(reason)
            sb = open_sandbox(backend, limits=Limits(timeout_s=30), **opts)
            sb.run(["true"])  # a runtime the engine lacks fails here, not mid-measurement
        except Exception as exc:
            print(f"skipping {name}: {exc}", file=sys.stderr)
            continue
        sandboxes.append(sb)
        runners[name] = sb

    times = {(name, cmd): [] for name in runners for cmd in COMMANDS}
    for _ in range(args.calls):
        for cmd, argv in COMMANDS.items():
            for name, sb in runners.items():
                t0 = time.perf_counter()
                if sb is None:
                    subprocess.run(argv, capture_output=True, check=True)
                else:
                    r = sb.run(argv)
                    assert r.exit_code == 0, r
                times[(name, cmd)].append((time.perf_counter() - t0) * 1000)
    for sb in sandboxes:
        sb.close()

    print(
        f"python {platform.python_version()}, {platform.machine()}, {args.calls} calls per cell\n"
    )
    print("| command | runner | median ms | p90 ms | median / bare |")
    print("|---|---|---:|---:|---:|")
    for cmd in COMMANDS:
        bare = statistics.median(times[("bare subprocess", cmd)])
        for name in runners:
            xs = sorted(times[(name, cmd)])
            med, p90 = statistics.median(xs), xs[int(0.9 * (len(xs) - 1))]
            print(f"| `{cmd}` | {name} | {med:.1f} | {p90:.1f} | {med / bare:.1f}x |")


if __name__ == "__main__":
    main()

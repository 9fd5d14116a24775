"""`longhorizon cluster up|down`: a Ray head that `longhorizon submit` can use, started the way the
docs say, with Ray's token authentication on.

    longhorizon cluster up [--host 127.0.0.1] [--port 6379] [--dashboard-port 8265] [--num-cpus N]
    longhorizon cluster down [--port 6379]

`up` runs `ray start --head` with every port it opens named (the GCS, the dashboard and jobs
endpoint, and the five internal ones, taken free on the host, so a second Ray on the machine does
not make a head come up without its job agent), its processes and sockets under a temp dir of its
own (`/tmp/lh-ray-PORT`: `down` stops exactly those processes, never every Ray on the machine as
`ray stop` would), and `RAY_AUTH_MODE=token` set explicitly (Ray 2.60's default for a new cluster,
here without its warning). The token is Ray's own: `RAY_AUTH_TOKEN`, the file `RAY_AUTH_TOKEN_PATH`
names, or `~/.ray/auth_token`, made (mode 0600) when none exists. It prints the cluster address, the
jobs endpoint, the token and how a worker node joins; `submit` and `jobs` read the same token
(`--token` overrides it).

A head on 127.0.0.1 (the default) keeps every socket on loopback (`RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`,
else Ray rewrites 127.0.0.1 to the machine's address); a head on another address is for a cluster
of several machines, whose nodes join it with `ray start --address HOST:PORT` and the token.

A port already in use is named before anything starts (exit 2), and so is a head whose jobs
endpoint does not answer in time.

Not covered: `ray up` style provisioning of machines (configs/cluster/onprem.yaml is a `ray up`
file), TLS.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

STATE = "longhorizon-head.json"
"""What `up` records in the head's temp dir: its ports, host and the PIDs it started."""


def temp_dir(port: int) -> Path:
    """The head's temp dir (short: Ray's unix sockets live under it)."""
    return Path(f"/tmp/lh-ray-{port}")


def token_file() -> Path:
    return Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")


def read_token() -> str:
    """The Ray token this machine would use, as Ray looks for it ("" when there is none)."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return os.environ["RAY_AUTH_TOKEN"].strip()
    try:
        return token_file().read_text().strip()
    except OSError:
        return ""


def ensure_token() -> str:
    """The token, made and saved (mode 0600) where Ray reads it when there is none."""
    token = read_token()
    if token:
        return token
    path = token_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    token = secrets.token_hex(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(token)
    return token


def port_in_use(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def free_ports(host: str, n: int, avoid: set[int]) -> list[int]:
    """`n` ports free on `host` now (none of `avoid`)."""
    out: list[int] = []
    while len(out) < n:
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if port not in avoid and port not in out:
            out.append(port)
    return out


def head_env(host: str) -> dict:
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_USAGE_STATS_ENABLED": "0"}
    if host in ("127.0.0.1", "localhost"):
        env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    return env


def pids_under(marker: str) -> list[int]:
    """The processes whose command line names `marker` (the head's temp dir)."""
    import psutil

    pids = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            if p.info["pid"] != os.getpid() and any(marker in a for a in p.info["cmdline"] or ()):
                pids.append(p.info["pid"])
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return pids


def up(
    host: str = "127.0.0.1",
    port: int = 6379,
    dashboard_port: int = 8265,
    num_cpus: int | None = None,
    resources: dict | None = None,
    timeout_s: float = 120.0,
) -> dict:
    """Start the head; what `cluster up` prints. A port in use, a head already running under the
    same port, or a jobs endpoint that does not come up raise `RuntimeError` naming it."""
    tmp = temp_dir(port)
    if (tmp / STATE).exists() and pids_under(str(tmp)):
        raise RuntimeError(
            f"a head started by longhorizon cluster up already runs on port {port} "
            f"(longhorizon cluster down --port {port} stops it)"
        )
    for name, p in (("--port", port), ("--dashboard-port", dashboard_port)):
        if port_in_use(host, p):
            raise RuntimeError(
                f"port {p} on {host} is in use (another Ray head, or another server): "
                f"choose another with {name}"
            )
    agent, agent_grpc, metrics, rt_env, client = free_ports(host, 5, {port, dashboard_port})
    token = ensure_token()
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    ray = str(Path(sys.executable).parent / "ray")
    cmd = [
        ray,
        "start",
        "--head",
        f"--port={port}",
        f"--node-ip-address={host}",
        "--include-dashboard=true",
        f"--dashboard-host={host}",
        f"--dashboard-port={dashboard_port}",
        f"--dashboard-agent-listen-port={agent}",
        f"--dashboard-agent-grpc-port={agent_grpc}",
        f"--metrics-export-port={metrics}",
        f"--runtime-env-agent-port={rt_env}",
        f"--ray-client-server-port={client}",
        f"--temp-dir={tmp}",
        "--disable-usage-stats",
    ]
    if num_cpus is not None:
        cmd.append(f"--num-cpus={num_cpus}")
    if resources:
        cmd.append(f"--resources={json.dumps(resources)}")
    started = subprocess.run(
        cmd, env=head_env(host), capture_output=True, text=True, timeout=timeout_s
    )
    if started.returncode != 0:
        last = (started.stderr or started.stdout).strip().splitlines()
        down(port)
        raise RuntimeError(f"ray start failed: {last[-1] if last else started.returncode}")
    jobs = f"http://{host}:{dashboard_port}"
    state = {
        "host": host,
        "port": port,
        "dashboard_port": dashboard_port,
        "address": f"{host}:{port}",
        "jobs": jobs,
        "temp_dir": str(tmp),
        "token_file": "" if os.environ.get("RAY_AUTH_TOKEN") else str(token_file()),
    }
    (tmp / STATE).write_text(json.dumps(state))
    deadline = time.monotonic() + timeout_s
    while True:  # the job agent comes up a little after `ray start` returns
        try:
            client_for(jobs, token).list_jobs()
            break
        except Exception as exc:  # noqa: BLE001  (not up yet: Ray's many ways of saying so)
            if time.monotonic() > deadline:
                down(port)
                raise RuntimeError(
                    f"the head started but its jobs endpoint {jobs} did not answer within "
                    f"{timeout_s:.0f} s ({type(exc).__name__}); it was stopped"
                ) from None
            time.sleep(1)
    return {**state, "token": token}


def down(port: int = 6379) -> int:
    """Stop the head `up` started on `port` (its processes, by their temp dir); how many were stopped."""
    tmp = temp_dir(port)
    pids = pids_under(str(tmp))
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 10
    while pids_under(str(tmp)) and time.monotonic() < deadline:
        time.sleep(0.2)
    shutil.rmtree(tmp, ignore_errors=True)
    return len(pids)


def client_for(address: str, token: str | None = None):
    """A Ray Jobs client for `address`, sending `token` (default: this machine's Ray token) as its
    bearer, whatever RAY_AUTH_MODE this process has."""
    from ray.job_submission import JobSubmissionClient

    # a missing or refused token is reported as one line by longhorizon/jobs.py, not by Ray's
    # logger; nor is the jobs SDK's chatter ("Uploading package ...") printed beside it
    logging.getLogger("ray._private.authentication.http_token_authentication").setLevel(
        logging.ERROR
    )
    for name in ("ray.dashboard.modules", "ray._private.runtime_env.packaging"):
        logging.getLogger(name).setLevel(logging.WARNING)
    token = read_token() if token is None else token
    headers = {"Authorization": f"Bearer {token}"} if token else None
    return JobSubmissionClient(address, headers=headers)

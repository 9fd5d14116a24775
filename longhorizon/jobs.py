"""Training jobs on a Ray cluster through the Ray Jobs API.

    longhorizon submit CONFIG --address http://HEAD:8265 [--token T] [--run-dir DIR] [--python PY] [--wait] [key=value ...]
    longhorizon jobs status|logs|stop JOB_ID --address http://HEAD:8265 [--token T]

`submit` ships the project's packages and the (validated) config as the job's `working_dir`
runtime environment and runs `PY -m longhorizon.cli train job.yaml --run-dir DIR ray.address=auto` on the
head: the driver joins the cluster it runs on, and its actors are placed on the cluster's nodes.
`PY` must be a Python on the cluster with the project's dependencies installed; by default it is
the Python that runs Ray on the head: the entrypoint's shell finds the environment Ray's job
supervisor (its parent process) loaded Ray from, in `/proc/$PPID/maps`, so a head started from a
virtualenv runs the job in that virtualenv whatever the head's PATH says (Linux heads). The run directory is a path on the head (shared
storage in a real cluster); its default is `~/longhorizon-runs/NAME-TIME` there.

Every request carries the cluster's Ray token as its bearer (`--token`, else the token Ray itself
would read: `RAY_AUTH_TOKEN`, `RAY_AUTH_TOKEN_PATH`, `~/.ray/auth_token`; longhorizon/cluster.py),
whatever `RAY_AUTH_MODE` this shell has. What the endpoint refuses is one line naming why: no or a
wrong token, nothing listening, no job agent on the head.

Not covered: building a cluster image (install the project there), TLS.
"""

from __future__ import annotations

import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path

PACKAGES = ("typed_yaml", "rewards", "policy", "envs", "rollout", "rl", "longhorizon", "configs")
REPO = Path(__file__).resolve().parents[1]
TERMINAL = {"SUCCEEDED", "FAILED", "STOPPED"}
# The entrypoint runs in a shell whose parent is Ray's job supervisor. Its command line is Ray's
# process title ("ray::JobSupervisor"), and /proc/PID/exe resolves a virtualenv's python to the base
# interpreter, which would lose the virtualenv; the shared objects it mapped name the environment
# Ray was imported from: <prefix>/lib/pythonX.Y/site-packages/ray/_raylet.so -> <prefix>/bin/python.
# The interpreter itself is the fallback (a system-wide install).
FIND_HEAD_PYTHON = (
    "PY=\"$(sed -n 's|^.* \\(/[^ ]*\\)/lib/python[0-9.]*/site-packages/ray/_raylet\\.so$|\\1/bin/python|p' "
    '/proc/$PPID/maps | head -n 1)"; [ -x "$PY" ] || PY="$(readlink /proc/$PPID/exe)"; '
)


class JobsRefused(ConnectionError):
    """The jobs endpoint would not do what was asked; the message says why, in one line."""


def explain(address: str, exc: Exception) -> JobsRefused:
    """Ray's exception from the jobs endpoint as one line naming the cause."""
    text = " ".join(str(exc).split())
    if type(exc).__name__ == "AuthenticationError" or "Authentication" in text:
        return JobsRefused(
            f"the cluster at {address} refused the request: "
            f"{'a wrong token' if 'failed' in text.lower() else 'no token'} for its token "
            "authentication; pass --token, or set RAY_AUTH_TOKEN (longhorizon cluster up prints it)"
        )
    if "No available agent" in text:
        return JobsRefused(
            f"the head at {address} has no job agent running (still starting, or it could not "
            "bind its port: start the head with longhorizon cluster up, which names every port)"
        )
    if isinstance(exc, ConnectionError) or "connect" in text.lower():
        return JobsRefused(f"no Ray jobs endpoint at {address}: {text[:300]}")
    return JobsRefused(f"the Ray jobs endpoint at {address}: {text[:300]}")


def _client(address: str, token: str | None = None):
    from longhorizon.cluster import client_for

    try:
        return client_for(address, token)
    except Exception as exc:  # noqa: BLE001  (ConnectionError and friends, Ray's wording)
        raise explain(address, exc) from None


def _asking(address: str, call):
    """`call()`'s answer; what the endpoint refuses, as `JobsRefused`."""
    try:
        return call()
    except Exception as exc:  # noqa: BLE001  (RuntimeError, AuthenticationError, ...: Ray's wording)
        raise explain(address, exc) from None


def stage(cfg) -> Path:
    """A directory holding the project's packages and `job.yaml` (the checked config)."""
    from rl.config import dump_config

    out = Path(tempfile.mkdtemp(prefix="lh-job-"))
    for pkg in PACKAGES:
        if (REPO / pkg).is_dir():
            shutil.copytree(
                REPO / pkg, out / pkg, ignore=shutil.ignore_patterns("__pycache__", "*.pyc")
            )
    dump_config(cfg, out / "job.yaml")
    return out


def submit(
    config_path: str | Path,
    address: str,
    *,
    overrides: list[str] | None = None,
    run_dir: str | None = None,
    python: str | None = None,
    token: str | None = None,
) -> tuple[str, str]:
    """Submit a training job; returns (job id, run directory on the head)."""
    from rl.config import load_config

    name = Path(config_path).stem
    run_dir = run_dir or f"~/longhorizon-runs/{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    # a bad config fails before anything ships
    cfg = load_config(config_path, list(overrides or []))
    client = _client(address, token)
    staged = stage(cfg)
    try:
        prefix, py = ("", shlex.quote(python)) if python else (FIND_HEAD_PYTHON, '"$PY"')
        entrypoint = (
            f"{prefix}{py} -m longhorizon.cli train job.yaml --run-dir {run_dir} ray.address=auto"
        )
        job_id = _asking(
            address,
            lambda: client.submit_job(
                entrypoint=entrypoint,
                runtime_env={"working_dir": str(staged)},
                submission_id=f"longhorizon-{name}-{time.strftime('%Y%m%d-%H%M%S')}",
                metadata={"longhorizon_config": name, "run_dir": run_dir},
            ),
        )
    finally:
        shutil.rmtree(staged, ignore_errors=True)  # uploaded by now
    return job_id, run_dir


def status(address: str, job_id: str, token: str | None = None) -> str:
    client = _client(address, token)
    return str(_asking(address, lambda: client.get_job_status(job_id)).value)


def logs(address: str, job_id: str, token: str | None = None) -> str:
    client = _client(address, token)
    return _asking(address, lambda: client.get_job_logs(job_id))


def stop(address: str, job_id: str, token: str | None = None) -> bool:
    client = _client(address, token)
    return bool(_asking(address, lambda: client.stop_job(job_id)))


def wait(
    address: str, job_id: str, timeout_s: float = 3600, out=sys.stdout, token: str | None = None
) -> str:
    """Follow a job until it ends, echoing its new log lines; returns its final status."""
    client = _client(address, token)
    seen = 0
    deadline = time.monotonic() + timeout_s
    while True:
        state = str(client.get_job_status(job_id).value)
        text = client.get_job_logs(job_id)
        if len(text) > seen:
            out.write(text[seen:])
            out.flush()
            seen = len(text)
        if state in TERMINAL:
            return state
        if time.monotonic() > deadline:
            raise TimeoutError(f"job {job_id} still {state} after {timeout_s:.0f}s")
        time.sleep(2)

"""Training jobs on a Ray cluster through the Ray Jobs API.

    longhorizon submit CONFIG --address http://HEAD:8265 [--run-dir DIR] [--python PY] [--wait] [key=value ...]
    longhorizon jobs status|logs|stop JOB_ID --address http://HEAD:8265

`submit` ships the project's packages and the (validated) config as the job's `working_dir`
runtime environment and runs `PY -m longhorizon.cli train job.yaml --run-dir DIR ray.address=auto` on the
head: the driver joins the cluster it runs on, and its actors are placed on the cluster's nodes.
`PY` must be a Python on the cluster with the project's dependencies installed; by default it is
the Python that runs Ray on the head: the entrypoint's shell finds the environment Ray's job
supervisor (its parent process) loaded Ray from, in `/proc/$PPID/maps`, so a head started from a
virtualenv runs the job in that virtualenv whatever the head's PATH says (Linux heads). The run directory is a path on the head (shared
storage in a real cluster); its default is `~/longhorizon-runs/NAME-TIME` there.

Not covered: building a cluster image (install the project there), authentication of the jobs
endpoint (Ray's token auth or a network policy: the operator's).
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


def _client(address: str):
    from ray.job_submission import JobSubmissionClient

    try:
        return JobSubmissionClient(address)
    except Exception as exc:  # ConnectionError and friends, with Ray's own wording
        raise ConnectionError(f"no Ray jobs endpoint at {address}: {exc}") from None


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
) -> tuple[str, str]:
    """Submit a training job; returns (job id, run directory on the head)."""
    from rl.config import load_config

    name = Path(config_path).stem
    run_dir = run_dir or f"~/longhorizon-runs/{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    # a bad config fails before anything ships
    cfg = load_config(config_path, list(overrides or []))
    client = _client(address)
    staged = stage(cfg)
    try:
        prefix, py = ("", shlex.quote(python)) if python else (FIND_HEAD_PYTHON, '"$PY"')
        entrypoint = (
            f"{prefix}{py} -m longhorizon.cli train job.yaml --run-dir {run_dir} ray.address=auto"
        )
        job_id = client.submit_job(
            entrypoint=entrypoint,
            runtime_env={"working_dir": str(staged)},
            submission_id=f"longhorizon-{name}-{time.strftime('%Y%m%d-%H%M%S')}",
            metadata={"longhorizon_config": name, "run_dir": run_dir},
        )
    finally:
        shutil.rmtree(staged, ignore_errors=True)  # uploaded by now
    return job_id, run_dir


def status(address: str, job_id: str) -> str:
    return str(_client(address).get_job_status(job_id).value)


def logs(address: str, job_id: str) -> str:
    return _client(address).get_job_logs(job_id)


def stop(address: str, job_id: str) -> bool:
    return bool(_client(address).stop_job(job_id))


def wait(address: str, job_id: str, timeout_s: float = 3600, out=sys.stdout) -> str:
    """Follow a job until it ends, echoing its new log lines; returns its final status."""
    client = _client(address)
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

"""Training jobs through the Ray Jobs API, against a Ray head this module starts on loopback (with
its dashboard, which serves the jobs endpoint) and stops by PID."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from local_cluster import SMALL_JOB as SMALL
from local_cluster import free_ports as _free_ports
from local_cluster import pids_with as _pids_under

from conftest import REPO

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ray_head():
    temp = f"/tmp/lhray-{os.getpid()}"  # short: Ray's unix sockets live under it
    gcs, dash, agent, agent_grpc, metrics, rt_env, client = _free_ports(7)
    # the head's PATH without the virtualenv, as when `ray start` is run by its full path: a job must
    # still run in the virtualenv's Python (the one running Ray), not in whatever `python` PATH finds
    venv_bin = str(Path(sys.executable).parent)
    path = os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep) if p != venv_bin)
    env = {
        **os.environ,
        "PATH": path,
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "RAY_AUTH_MODE": "disabled",
        "RAY_USAGE_STATS_ENABLED": "0",
    }
    ray_cli = str(Path(sys.executable).parent / "ray")
    subprocess.run(
        [
            ray_cli,
            "start",
            "--head",
            f"--port={gcs}",
            "--node-ip-address=127.0.0.1",
            "--include-dashboard=true",
            "--dashboard-host=127.0.0.1",
            f"--dashboard-port={dash}",
            f"--dashboard-agent-listen-port={agent}",
            f"--dashboard-agent-grpc-port={agent_grpc}",
            f"--metrics-export-port={metrics}",
            f"--runtime-env-agent-port={rt_env}",
            f"--ray-client-server-port={client}",
            "--num-cpus=2",
            "--object-store-memory=268435456",
            '--resources={"rollout": 2, "env_worker": 2, "learner": 1}',
            f"--temp-dir={temp}",
            "--disable-usage-stats",
        ],
        env=env,
        check=True,
        capture_output=True,
        timeout=120,
    )
    address = f"http://127.0.0.1:{dash}"
    from ray.job_submission import JobSubmissionClient

    deadline = time.monotonic() + 60
    while True:  # the jobs endpoint comes up a little after `ray start` returns
        try:
            JobSubmissionClient(address).list_jobs()
            break
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(1)
    yield address
    for pid in _pids_under(temp):  # never `ray stop`: it would kill every Ray on the machine
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    time.sleep(1)
    assert _pids_under(temp) == []
    shutil.rmtree(temp, ignore_errors=True)


def cli(*args, timeout=900):
    return subprocess.run(
        [sys.executable, "-m", "longhorizon.cli", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


PLACED = [
    "env.workers=1",
    "ray.rollout_resources={rollout: 1}",
    "ray.env_worker_resources={env_worker: 1}",
    "ray.learner_resources={learner: 1}",
]


def test_submit_a_training_job_and_follow_it(ray_head, tmp_path):
    from ray.util.state import list_actors

    run_dir = tmp_path / "job-run"
    # no --python: the job runs in the Python that runs Ray on the head (the head's PATH lacks it)
    r = cli(
        "submit",
        "configs/quickstart.yaml",
        "--address",
        ray_head,
        "--run-dir",
        str(run_dir),
        "--wait",
        *SMALL,
        *PLACED,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    job_id = r.stdout.split()[1].rstrip(";")
    assert f"job {job_id}: SUCCEEDED" in r.stdout
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["iteration"] for row in rows] == [0] and rows[0]["episodes"] == 4
    assert (run_dir / "trajectories" / "iter-000000.parquet").exists()
    assert cli("jobs", "status", job_id, "--address", ray_head).stdout.strip() == "SUCCEEDED"
    assert "done" in cli("jobs", "logs", job_id, "--address", ray_head).stdout
    # every actor asked for the custom resource of its role (the head advertises them)
    wanted = {"RolloutWorker": "rollout", "EnvWorker": "env_worker", "Learner": "learner"}
    seen = {}
    for actor in list_actors(address=ray_head, detail=True, limit=1000):
        if actor.class_name in wanted:
            seen[actor.class_name] = actor.required_resources
    assert set(seen) == set(wanted), seen
    for cls, resource in wanted.items():
        assert seen[cls].get(resource) == 1.0, (cls, seen[cls])


def test_stop_a_running_job(ray_head, tmp_path):
    r = cli(
        "submit",
        "configs/quickstart.yaml",
        "--address",
        ray_head,
        "--run-dir",
        str(tmp_path / "long"),
        "--python",
        sys.executable,
        "iterations=500",
        *SMALL[1:],
    )
    assert r.returncode == 0, r.stderr
    job_id = r.stdout.split()[1].rstrip(";")
    deadline = time.monotonic() + 120
    while cli("jobs", "status", job_id, "--address", ray_head).stdout.strip() in ("PENDING", ""):
        assert time.monotonic() < deadline
        time.sleep(1)
    assert cli("jobs", "stop", job_id, "--address", ray_head).stdout.strip() == "stopped"
    deadline = time.monotonic() + 120
    while (state := cli("jobs", "status", job_id, "--address", ray_head).stdout.strip()) not in (
        "STOPPED",
        "FAILED",
    ):
        assert time.monotonic() < deadline, state
        time.sleep(1)
    assert state == "STOPPED"


def test_bad_config_and_unknown_endpoint_fail_before_anything_ships(ray_head, tmp_path):
    r = cli("submit", "configs/quickstart.yaml", "--address", ray_head, "rollout.group_sise=4")
    assert r.returncode == 2 and "group_sise" in r.stderr
    port = _free_ports(1)[0]
    before = set(Path(tempfile.gettempdir()).glob("lh-job-*"))
    r = cli("submit", "configs/quickstart.yaml", "--address", f"http://127.0.0.1:{port}")
    assert r.returncode == 2 and "no Ray jobs endpoint" in r.stderr
    # no staging directory left behind
    assert set(Path(tempfile.gettempdir()).glob("lh-job-*")) == before


def test_the_head_listens_on_loopback_only(ray_head):
    from ipaddress import ip_address

    import psutil

    marker = f"/tmp/lhray-{os.getpid()}"
    head_pids = set(_pids_under(marker))
    listening = [
        c
        for c in psutil.net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN and c.pid in head_pids
    ]
    assert listening, "found no listening sockets of the head to check"
    outside = [
        (c.laddr.ip, c.laddr.port)
        for c in listening
        if not (
            getattr(ip_address(c.laddr.ip), "ipv4_mapped", None) or ip_address(c.laddr.ip)
        ).is_loopback
    ]
    assert outside == []


def test_example_cluster_file_is_a_valid_ray_up_config():
    import yaml
    from ray.autoscaler._private.util import prepare_config, validate_config

    raw = yaml.safe_load((REPO / "configs" / "cluster" / "onprem.yaml").read_text())
    validate_config(prepare_config(raw))  # raises on a schema error, naming the field
    assert any("pip install" in c for c in raw["setup_commands"])

"""A Ray head started the way docs/scaling.md says (`longhorizon cluster up`), with Ray's default
token authentication, then a job submitted to it; every refusal is one line naming its cause."""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from local_cluster import SMALL_JOB as SMALL
from local_cluster import free_ports

from conftest import REPO

pytestmark = pytest.mark.slow


def cli(*args, home: Path, timeout=900, **env):
    environ = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    return subprocess.run(
        [sys.executable, "-m", "longhorizon.cli", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        # HOME: where Ray keeps its token (~/.ray/auth_token); Ray's own default auth mode
        env={**environ, "HOME": str(home), **env},
    )


def test_a_head_from_the_docs_takes_a_job_with_its_token(tmp_path):
    home, stranger = tmp_path / "home", tmp_path / "stranger"
    home.mkdir()
    stranger.mkdir()
    port, dash = free_ports(2)
    up = cli(
        "cluster", "up", "--port", str(port), "--dashboard-port", str(dash), "--num-cpus", "2",
        home=home,
    )  # fmt: skip
    try:
        assert up.returncode == 0, up.stderr
        token_file = home / ".ray" / "auth_token"
        token = token_file.read_text().strip()
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600 and len(token) == 64
        lines = dict(
            re.findall(r"^  (cluster address|jobs endpoint|token) +(\S+)", up.stdout, re.M)
        )
        assert lines["cluster address"] == f"127.0.0.1:{port}"
        assert lines["jobs endpoint"] == f"http://127.0.0.1:{dash}" and lines["token"] == token
        jobs = lines["jobs endpoint"]
        # every socket the head's processes listen on is on loopback
        marker = f"/tmp/lh-ray-{port}"
        head = [psutil.Process(p) for p in _pids(marker)]
        listening = {
            c.laddr.ip.removeprefix("::ffff:")  # an IPv4-mapped IPv6 socket: the same loopback
            for p in head
            for c in p.net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN
        }
        assert head and listening == {"127.0.0.1"}, listening

        again = cli("cluster", "up", "--port", str(port), "--dashboard-port", str(dash), home=home)
        assert again.returncode == 2 and again.stderr.count("\n") == 1
        assert f"already runs on port {port}" in again.stderr
        (other,) = free_ports(1)
        taken = cli("cluster", "up", "--port", str(other), "--dashboard-port", str(dash), home=home)
        assert taken.returncode == 2 and f"port {dash} on 127.0.0.1 is in use" in taken.stderr

        config = "configs/quickstart.yaml"
        no_token = cli("submit", config, "--address", jobs, *SMALL, home=stranger)
        assert no_token.returncode == 2 and no_token.stderr.count("\n") == 1, no_token.stderr
        assert "no token" in no_token.stderr and "--token" in no_token.stderr
        wrong = cli("submit", config, "--address", jobs, "--token", "0" * 64, *SMALL, home=stranger)
        assert wrong.returncode == 2 and "a wrong token" in wrong.stderr, wrong.stderr

        run_dir = tmp_path / "job-run"
        ok = cli(
            "submit", config, "--address", jobs, "--token", token, "--run-dir", str(run_dir),
            "--wait", *SMALL, home=stranger,
        )  # fmt: skip
        assert ok.returncode == 0, ok.stdout[-3000:] + ok.stderr[-3000:]
        job_id = ok.stdout.split()[1].rstrip(";")
        assert f"job {job_id}: SUCCEEDED" in ok.stdout
        assert (run_dir / "trajectories" / "iter-000000.parquet").exists()
        # the token where Ray keeps it is read without --token
        assert cli("jobs", "status", job_id, "--address", jobs, home=home).stdout.strip() == (
            "SUCCEEDED"
        )
    finally:
        down = cli("cluster", "down", "--port", str(port), home=home)
    assert down.returncode == 0 and _pids(f"/tmp/lh-ray-{port}") == []
    assert not Path(f"/tmp/lh-ray-{port}").exists()


def _pids(marker: str) -> list[int]:
    from longhorizon.cluster import pids_under

    return pids_under(marker)

"""Checkpoint and resume: a run killed with SIGKILL and resumed with `longhorizon train --resume`
reproduces the uninterrupted run's following iterations, and keeps every episode once."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO
from rl.store import TrajectoryStore

pytestmark = pytest.mark.slow
DETERMINISTIC = (
    "iteration",
    "policy_version",
    "episodes",
    "mean_reward",
    "generated_tokens",
    "tool_errors",
)


def _cmd(tiny_policy, run_dir):
    return [
        sys.executable,
        "-m",
        "longhorizon.cli",
        "train",
        "configs/quickstart.yaml",
        "--run-dir",
        str(run_dir),
        "--iterations",
        "3",
        f"policy.path={tiny_policy}",
        "rollout.num_workers=1",
        "rollout.groups_per_iteration=2",
        "rollout.group_size=2",
        "rollout.max_turns=2",
        "algo.entropy_coef=0.01",
    ]


def _metrics(run_dir):
    return [
        json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()
    ]


def test_killed_run_resumes_and_reproduces_the_uninterrupted_run(tiny_policy, tmp_path):
    full, killed = tmp_path / "full", tmp_path / "killed"
    done = subprocess.run(
        _cmd(tiny_policy, full), capture_output=True, text=True, timeout=900, cwd=REPO
    )
    assert done.returncode == 0, done.stderr[-3000:]

    proc = subprocess.Popen(
        _cmd(tiny_policy, killed),
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.time() + 600
    while time.time() < deadline and proc.poll() is None:
        if (killed / "metrics.jsonl").exists() and len(_metrics(killed)) >= 1:
            break
        time.sleep(0.2)
    assert proc.poll() is None, "the run ended before it could be killed"
    os.killpg(proc.pid, signal.SIGKILL)  # no clean-up of any kind, as after a crash
    proc.wait(timeout=60)

    resumed = subprocess.run(
        [sys.executable, "-m", "longhorizon.cli", "train", "--resume", str(killed)],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=REPO,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from version-" in resumed.stderr

    a, b = _metrics(full), _metrics(killed)
    assert [m["iteration"] for m in b] == [0, 1, 2]
    for x, y in zip(a, b):
        assert {k: x[k] for k in DETERMINISTIC} == {k: y[k] for k in DETERMINISTIC}
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-6, abs=1e-9)
        assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-6)
    assert any(abs(m["loss"]) > 0 for m in a)  # the comparison is not between zeros

    ids_a = {t.episode_id: t.token_ids for t in TrajectoryStore(full).trajectories()}
    eps_b = [t for t in TrajectoryStore(killed).trajectories()]
    assert len(eps_b) == len({t.episode_id for t in eps_b}) == 12  # every episode exactly once
    assert all(ids_a[t.episode_id] == t.token_ids for t in eps_b)

    again = subprocess.run(
        [sys.executable, "-m", "longhorizon.cli", "train", "--resume", str(tmp_path / "nothing")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert again.returncode == 2 and "nothing to resume" in again.stderr

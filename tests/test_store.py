"""The trajectory store: atomic shards, a crash mid-write, corrupt shards reported by name."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO
from rl.store import TrajectoryStore
from rl.trajectory import Trajectory, Turn


def _traj(i, n=50):
    return Trajectory(episode_id=f"e{i}", iteration=0, group_id=0, env_id="tools/calculator-v0", seed=i,
                      prompt_len=2, token_ids=list(range(n)), loss_mask=[0, 0] + [1] * (n - 2),
                      rollout_logprobs=[0.0, 0.0] + [-1.5] * (n - 2),
                      turns=[Turn(2, n, n, "text", "obs", 1, 0, 0, 7, "stop")],
                      milestones=[{"name": "solved", "reward": 1.0, "turn": 0, "token": n - 1}], reward=1.0,
                      stop_reason="terminated", task="the task")


def test_round_trip_and_no_overwrite(tmp_path):
    store = TrajectoryStore(tmp_path)
    store.write("iter-000000", [_traj(0), _traj(1)])
    back = list(store.trajectories())
    assert [t.episode_id for t in back] == ["e0", "e1"] and back[0] == _traj(0)
    with pytest.raises(FileExistsError):
        store.write("iter-000000", [_traj(2)])
    assert len(list(store.trajectories())) == 2


def test_corrupt_shard_is_named_and_the_others_stay_readable(tmp_path):
    store = TrajectoryStore(tmp_path)
    store.write("iter-000000", [_traj(0)])
    store.write("iter-000001", [_traj(1)])
    bad = store.dir / "iter-000001.parquet"
    bad.write_bytes(bad.read_bytes()[:100])  # truncated, as by a full disk
    with pytest.warns(UserWarning, match="iter-000001.parquet"):
        eps = [t.episode_id for t in store.trajectories()]
    assert eps == ["e0"] and str(bad) in store.corrupt
    with pytest.raises(ValueError, match="corrupt trajectory shard .*iter-000001"):
        list(store.rows(strict=True))
    out = subprocess.run([sys.executable, "-m", "rl.cli", "inspect", str(tmp_path), "--json"],
                         capture_output=True, text=True, timeout=120, cwd=REPO)
    summary = json.loads(out.stdout)
    assert summary["episodes"] == 1 and str(bad) in summary["corrupt_shards"]


def test_a_crash_mid_write_leaves_no_partial_shard(tmp_path):
    """A writer killed while writing a large shard leaves only a hidden temporary file."""
    code = (
        "import sys; sys.path.insert(0, 'tests'); from test_store import _traj; from rl.store import TrajectoryStore;"
        f"s = TrajectoryStore({str(tmp_path)!r}); s.write('iter-000000', [_traj(0)]);"
        "print('first', flush=True);"
        "s.write('iter-000001', [_traj(i, 20000) for i in range(400)])"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "first"
    tmp = tmp_path / "trajectories" / ".iter-000001.parquet.tmp"
    deadline = time.time() + 60
    while not tmp.exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.01)
    assert tmp.exists(), "the writer was not caught mid-write"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    store = TrajectoryStore(tmp_path)
    assert [p.name for p in store.shards()] == ["iter-000000.parquet"]
    assert [t.episode_id for t in store.trajectories()] == ["e0"] and not store.corrupt

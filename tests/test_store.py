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
from rollout.trajectory import Trajectory, Turn


def _traj(i, n=50):
    return Trajectory(
        episode_id=f"e{i}",
        iteration=0,
        group_id=0,
        env_id="tools/calculator-v0",
        seed=i,
        prompt_len=2,
        token_ids=list(range(n)),
        loss_mask=[0, 0] + [1] * (n - 2),
        rollout_logprobs=[0.0, 0.0] + [-1.5] * (n - 2),
        turns=[Turn(2, n, n, "text", "obs", 1, 0, 0, 7, "stop")],
        milestones=[{"name": "solved", "reward": 1.0, "turn": 0, "token": n - 1}],
        reward=1.0,
        stop_reason="terminated",
        task="the task",
        failure="success",
    )


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
    with pytest.raises(ValueError, match="corrupt trajectory shard .*iter-000001"):
        list(store.trajectories())  # a whole-run read stops, naming the shard
    with pytest.warns(UserWarning, match="iter-000001.parquet"):
        eps = [t.episode_id for t in store.trajectories(strict=False)]
    assert eps == ["e0"] and str(bad) in store.corrupt
    size = bad.stat().st_size

    def cli(*args):
        return subprocess.run(
            [sys.executable, "-m", "longhorizon.cli", *args],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=REPO,
        )

    out = cli("inspect", str(tmp_path), "--json")  # inspection lists it and shows the rest
    summary = json.loads(out.stdout)
    assert summary["episodes"] == 1 and str(bad) in summary["corrupt_shards"]
    for args in (
        ["export", str(tmp_path)],
        ["replay", str(tmp_path), "--all"],
        [
            "train",
            "configs/quickstart.yaml",
            "--from-store",
            str(tmp_path),
            "--run-dir",
            str(tmp_path / "r"),
        ],
    ):
        out = cli(*args)
        assert out.returncode == 2 and out.stdout == "" and "Traceback" not in out.stderr, (
            out.stderr
        )
        assert "corrupt trajectory shard" in out.stderr and "iter-000001.parquet" in out.stderr
    assert (
        not (tmp_path / "trajectories.jsonl").exists()
        and not (tmp_path / "r" / "metrics.jsonl").exists()
    )
    # explicitly: the rest, saying what was left out
    out = cli("export", str(tmp_path), "--skip-corrupt")
    assert (
        out.returncode == 0
        and "skipped 1 corrupt trajectory shard(s): iter-000001.parquet" in out.stderr
    )
    assert [
        json.loads(line)["episode_id"]
        for line in (tmp_path / "trajectories.jsonl").read_text().splitlines()
    ] == ["e0"]
    assert bad.stat().st_size == size  # nothing already written is touched


def test_a_shard_corrupt_inside_a_column_stops_export_in_both_formats(tmp_path):
    """The quick look (`unreadable`) reads only footers and episode ids; a shard broken inside its
    token column passes it and fails mid-export: both formats stop naming the shard, with no
    traceback, and leave neither a partial file nor a changed earlier export."""
    import pyarrow.parquet as pq

    store = TrajectoryStore(tmp_path)
    store.write("iter-000000", [_traj(0)])
    store.write("iter-000001", [_traj(1, 2000)])
    bad = store.dir / "iter-000001.parquet"
    group = pq.ParquetFile(bad).metadata.row_group(0)
    tokens = next(
        group.column(i)
        for i in range(group.num_columns)
        if group.column(i).path_in_schema.startswith("token_ids")
    )
    data = bytearray(bad.read_bytes())
    # inside the page header
    data[tokens.data_page_offset + 20 : tokens.data_page_offset + 28] = b"\xff" * 8
    bad.write_bytes(bytes(data))
    assert not store.unreadable()  # the quick look passes: the failure comes mid-pass
    earlier = tmp_path / "earlier.jsonl"
    earlier.write_text("an earlier export\n")
    for fmt, out in (("jsonl", earlier), ("datasets", tmp_path / "ds")):
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "longhorizon.cli",
                "export",
                str(tmp_path),
                "--format",
                fmt,
                "--out",
                str(out),
            ],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=REPO,
        )
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
        assert (
            "corrupt trajectory shard" in r.stderr.splitlines()[-1]
            and "iter-000001.parquet" in r.stderr
        )
    assert earlier.read_text() == "an earlier export\n" and not (tmp_path / "ds").exists()
    assert not list(tmp_path.glob(".*.tmp"))


def test_export_to_a_missing_directory_is_refused_up_front(tmp_path):
    store = TrajectoryStore(tmp_path)
    store.write("iter-000000", [_traj(0)])
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "longhorizon.cli",
            "export",
            str(tmp_path),
            "--out",
            str(tmp_path / "no" / "such" / "x.jsonl"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        f"error: --out {tmp_path / 'no/such/x.jsonl'}: its directory {tmp_path / 'no/such'} does not exist"
    ]


def test_a_crash_mid_write_leaves_no_partial_shard(tmp_path):
    """A writer killed while writing a large shard leaves only a hidden temporary file."""
    code = (
        "import sys; sys.path.insert(0, 'tests'); from test_store import _traj; from rl.store import TrajectoryStore;"
        f"s = TrajectoryStore({str(tmp_path)!r}); s.write('iter-000000', [_traj(0)]);"
        "print('first', flush=True);"
        "s.write('iter-000001', [_traj(i, 20000) for i in range(400)])"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
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


def test_one_episode_and_its_learner_record_are_read_alone(tmp_path):
    import pyarrow.parquet as pq

    store = TrajectoryStore(tmp_path)
    path = store.write("iter-000000", [_traj(i, n=40 + i) for i in range(5)])
    assert pq.ParquetFile(path).num_row_groups == 5  # one row group per episode: a filter reads one
    assert store.episode("e3") == _traj(3, n=43)
    with pytest.raises(KeyError, match="no episode 'e9'"):
        store.episode("e9")
    assert [t.episode_id for t in store.episodes(["e4", "e1"])] == ["e1", "e4"]  # store order
    assert store.learner_record("e3") is None  # nothing trained yet
    notes = {
        f"e{i}": {
            "learner_logprobs": [0.0] + [-1.25] * (39 + i),
            "advantages": [0.0, 0.0] + [0.5] * (38 + i),
        }
        for i in (1, 3)
    }
    store.write_learner("iter-000000", notes, policy_version=0)
    rec = store.learner_record("e3")
    assert (
        rec["policy_version"] == 0
        and rec["advantages"][2:] == [0.5] * 41
        and len(rec["learner_logprobs"]) == 43
    )
    assert store.learner_record("e2") is None
    assert store.shards() == [path]  # learner shards live apart and are not trajectory shards
    with pytest.raises(FileExistsError):
        store.write_learner("iter-000000", notes, policy_version=0)


def test_inspect_episode_list_filters_and_token_page(tmp_path):
    store = TrajectoryStore(tmp_path)
    trajs = [_traj(i) for i in range(4)]
    trajs[1].reward, trajs[2].stop_reason, trajs[3].env_id = 0.0, "max_turns", "tools/shell-v0"
    store.write("iter-000000", trajs)
    store.write_learner(
        "iter-000000",
        {"e0": {"learner_logprobs": [0.0] + [-1.0] * 49, "advantages": [0.0, 0.0] + [0.75] * 48}},
        policy_version=0,
    )

    def cli(*args):
        r = subprocess.run(
            [sys.executable, "-m", "longhorizon.cli", "inspect", str(tmp_path), *args],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 0, r.stderr
        return r.stdout

    ids = lambda *a: [r["episode_id"] for r in json.loads(cli("--episodes", "--json", *a))]  # noqa: E731
    assert ids() == ["e0", "e1", "e2", "e3"]
    assert ids("--min-reward", "0.5") == ["e0", "e2", "e3"]
    assert ids("--stop", "max_turns") == ["e2"] and ids("--env", "tools/shell-v0") == ["e3"]
    assert ids("--version", "0") == ["e0", "e1", "e2", "e3"] and ids("--version", "1") == []
    page = json.loads(cli("--episode", "e0", "--tokens", "--start", "1", "--count", "3", "--json"))
    assert [r["role"] for r in page["rows"]] == ["prompt", "generated", "generated"]
    gen = page["rows"][1]
    assert (
        gen["rollout_logprob"] == -1.5
        and gen["learner_logprob"] == -1.0
        and gen["advantage"] == 0.75
    )
    assert gen["version"] == 0 and page["rows"][0]["version"] is None
    assert abs(gen["ratio"] - 1.6487212707) < 1e-6  # exp(learner - rollout) = exp(0.5)
    assert page["rows"][0]["ratio"] is None and page["learner_version"] == 0
    text = cli("--episode", "e1", "--tokens", "--count", "5")
    assert "no learner record" in text and "tokens 0–4 of 50" in text


def test_export_as_a_datasets_directory(tmp_path):
    from datasets import load_from_disk

    TrajectoryStore(tmp_path).write("iter-000000", [_traj(i) for i in range(3)])
    out = tmp_path / "ds"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "longhorizon.cli",
            "export",
            str(tmp_path),
            "--format",
            "datasets",
            "--out",
            str(out),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    ds = load_from_disk(str(out))
    assert ds["episode_id"] == ["e0", "e1", "e2"] and ds[1]["token_ids"] == list(range(50))
    # the store's column types, not Python's widened ones
    from rl.store import SCHEMA

    assert ds.data.schema.field("token_ids").type == SCHEMA.field("token_ids").type  # list<int32>
    assert (
        ds.features["loss_mask"].feature.dtype == "int8"
        and ds.features["rollout_logprobs"].feature.dtype == "float32"
    )
    assert ds.data.schema.field("routed_experts").type == SCHEMA.field("routed_experts").type
    # the run goes on: a new export sees it
    TrajectoryStore(tmp_path).write("iter-000001", [_traj(7)])
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "longhorizon.cli",
            "export",
            str(tmp_path),
            "--format",
            "datasets",
            "--out",
            str(tmp_path / "ds2"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert load_from_disk(str(tmp_path / "ds2"))["episode_id"] == ["e0", "e1", "e2", "e7"]


def test_viewer_pages_a_long_episode(tmp_path):
    from conftest import chromium_dom
    from longhorizon.viewer import write_html

    store = TrajectoryStore(tmp_path)
    store.write("iter-000000", [_traj(0), _traj(1, n=30_000)])
    # the newest episode only: the long one
    page = write_html(tmp_path, tmp_path / "v.html", max_episodes=1)
    dom = chromium_dom(page)
    assert '<h1 id="episode-title">e1</h1>' in dom and 'data-id="e0"' not in dom
    assert "tokens 0–1999 of 30000" in dom and "page 1/15" in dom
    # one page drawn, not all 30,000
    assert dom.split("<script")[0].count('<span class="tok') == 2000


def test_routed_experts_round_trip_and_version_1_shards_still_read(tmp_path):
    import pyarrow.parquet as pq

    store = TrajectoryStore(tmp_path)
    t = _traj(0, n=6)
    t.routed_experts = [[], [], [[1, 5], [0, 2]], [[3, 4], [7, 1]], [[1, 2], [2, 3]], []]
    store.write("iter-000000", [t, _traj(1)])
    back = {x.episode_id: x for x in store.trajectories()}
    assert back["e0"].routed_experts == t.routed_experts and back["e1"].routed_experts is None
    # a shard written before the column
    old = pq.read_table(store.shards()[0]).drop(["routed_experts"])
    pq.write_table(old, store.dir / "iter-000001.parquet")
    assert [x.routed_experts for x in store.trajectories(store.shards()[1])] == [None, None]
    assert [x.episode_id for x in store.trajectories(store.shards()[1])] == ["e0", "e1"]


def test_summary_reports_staleness_and_infra_errors(tmp_path):
    from longhorizon.inspect import summary

    store = TrajectoryStore(tmp_path)
    a, b, c = _traj(0), _traj(1), _traj(2)
    b.turns = [
        Turn(2, 20, 25, "t", "o", 1, 0, 0, 7, "stop"),
        Turn(25, 50, 50, "t", "o", 1, 0, 1, 8, "stop"),
    ]
    c.stop_reason, c.infra_error = "infra_error", "sandbox died"
    store.write("iter-000000", [a, b, c])
    notes = {e: {"learner_logprobs": [0.0] * 50, "advantages": [0.0] * 50} for e in ("e0", "e1")}
    # trained with weights two versions on
    store.write_learner("iter-000000", notes, policy_version=2)
    s = summary(tmp_path)
    assert s["staleness_max"] == [2] and s["infra_errors"] == [1] and s["iteration_ids"] == [0]


def test_a_million_token_episode_pages_from_its_own_row_group(tmp_path):
    from longhorizon.inspect import token_rows

    store = TrajectoryStore(tmp_path)
    store.write("iter-000000", [_traj(0), _traj(1, n=1_000_000), _traj(2)])
    page = token_rows(tmp_path, "e1", start=999_990, count=50)
    assert page["tokens"] == 1_000_000 and page["end"] == 1_000_000 and len(page["rows"]) == 10
    assert [r["id"] for r in page["rows"]] == list(range(999_990, 1_000_000))
    assert all(r["role"] == "generated" and r["rollout_logprob"] == -1.5 for r in page["rows"])

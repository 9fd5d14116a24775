"""Run curves: PNG files from metrics.jsonl, and the TensorBoard events the trainer writes."""

import json
import subprocess
import sys

from conftest import REPO
from longhorizon.plot import plot_run
from rl.loop.loggers import TensorBoardLog

ROWS = [
    {
        "iteration": i,
        "policy_version": i + 1,
        "mean_reward": 0.1 * i,
        "loss": 1.0 - 0.2 * i,
        "milestone_rate/product": 0.25 * i,
        "milestone_rate/solved": 0.1 * i,
        "sync_s": 0.05,
        "gen_tokens_per_s": 900 + i,
        "clip_frac": 0.01 * i,
        "stop_reasons": {"terminated": 3},
    }
    for i in range(4)
]


def _run(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return tmp_path


def test_plot_writes_one_png_per_panel(tmp_path):
    paths = plot_run(_run(tmp_path))
    # failures.png is drawn though these rows have no failure/* key: an empty plot says so
    assert sorted(p.name for p in paths) == [
        "failures.png",
        "loss.png",
        "milestones.png",
        "other.png",
        "reward.png",
        "sync.png",
        "throughput.png",
    ]
    for p in paths:
        head = p.read_bytes()[:8]
        assert head == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000


def test_metric_families_never_share_a_scale():
    """Seconds with seconds; bytes, counts and rewards each on their own axes; milestone and
    failure pages exist even when nothing was reached."""
    from longhorizon.plot import pages

    keys = [
        "mean_reward",
        "sync_bytes",
        "rollout_s",
        "iteration_s",
        "episodes",
        "infra_errors",
        "loss",
        "failure/success",
        "failure/no_tool_call",
        "policy_version",
    ]
    laid = {name: ks for name, ks, _ in pages(keys)}
    assert laid["reward"] == ["mean_reward"] and laid["loss"] == ["loss"]
    assert laid["seconds"] == ["iteration_s", "rollout_s"]
    assert laid["other"] == [
        "episodes",
        "infra_errors",
        "sync_bytes",
    ]  # drawn as small multiples, one scale each
    assert (
        laid["failures"] == ["failure/no_tool_call", "failure/success"] and laid["milestones"] == []
    )
    placed = [k for ks in laid.values() for k in ks]
    assert sorted(placed) == sorted(set(keys) - {"policy_version"})  # each once, none lost


def test_failure_shares_are_drawn_stacked(tmp_path):
    rows = [
        {
            "iteration": i,
            "mean_reward": 0.0,
            "failure/success": 0.25 * i,
            "failure/no_tool_call": 1 - 0.25 * i,
        }
        for i in range(3)
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    paths = {p.name: p for p in plot_run(tmp_path)}
    # drawn vs empty
    assert paths["failures.png"].stat().st_size > paths["milestones.png"].stat().st_size


def test_plot_cli_names_a_run_without_metrics(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "longhorizon.cli", "plot", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and "has no metrics.jsonl rows" in r.stderr
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "longhorizon.cli",
            "plot",
            str(_run(tmp_path)),
            "--out",
            str(tmp_path / "p"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0 and (tmp_path / "p" / "reward.png").exists()


def test_tensorboard_events_hold_every_numeric_metric(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = TensorBoardLog(tmp_path)
    for row in ROWS:
        tb.log(row)
    tb.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {
        "mean_reward",
        "loss",
        "milestone_rate/solved",
        "policy_version",
    } <= tags and "stop_reasons" not in tags
    assert [(e.step, round(e.value, 6)) for e in acc.Scalars("mean_reward")] == [
        (i, round(0.1 * i, 6)) for i in range(4)
    ]


def test_expert_load_is_drawn_per_layer_and_expert(tmp_path):
    """`router_load` (the learner's layers × experts shares) becomes router_load.png; a row without
    it, or with a malformed one, draws nothing of it."""
    rows = [
        {
            "iteration": i,
            "mean_reward": 0.0,
            "router_load": [[0.7 - 0.1 * i, 0.1, 0.1, 0.1 + 0.1 * i]] * 3,
        }
        for i in range(3)
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    paths = {p.name: p for p in plot_run(tmp_path)}
    assert paths["router_load.png"].stat().st_size > 5000
    bad = tmp_path / "bad"
    bad.mkdir()
    rows = [{"iteration": 0, "mean_reward": 0.0, "router_load": [[0.5, "x"]]}]
    (bad / "metrics.jsonl").write_text(json.dumps(rows[0]) + "\n")
    assert "router_load.png" not in {p.name for p in plot_run(bad)}

"""Every subcommand meets bad input with one line on stderr and exit 2 (or, for a reader that
left a pipe, a quiet exit): found by trying each command with the mistakes a user makes. The
run directories are real stores written with the project's own writer; no Ray or engine starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO
from rl.store import TrajectoryStore
from rollout.trajectory import STOP_REASONS, Trajectory, Turn


def cli(*argv: str, input: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "longhorizon.cli", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        input=input,
    )


def one_line(r: subprocess.CompletedProcess) -> str:
    assert r.returncode == 2 and r.stdout == "" and "Traceback" not in r.stderr, (
        r.returncode,
        r.stderr,
    )
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    return lines[0]


HOSTILE = "x = a[/b] [bold red]not a style[/] and [link=file:///etc/passwd]here[/link]"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A run whose episode text holds what a model may write: rich markup that is not ours."""
    d = tmp_path_factory.mktemp("run")
    n = 12
    turn = Turn(
        gen_start=2,
        gen_end=n,
        obs_end=n,
        text=HOSTILE,
        observation="[/observation]",
        tool_calls=1,
        tool_errors=0,
        policy_version=0,
        seed=7,
        finish_reason="stop",
        sandbox_events=["[red]killed[/]"],
    )
    t = Trajectory(
        episode_id="i0-g0-e0",
        iteration=0,
        group_id=0,
        env_id="tools/calculator-v0",
        seed=3,
        prompt_len=2,
        token_ids=list(range(n)),
        loss_mask=[0, 0] + [1] * (n - 2),
        rollout_logprobs=[0.0, 0.0] + [-1.0] * (n - 2),
        turns=[turn],
        milestones=[{"name": "solved", "reward": 1.0, "turn": 0, "token": n - 1}],
        reward=1.0,
        stop_reason="terminated",
        task="What is [b]6 * 7[/b]?",
    )
    TrajectoryStore(d).write("iter-000000", [t])
    (d / "metrics.jsonl").write_text(
        json.dumps({"iteration": 0, "policy_version": 1, "loss": 0.1}) + "\n"
    )
    return d


def test_an_episode_with_markup_in_its_text_is_shown_as_written(run_dir):
    r = cli("inspect", str(run_dir), "--episode", "i0-g0-e0")
    assert r.returncode == 0, r.stderr[-2000:]
    flat = " ".join(r.stdout.split())
    assert (
        "a[/b] [bold red]not a style[/]" in flat
        and "[/observation]" in flat
        and "[red]killed[/]" in flat
    )
    assert "What is [b]6 * 7[/b]?" in flat  # the task text is shown too


def test_inspect_episode_json_is_that_episode(run_dir):
    r = cli("inspect", str(run_dir), "--episode", "i0-g0-e0", "--json")
    ep = json.loads(r.stdout)
    assert (
        r.returncode == 0
        and ep["episode_id"] == "i0-g0-e0"
        and ep["task"] == "What is [b]6 * 7[/b]?"
    )
    assert ep["turns"][0]["text"] == HOSTILE and len(ep["token_ids"]) == 12
    assert "no episode 'nope'" in one_line(
        cli("inspect", str(run_dir), "--episode", "nope", "--json")
    )


def test_inspect_stop_filter_names_the_stop_reasons(run_dir):
    line = one_line(cli("inspect", str(run_dir), "--episodes", "--stop", "bogus"))
    assert "'bogus' is not a stop reason" in line and all(k in line for k in STOP_REASONS)
    rows = json.loads(
        cli("inspect", str(run_dir), "--episodes", "--stop", "terminated", "--json").stdout
    )
    assert [r["episode_id"] for r in rows] == ["i0-g0-e0"]


@pytest.mark.parametrize(
    "argv, words",
    [
        (["inspect", "{run}", "--html", "/nonexistent/dir/v.html"], "/nonexistent/dir"),
        (["plot", "{run}", "--out", "/proc/no-such/plots"], "/proc/no-such"),
        (["export", "{run}", "--format", "nope"], "invalid choice: 'nope'"),
        (["inspect", "{run}", "--bogus"], "unrecognized arguments: --bogus"),
        (
            ["envs", "play", "tools/calculator-v0", "max_turns=0"],
            "max_turns must be an integer >= 1",
        ),
        (["envs", "check", "tools/shell-v0", "backend=bwrp"], "unknown sandbox backend 'bwrp'"),
        (
            ["envs", "show", "tools/shell-v0", "timeout=3"],
            "does not take 'timeout'; its options: extra_ro, env, per_episode (the environment's own: backend, max_turns, timeout_s)",
        ),
    ],
)
def test_subcommand_mistakes_end_in_one_line(run_dir, argv, words):
    line = one_line(cli(*[a.format(run=run_dir) for a in argv]))
    assert words in line, line


def test_a_corrupt_metrics_file_is_named_with_its_line(tmp_path, run_dir):
    bad = tmp_path / "run"
    bad.mkdir()
    (bad / "trajectories").symlink_to(run_dir / "trajectories")
    (bad / "metrics.jsonl").write_text('{"iteration": 0}\n{"loss": 1}\n')
    assert f"{bad / 'metrics.jsonl'}:2: not a metrics row" in one_line(cli("inspect", str(bad)))
    assert (bad / "metrics.jsonl").read_text() == '{"iteration": 0}\n{"loss": 1}\n'  # only read


def test_envs_play_takes_plain_text_and_sums_up_at_the_end_of_input():
    """A turn without a tool call is what a model most often writes: it goes to the environment as
    typed (which answers that no tool was called); the end of input still prints the summary."""
    r = cli(
        "envs",
        "play",
        "tools/calculator-v0",
        "--seed",
        "1",
        input="there, I think the answer is 5\n",
    )
    assert r.returncode == 0, r.stderr
    assert "No tool call found" in r.stdout and "must look like key=value" not in r.stdout
    assert "episode stopped after 1 turn(s); total reward 0; milestones none" in r.stdout


def test_a_reader_that_leaves_the_pipe_gets_no_traceback():
    read, write = os.pipe()
    os.close(read)  # as `| head` does once it has its lines
    r = subprocess.run(
        [sys.executable, "-m", "longhorizon.cli", "envs", "show", "tools/calculator-v0", "--json"],
        stdout=write,
        stderr=subprocess.PIPE,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    os.close(write)
    assert r.returncode == 141 and r.stderr == ""

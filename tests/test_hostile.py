"""What a model, a run directory or a file writes is data, never code or markup: the viewer in a real
browser, the terminal, checkpoints, configs, tool calls (issue 47)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import REPO
from rl.store import TrajectoryStore
from rollout.trajectory import Trajectory, Turn


def cli(*argv, timeout=300, cwd=REPO):
    import os

    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
    }  # run from another directory, the project still imports
    return subprocess.run(
        [sys.executable, "-m", "longhorizon.cli", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env=env,
    )


def mark(name: str) -> str:
    """Script that, if it ever ran, would leave a <NAME> element in the page."""
    return f"document.body.appendChild(document.createElement('{name}'))"


def img(name: str) -> str:
    return f'<img src=x onerror="{mark(name)}">'


def hostile_episode(eid: str = "i0-g0-e0") -> Trajectory:
    """Markup and escape sequences wherever a model, an environment or a failure writes text."""
    turn = Turn(
        0,
        3,
        5,
        text=f"<!--<script>{mark('pwned-comment')}</script> {img('pwned-text')}",
        observation=f"</script><script>{mark('pwned-obs')}</script>\x1b[2J\x1b]0;title\x07",
        tool_calls=0,
        tool_errors=0,
        policy_version=0,
        seed=0,
        finish_reason=img("pwned-finish"),
        failures=[img("pwned-failure")],
        sandbox_events=[img("pwned-sandbox")],
    )
    return Trajectory(
        episode_id=eid,
        iteration=0,
        group_id=0,
        env_id="tools/calculator-v0",
        seed=1,
        prompt_len=0,
        token_ids=[1, 2, 3, 4, 5, 6],
        loss_mask=[0, 1, 1, 0, 0, 0],
        rollout_logprobs=[0.0] * 6,
        turns=[turn],
        milestones=[{"name": img("pwned-milestone"), "reward": 0.5, "turn": 0, "token": 2}],
        reward=0.5,
        stop_reason="max_turns",
        infra_error=img("pwned-infra"),
        task=f"<script>{mark('pwned-task')}</script>",
        failure="wrong_answer",
    )


def test_the_viewer_runs_no_script_a_run_wrote_and_still_draws(tmp_path):
    from conftest import chromium_flags

    run = tmp_path / "run"
    store = TrajectoryStore(run)
    store.write("iter-000000", [hostile_episode()])
    bad_name = f"iter-000007<img src=x onerror={mark('pwned-shard')}>.parquet"
    (store.dir / bad_name).write_bytes(b"not parquet")
    # a crafted record: markup where the store keeps numbers (a turn's tool_calls, a milestone's reward)
    crafted = hostile_episode("i1-g0-e0")
    crafted.iteration = 1
    vars(crafted.turns[0])["tool_calls"] = img("pwned-count")
    crafted.milestones[0]["reward"] = img("pwned-reward")
    store.write("iter-000001", [crafted])
    page = tmp_path / "viewer.html"
    made = cli("inspect", str(run), "--html", str(page))
    assert made.returncode == 0, made.stderr
    flags = chromium_flags()
    dom = subprocess.run(
        flags + ["--dump-dom", page.as_uri() + "?episode=i0-g0-e0"],
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    assert '<h1 id="episode-title">i0-g0-e0</h1>' in dom  # the page drew the episode
    assert "corrupt shards skipped" in dom and "turn 0" in dom
    # the crafted one is refused
    assert "iter-000001.parquet" in dom.split("corrupt shards skipped")[1][:2000]
    for name in (
        "comment",
        "text",
        "obs",
        "finish",
        "failure",
        "sandbox",
        "count",
        "milestone",
        "reward",
        "infra",
        "task",
        "shard",
    ):
        assert f"<pwned-{name}>" not in dom, f"script from the run ran ({name})"
    assert "&lt;script&gt;" in dom  # shown as text


def test_the_terminal_shows_escape_sequences_a_run_wrote_and_never_obeys_them(tmp_path):
    """`inspect` (the run, an episode), `replay` and error lines print what a model wrote with its
    control characters made visible: no escape sequence, carriage return or bidi override reaches
    the terminal."""
    run = tmp_path / "run"
    store = TrajectoryStore(run)
    t = hostile_episode()
    t.turns[
        0
    ].text = "clear\x1b[2J up\x1b[1A\x1b[2K over\r written \u202eesrever\x1b]8;;http://x\x07link"
    store.write("iter-000000", [t])
    (store.dir / "iter-000001\x1b[31mred.parquet").write_bytes(b"garbage")
    (run / "config.yaml").write_text("env:\n  id: tools/calculator-v0\n")
    for argv in (
        ["inspect", str(run)],
        ["inspect", str(run), "--episode", "i0-g0-e0"],
        ["replay", str(run), "--all", "--skip-corrupt"],
    ):
        out = cli(*argv)
        shown = out.stdout + out.stderr
        assert not any(c in shown for c in "\x1b\r\x07\u202e"), (argv, shown[:400])
        if "--episode" in argv:
            assert "\\x1b[2J" in shown and "\\u202e" in shown and out.returncode == 0
    replayed = cli("replay", str(run), "--all", "--skip-corrupt")
    assert "not replayed: it never ran" in replayed.stdout  # its infra error, quoted
    assert "\\x1b[31mred" in replayed.stderr  # the corrupt shard's name, shown, not obeyed


@pytest.fixture(scope="module")
def saved_run(tiny_policy, tmp_path_factory):
    """A run directory with two real learner checkpoints (versions 1 and 2) and its config."""
    from rl.config import AlgoConfig, LearnerConfig, dump_config, load_config
    from rl.learner.learner import Learner

    run = tmp_path_factory.mktemp("saved-run")
    learner = Learner(tiny_policy, AlgoConfig(), LearnerConfig(threads=1), seed=0)
    for v in (1, 2):
        learner.version = v
        learner.save_checkpoint(str(run / "checkpoints" / f"version-{v:06d}"), {"iteration": v - 1})
    dump_config(load_config(None, [f"policy.path={tiny_policy}"]), run / "config.yaml")
    return run


def damaged(saved_run, tmp_path, how):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(saved_run, run)
    how(run / "checkpoints" / "version-000002")
    return run


class Boom:
    def __reduce__(self):
        import os

        return os.system, ("touch PWNED",)


@pytest.mark.parametrize(
    "case", ["weights missing", "weights truncated", "state garbage", "state runs code"]
)
def test_resume_from_a_damaged_checkpoint_names_the_file_and_the_intact_one(
    saved_run, tmp_path, case
):
    import pickle
    import time

    def harm(ckpt):
        weights = next(ckpt.glob("*.safetensors"))
        if case == "weights missing":
            weights.unlink()
        elif case == "weights truncated":
            weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
        elif case == "state garbage":
            (ckpt / "trainer_state.pt").write_bytes(b"\x00garbage" * 1000)
        else:  # a crafted trainer state: unpickling it would run a shell command
            (ckpt / "trainer_state.pt").write_bytes(
                pickle.dumps({"version": 2, "iteration": 1, "x": Boom()})
            )

    run = damaged(saved_run, tmp_path, harm)
    before = sorted(p.relative_to(run) for p in run.rglob("*"))
    t0 = time.monotonic()
    out = cli("train", "--resume", str(run), cwd=tmp_path)
    assert out.returncode == 2 and time.monotonic() - t0 < 60
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: cannot resume from version-000002"), (
        out.stderr
    )
    assert "version-000002/" in lines[0] and "Traceback" not in out.stderr
    assert f"--resume {run} --checkpoint version-000001" in lines[0]
    assert not (tmp_path / "PWNED").exists() and not (REPO / "PWNED").exists()
    # nothing moved, nothing deleted
    assert sorted(p.relative_to(run) for p in run.rglob("*")) == before
    assert not (run / "metrics.jsonl").exists() and not any(run.glob("*.log"))


def test_the_intact_checkpoint_named_by_the_error_is_the_one_resumed(saved_run, tmp_path):
    from rl.learner.checkpoints import CheckpointError, checkpoint_problem, resume_point

    run = damaged(saved_run, tmp_path, lambda c: (c / "config.json").unlink())
    with pytest.raises(CheckpointError, match="config.json: missing"):
        resume_point(run)
    assert resume_point(run, "version-000001") == run / "checkpoints" / "version-000001"
    assert checkpoint_problem(run / "checkpoints" / "version-000001") is None
    with pytest.raises(CheckpointError, match="no such checkpoint"):
        resume_point(run, "version-000009")


def test_yaml_aliases_and_repeated_keys_are_refused_in_one_short_line(tmp_path):
    import time

    levels = ['a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    levels += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 10)]
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text("\n".join(levels) + "\nseed: *a9\n")  # ~1 KB, 9^10 strings if expanded
    twice = tmp_path / "twice.yaml"
    twice.write_text("seed: 1\niterations: 2\nseed: 3\n")
    t0 = time.monotonic()
    for path, why in (
        (bomb, "YAML aliases (*a0) are not accepted"),
        (twice, "line 3: key 'seed' is given twice"),
    ):
        out = cli("train", str(path))
        assert out.returncode == 2 and why in out.stderr and len(out.stderr.splitlines()) == 1, (
            out.stderr
        )
    assert time.monotonic() - t0 < 60
    huge = "x" * 100_000  # an argument, below the kernel's limit on one
    out = cli("train", "configs/quickstart.yaml", f"seed={huge}")
    assert out.returncode == 2 and "seed must be int" in out.stderr and len(out.stderr) < 400
    out = cli("train", "configs/quickstart.yaml", "seed=[*a]")
    assert out.returncode == 2 and len(out.stderr.splitlines()) == 1


def test_a_call_that_does_not_fit_its_tool_is_answered_with_the_tool_s_signature(tmp_path):
    """Through `envs play` (a real sandboxed shell) and the agent loop: a missing, unknown or mistyped
    argument is a tool_error answered with what the tool takes, never a Python exception's text;
    numbers written as strings still pass. Replay of a record written before the check existed
    (schema 5) replays it as it ran; the same record claimed as schema 6 departs."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    import envs
    from longhorizon.replay import replay_episode

    played = subprocess.run(
        [sys.executable, "-m", "longhorizon.cli", "envs", "play", "tools/shell-v0"],
        input='bash {}\nbash {"command": 7}\nbash {"cmd": "ls"}\n',
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    out = played.stdout
    assert "bash: missing command. Call it as bash(command: string)" in out
    assert "bash: command must be string" in out and 'unknown argument "cmd"' in out
    assert "TypeError" not in out and "_bash()" not in out
    env = envs.make("tools/calculator-v0")
    env.reset(seed=3)
    _, _, done, _, info = env.step(
        '<tool_call>{"name": "submit", "arguments": {"answer": "57"}}</tool_call>'
    )
    assert done and info["failures"] == []  # "57" is a number as a model writes it
    env.reset(seed=3)
    _, _, done, _, info = env.step(
        '<tool_call>{"name": "submit", "arguments": {"answer": "many"}}</tool_call>'
    )
    assert not done and info["failures"] == ["tool_error"]
    assert (
        info["messages"][0]["content"]
        == "error: submit: answer must be number. Call it as submit(answer: number)"
    )

    old_text = "error: calculator failed: TypeError: CalculatorEnv._calculator() got an unexpected keyword argument 'x'"
    task, _ = env.reset(seed=3)
    turn = Turn(
        0,
        2,
        3,
        text='<tool_call>{"name": "calculator", "arguments": {"x": "1"}}</tool_call>',
        observation=old_text,
        tool_calls=1,
        tool_errors=1,
        policy_version=0,
        seed=0,
        finish_reason="stop",
        failures=["tool_error"],
    )
    t = Trajectory(
        episode_id="old",
        iteration=0,
        group_id=0,
        env_id="tools/calculator-v0",
        seed=3,
        prompt_len=0,
        token_ids=[1, 2, 3],
        loss_mask=[0, 1, 0],
        rollout_logprobs=[0.0] * 3,
        turns=[turn],
        task=task,
        stop_reason="max_turns",
        failure="tool_error",
    )
    store = TrajectoryStore(tmp_path)
    path = store.write("iter-000000", [t])
    table = pq.read_table(path)
    pq.write_table(
        table.set_column(0, "schema_version", pa.array([5], pa.int32())), tmp_path / "old.parquet"
    )
    path.unlink()
    (tmp_path / "old.parquet").rename(path)
    (old,) = store.trajectories()
    assert old.stored_schema == 5 and replay_episode(old).ok
    old.stored_schema = 6
    assert not replay_episode(old).ok


@pytest.mark.slow
def test_a_worker_killed_during_the_initial_evaluation_is_restored_and_the_evaluation_finished(
    ray_cluster, tiny_policy, tmp_path
):
    """The held-out evaluation before RL is never skipped: the rollout worker killed while it plays
    its share is restored (Ray restarts it, the driver syncs it) and the share is played again, so
    eval-initial.json holds every episode; the run then trains as usual."""
    import json
    import threading
    import time

    import ray

    from conftest import started_trainer

    overrides = [
        f"policy.path={tiny_policy}",
        "iterations=1",
        "rollout.num_workers=1",
        "rollout.cpus_per_worker=0.25",
        "rollout.groups_per_iteration=1",
        "rollout.group_size=2",
        "eval.every=1",
        "eval.episodes=8",
        "env.kwargs={max_turns: 4, step_latency_s: 0.4}",
    ]  # slow tools: the evaluation lasts seconds
    with started_trainer("quickstart.yaml", overrides, tmp_path / "run") as trainer:
        worker = trainer.workers[0]
        killed = threading.Event()

        def kill_mid_evaluation():
            time.sleep(2.0)
            # Ray restarts it (ray.max_restarts); its engine starts again
            ray.kill(worker, no_restart=False)
            killed.set()

        threading.Thread(target=kill_mid_evaluation, daemon=True).start()
        rows = trainer.run()
        assert killed.is_set()
    initial = json.loads((tmp_path / "run" / "eval-initial.json").read_text())
    assert initial["eval/episodes"] == 8 and trainer.worker_restarts >= 1
    assert len(rows) == 1 and rows[0]["eval/episodes"] == 8


def test_a_run_directory_that_cannot_be_written_is_one_line_before_anything_starts(tmp_path):
    """As a user who may not write there (root writes anywhere, so the command runs as `nobody`):
    `train` and `demo` stop with one line and exit 2, nothing started, no traceback."""
    import os
    import shutil

    if shutil.which("setpriv") is None:
        pytest.fail("setpriv (util-linux) is needed to run the command as another user")
    locked = tmp_path / "locked"
    locked.mkdir()
    os.chmod(tmp_path, 0o755)
    os.chmod(locked, 0o755)  # owned by root: nobody may not write in it
    for argv in (
        ["train", "configs/quickstart.yaml", "--run-dir", str(locked / "run")],
        ["demo", "--out", str(locked / "demo"), "--config", "configs/demo/digits.yaml"],
    ):
        out = subprocess.run(
            [
                "setpriv",
                "--reuid=65534",
                "--regid=65534",
                "--clear-groups",
                sys.executable,
                "-m",
                "longhorizon.cli",
                *argv,
            ],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=REPO,
            env={**os.environ, "HOME": str(tmp_path)},
        )
        assert out.returncode == 2 and "cannot be written (Permission denied)" in out.stderr, (
            out.stderr[-2000:]
        )
        assert len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr
    assert list(locked.iterdir()) == []


def test_a_file_size_kill_is_named_even_when_the_shell_line_ends_well():
    """`longhorizon sandbox run`: a writer killed at the file-size limit inside a shell line whose last
    command succeeds (exit 0) is reported as the file_size limit, not as nothing; a later call that
    writes a small file beside the big one is not."""
    import json as _json

    out = cli(
        "sandbox",
        "run",
        "--",
        "sh",
        "-c",
        "head -c 40000000 /dev/zero > big 2>/dev/null; echo written",
    )
    result = _json.loads(out.stdout)
    assert out.returncode == 0 and result["exit_code"] == 0 and result["resource"] == "file_size", (
        result
    )
    from envs.sandbox import Limits, open_sandbox

    with open_sandbox("bwrap", limits=Limits(file_mb=1)) as sb:
        assert sb.run("head -c 5000000 /dev/zero > big 2>/dev/null; true").resource == "file_size"
        assert sb.run("echo small > small").resource is None


@pytest.mark.slow
def test_a_driver_killed_with_sigkill_leaves_no_ray_process_behind(tmp_path):
    """A driver that started a local Ray (and an actor, so the raylet has a worker) is killed with
    SIGKILL: within 30 s none of the Ray processes it started, nor any below them, still runs."""
    import json as _json
    import os
    import signal
    import time

    from rl.ray_reaper import _is_ray, _tree

    script = tmp_path / "driver.py"
    script.write_text(
        "import json, os, time\n"
        "os.environ['RAY_AUTH_MODE'] = 'disabled'\n"
        "import ray\n"
        "from rl.config import RayConfig\n"
        "from rl.ray_utils import init_ray\n"
        "init_ray(RayConfig(num_cpus=1, object_store_mb=100))\n"
        "@ray.remote\n"
        "class A:\n"
        "    def pid(self):\n"
        "        return os.getpid()\n"
        "a = A.remote()\n"
        "ray.get(a.pid.remote())\n"
        "node = ray._private.worker._global_node\n"
        "print(json.dumps([p.process.pid for ps in node.all_processes.values() for p in ps]), flush=True)\n"
        "time.sleep(600)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, str(script)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    roots = _json.loads(proc.stdout.readline())
    started = [p for p in _tree(roots) if _is_ray(p)]
    assert len(started) >= 5  # GCS, raylet, dashboard, log monitor, monitor, and the raylet's own
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(_is_ray(p) for p in started):
        time.sleep(0.5)
    assert not [p for p in started if _is_ray(p)], "Ray processes outlived their driver"


def test_the_memory_limit_holds_for_the_whole_sandbox():
    """Seven processes of 100 MB each under a 256 MiB limit: with a cgroup (what this machine allows:
    `memory_scope`), the kernel kills some of them and the result names the memory limit, though
    each process stayed below it and the shell line ended well. Without one, the fallback says so."""
    import json as _json

    cmd = 'for i in 1 2 3 4 5 6 7; do python3 -c "a = bytearray(100 << 20); import time; time.sleep(3)" & done; wait; echo ok'
    out = cli("sandbox", "run", "--memory", "256", "--timeout", "30", "--", "sh", "-c", cmd)
    result = _json.loads(out.stdout)
    if result["memory_scope"].startswith("the whole sandbox"):
        assert result["resource"] == "memory" and result["exit_code"] == 0, result
        assert any("256 MiB for all its processes" in e for e in result["events"])
    else:  # a machine where no cgroup can be made: each process alone is bounded, and it says so
        assert result["memory_scope"] == "each process (RLIMIT_AS)" and result["resource"] is None
    helped = cli("sandbox", "run", "--help")
    assert "for the whole sandbox where a cgroup can be made" in " ".join(helped.stdout.split())


@pytest.mark.slow
def test_a_one_iteration_run_whose_every_episode_failed_does_not_end_green(tiny_policy, tmp_path):
    """`longhorizon train` for one iteration of an environment whose every reset fails (a plugin's
    demo/crash-v0): below the guard's two failed iterations in a row, and still the run ends with
    the failure quoted and a non-zero exit, not `done:`."""
    import os

    target = tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(target),
            str(REPO / "tests" / "plugins" / "lh_demo_plugin"),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    env = {**os.environ, "PYTHONPATH": f"{target}{os.pathsep}{REPO}"}
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "longhorizon.cli",
            "train",
            "configs/quickstart.yaml",
            "--run-dir",
            str(tmp_path / "run"),
            f"policy.path={tiny_policy}",
            "env.id=demo/crash-v0",
            "env.kwargs={}",
            "iterations=1",
            "rollout.num_workers=1",
            "rollout.max_turns=1",
        ],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=REPO,
        env=env,
    )
    assert out.returncode == 1, out.stderr[-3000:]
    line = out.stderr.strip().splitlines()[-1]
    assert line.startswith(
        "error: the run cannot learn: its last 1 iteration(s) failed; 16 of 16 episodes of "
        "iteration 0 ended in infrastructure errors, the first: reset: RuntimeError: the task "
        "server is down"
    ), line
    assert (
        "done" not in out.stderr.split("error:")[-1]
        and (tmp_path / "run" / "metrics.jsonl").exists()
    )

"""The five built-in environments, check_env, the plugin path, the EnvWorker and the envs/sandbox CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import envs
from conftest import REPO
from envs.check import EnvCheckError, check_env
from envs.env_worker import EnvWorker
from envs.sandbox import SandboxError
from envs.tool_calls import format_tool_call as call

BUILTIN = {  # id -> (constructor arguments for the test, milestones the expert reaches, its total reward)
    "tools/calculator-v0": ({}, {"product", "solved"}, 1.25),
    "tools/shell-v0": ({}, {"matches", "count", "solved"}, 1.0),
    "code/fix-tests-v0": ({}, None, 1.0),
    "long/needle-v0": ({}, {"found", "solved"}, 1.25),
    "vision/maze-v0": ({"size": 7, "max_turns": 20}, {"waypoint_1", "waypoint_2", "exit"}, 1.0),
    "text/digits-v0": ({}, {"digits"}, 1.0),
    "long/oncall-v0": ({"horizon": 12}, "found:*, named:*, solved", 1.0),
}


def cli(*args, input=None, env=None):
    return subprocess.run(
        [sys.executable, "-m", "longhorizon.cli", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        input=input,
        env=env,
        timeout=300,
    )


def test_every_builtin_is_registered():
    assert set(BUILTIN) <= {s.id for s in envs.list_specs()}


@pytest.mark.parametrize("env_id", sorted(BUILTIN))
@pytest.mark.parametrize("seed", [0, 7])
def test_check_env_and_expert_solves(env_id, seed):
    kwargs, milestones, total = BUILTIN[env_id]
    env = envs.make(env_id, **kwargs)
    report = check_env(env, seed=seed)
    assert report["expert_reward"] == pytest.approx(total)
    if isinstance(milestones, str):  # one found and one named per failing service, then solved
        names = report["expert_milestones"]
        assert {m.split(":")[0] for m in names} == {"found", "named", "solved"} and names[
            -1
        ] == "solved"
        assert (
            sum(m.startswith("found:") for m in names)
            == sum(m.startswith("named:") for m in names)
            >= 4
        )
    elif milestones is not None:
        assert set(report["expert_milestones"]) == milestones
    else:  # one milestone per test that was broken
        assert all(m.startswith("pass:test_") for m in report["expert_milestones"])
        assert len(report["expert_milestones"]) == 2


def _fingerprint(env, seed: int) -> bytes:
    """The task as made for `seed`: its text, its images and the files of its workspace."""
    obs, info = env.reset(seed=seed)
    parts = [obs.encode()] + [img.tobytes() for img in info.get("images", [])]
    if getattr(env, "sandbox", None) is not None:
        parts += [p.read_bytes() for p in sorted(env.sandbox.path.rglob("*")) if p.is_file()]
    return b"\0".join(parts)


@pytest.mark.parametrize("env_id", sorted(BUILTIN))
def test_deterministic_given_seed(env_id):
    kwargs = BUILTIN[env_id][0]
    a, b = envs.make(env_id, **kwargs), envs.make(env_id, **kwargs)
    try:
        assert _fingerprint(a, 3) == _fingerprint(b, 3)
        assert len({_fingerprint(a, s) for s in range(6)}) > 3
    finally:
        a.close()
        b.close()


def test_no_reward_without_milestones():
    env = envs.make("tools/shell-v0")
    env.reset(seed=1)
    _, r, term, _, info = env.step(
        call("bash", command="mkdir -p report && echo 0 > report/count.txt")
    )
    assert r == 0 and info["milestones"] == [] and not term
    _, r, term, _, info = env.step(call("submit"))
    assert r == 0 and term and info["messages"][0]["content"].startswith("rejected")
    env.close()


def test_shell_env_contains_hostile_commands_and_keeps_serving():
    # room for the fork bomb to exhaust itself on a loaded machine
    env = envs.make("tools/shell-v0", timeout_s=10)
    env.reset(seed=2)
    workspace = env.sandbox.path
    for cmd, limit in [
        ("python3 -c 'import os\nwhile True: os.fork()'", "processes"),
        ("python3 -c 'while True: pass'", "cpu_time"),
        ("yes", "output"),
    ]:
        obs, r, term, trunc, info = env.step(call("bash", command=cmd))
        assert f"{limit} limit reached" in obs, obs
        assert any(limit in e for e in info["sandbox_events"])
        assert not term and "infra_error" not in info
    obs, *_ = env.step(call("bash", command="kill -9 -1; ls logs | wc -l"))
    assert "exit code" in obs
    for turn in env.expert_turns():  # still works: the expert solves it in the same episode
        obs, r, term, trunc, info = env.step(turn)
    assert term and obs == "accepted"
    env.close()
    assert not workspace.exists()


def test_fix_tests_protects_its_tests():
    env = envs.make("code/fix-tests-v0")
    env.reset(seed=4)
    cheat = "def test_x():\n    pass\n"
    for path in ("test_textkit.py", "conftest.py", "sub/pytest.ini"):
        obs, *_ = env.step(call("write_file", path=path, content=cheat))
        assert "cannot be changed" in obs
    obs, *_ = env.step(call("write_file", path="../escape.py", content="x"))
    assert "inside the workspace" in obs
    obs, r, *_ = env.step(call("run_tests"))
    assert obs.startswith("2/4 tests pass") and r == 0
    env.close()


def test_needle_scales_to_a_million_tokens():
    env = envs.make("long/needle-v0", corpus_tokens=1_000_000)
    obs, _ = env.reset(seed=5)
    assert "2500 documents (1,000,000 words)" in obs
    assert sum(len(d.split(" ")) for d in env.docs) == 1_000_000 + 7 * env.vaults
    total = sum(env.step(t)[1] for t in env.expert_turns())
    assert total == pytest.approx(1.25)


def test_maze_shows_images_and_walls():
    env = envs.make("vision/maze-v0", size=5, cell_px=6)
    obs, info = env.reset(seed=1)
    img = info["images"][0]
    assert img.shape == (31, 31, 3) and img.dtype == np.uint8
    assert tuple(img[3, 3]) == (230, 30, 30)  # the walker, top-left
    obs, r, *_ = env.step(call("move", direction="up"))  # the top-left cell has no way up
    assert obs.startswith("blocked") and r == 0
    obs, *_ = env.step(call("move", direction="sideways"))
    assert "direction must be one of" in obs


def test_check_env_names_every_problem():
    class Broken(envs.ToolEnv):
        tools = [envs.ToolSpec("a", "x", {"type": "string"})]

        resets = 0

        def _reset_task(self):  # a task that changes at every reset, whatever the seed
            self.resets += 1
            return f"task {self.resets}"

        def tool_functions(self):
            return {}

    with pytest.raises(EnvCheckError) as err:
        check_env(Broken())
    text = str(err.value)
    assert 'parameters must be a JSON schema with "type": "object"' in text
    assert "tools without a function in tool_functions(): ['a']" in text
    assert "must be deterministic given a seed" in text
    # "ok" would be a lie for a warm start
    assert "no scripted expert: define expert_turns()" in text
    assert "declares no milestones: set the class attribute `milestones`" in text
    with pytest.raises(EnvCheckError) as err:
        # `envs check --no-expert`: everything else is still checked
        check_env(Broken(), expert=False)
    assert "no scripted expert" not in str(err.value) and "deterministic" in str(err.value)


def test_milestones_are_declared_in_code_shown_and_checked():
    """`envs show --json` lists what each built-in environment pays, from its class (no episode run);
    an expert that reaches a milestone the class does not declare fails `check_env`."""
    shown = json.loads(cli("envs", "show", "tools/calculator-v0", "--json").stdout)
    assert shown["milestones"] == [
        {
            "name": "product",
            "reward": 0.25,
            "description": "a calculator result equals a * b, the first intermediate value",
        },
        {"name": "solved", "reward": 1.0, "description": "the submitted answer is right"},
    ]
    for spec in envs.list_specs():  # agent programs report what they reached when they return
        cls = envs.env_class(spec.id)
        assert envs.is_agent_program(cls) or cls.milestones, f"{spec.id} declares no milestones"
    text = cli("envs", "show", "code/fix-tests-v0").stdout
    assert "milestones:\n  pass:* (varies): a test that started out failing passes" in text

    from envs.calculator import CalculatorEnv

    class Sneaky(CalculatorEnv):
        milestones = (envs.Milestone("solved", 1.0, "right answer"),)  # `product` left out

    with pytest.raises(
        EnvCheckError, match=r"reached milestones the environment does not declare: \['product'\]"
    ):
        check_env(Sneaky(), seed=1)


def test_infra_errors_are_reported_not_raised():
    worker = EnvWorker(
        "tools/shell-v0", {"backend": "docker", "docker_host": "unix:///nonexistent/docker.sock"}
    )
    obs, info = worker.reset(0, seed=1)
    assert "no Docker engine reachable" in info["infra_error"]
    out = worker.step(0, call("submit"))  # the slot was dropped; stepping it is reported too
    assert out[3] and "infra_error" in out[4]

    env = envs.make("tools/shell-v0")
    env.reset(seed=1)

    def broken_run(*a, **k):
        raise SandboxError("bwrap vanished")

    env.sandbox.run = broken_run
    _, r, term, trunc, info = env.step(call("bash", command="ls"))
    assert info["infra_error"] == "bash: bwrap vanished" and r == 0
    env.close()


def test_env_worker_actor_steps_concurrently_and_survives_hostile_calls(ray_cluster):
    from envs.env_worker import EnvWorkerActor

    actor = EnvWorkerActor.remote("tools/shell-v0", {"timeout_s": 10})
    for slot in range(3):
        ray_cluster.get(actor.reset.remote(slot, seed=slot))
    hostile = [
        (0, call("bash", command="python3 -c 'import os\nwhile True: os.fork()'")),
        (1, call("bash", command="sleep 100")),
        (2, call("bash", command="mkdir -p report && echo hi")),
    ]
    results = ray_cluster.get(actor.step_many.remote(hostile))
    assert "processes limit reached" in results[0][0]
    assert "timed out" in results[1][0]
    assert "hi" in results[2][0]
    assert ray_cluster.get(actor.stats.remote()) == {"slots": 3, "failures": 0}
    ray_cluster.get(actor.close.remote())
    ray_cluster.kill(actor)


def test_plugin_package_is_found_by_entry_point_and_imported_lazily(tmp_path):
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
    probe = (
        "import sys, envs; ids = [s.id for s in envs.list_specs()]; "
        "assert 'demo/echo-v0' in ids, ids; assert 'lh_demo_plugin' not in sys.modules; "
        "e = envs.make('demo/echo-v0'); print(type(e).__module__, envs.check_env(e)['expert_reward'])"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["lh_demo_plugin.echo", "1.0"]
    r = cli("envs", "check", "demo/echo-v0", env=env)
    assert r.returncode == 0 and "expert reward 1.0" in r.stdout, r.stderr
    listing = json.loads(cli("envs", "list", "--json", env=env).stdout)
    assert {
        "id": "demo/echo-v0",
        "entry_point": "lh_demo_plugin.echo:EchoEnv",
        "kwargs": {},
    } in listing
    # a plugin's own check of its argument values (kwargs_problem), as docs/environments.md shows:
    # `envs check` with the run's values, then a run whose config has a bad one stops at load
    assert cli("envs", "check", "demo/words-v0", "words=rivers", env=env).returncode == 0
    bad = cli("envs", "check", "demo/words-v0", "words=fruits", env=env)
    assert bad.returncode == 2 and "words must be one of fruit, rivers, not 'fruits'" in bad.stderr
    run_dir = tmp_path / "run"
    train = cli(
        "train",
        str(REPO / "configs" / "quickstart.yaml"),
        "--run-dir",
        str(run_dir),
        "env.id=demo/words-v0",
        "env.kwargs={words: fruits}",
        env=env,
    )
    assert train.returncode == 2 and train.stderr.count("\n") == 1, train.stderr
    assert "env.kwargs is wrong: environment 'demo/words-v0': words must be one of" in train.stderr
    assert not run_dir.exists()  # stopped before anything started or was written


def test_cli_sandbox_run_and_envs_commands(tmp_path):
    r = cli(
        "sandbox",
        "run",
        "--timeout",
        "2",
        "--workspace",
        str(tmp_path),
        "--",
        "sh",
        "-c",
        "echo hi > f; sleep 5",
    )
    res = json.loads(r.stdout)
    assert (
        r.returncode == 0
        and res["timed_out"]
        and res["resource"] == "wall_time"
        and res["backend"] == "bwrap"
    )
    assert (tmp_path / "f").read_text() == "hi\n"
    r = cli("sandbox", "run", "--backend", "vm", "--", "true")
    assert r.returncode == 2 and "unknown sandbox backend 'vm'" in r.stderr
    r = cli("envs", "show", "code/fix-tests-v0", "--json")
    shown = json.loads(r.stdout)
    assert [t["name"] for t in shown["tools"]] == ["read_file", "write_file", "run_tests", "submit"]
    r = cli("envs", "check", "tools/nope-v0")
    assert r.returncode == 2 and "unknown environment 'tools/nope-v0'" in r.stderr
    env = envs.make("tools/calculator-v0")
    env.reset(seed=1)
    typed = f"calculator expression='{env.a} * {env.b}'\nsubmit answer={env.answer}\n"
    r = cli("envs", "play", "tools/calculator-v0", "--seed", "1", input=typed)
    assert "milestone product +0.25" in r.stdout and "milestone solved +1" in r.stdout
    assert "total reward 1.25" in r.stdout


@pytest.mark.parametrize("env_id", ["tools/shell-v0", "code/fix-tests-v0"])
def test_sandboxed_envs_on_the_docker_backend(env_id, docker_host):
    env = envs.make(env_id, backend="docker", docker_host=docker_host)
    report = check_env(env, seed=1)
    assert report["expert_reward"] == pytest.approx(1.0)

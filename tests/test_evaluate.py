"""Held-out evaluation: the Wilson interval, seeds disjoint from training's, success by each
environment's own rule, pass@k; `longhorizon eval` on a run directory; evaluation during training."""

import json
import subprocess
import sys

import pytest
from test_agent_loop import ExpertPolicy

import envs
from conftest import REPO
from rl.config import load_config
from rl.loop.episodes import iteration_tasks
from rl.loop.evaluate import HELD_OUT, eval_tasks, evaluate, summarise, wilson
from rollout.chat import ChatFormat


def test_wilson_interval_values():
    assert wilson(5, 10) == pytest.approx((0.2366, 0.7634), abs=1e-4)
    assert wilson(8, 8) == pytest.approx((0.6756, 1.0), abs=1e-4)
    lo, hi = wilson(0, 200)
    assert lo == 0.0 and hi == pytest.approx(0.01884, abs=1e-4)
    assert wilson(0, 0) == (0.0, 1.0)


def test_held_out_seeds_never_meet_training_seeds():
    tasks = eval_tasks(200, k=2)
    assert (
        len(tasks) == 200
        and len({t.seed for t in tasks}) == 100
        and min(t.seed for t in tasks) >= HELD_OUT
    )
    for seed in (
        0,
        1,
        12345,
        2**30,
    ):  # training seeds are masked to 31 bits, whatever the run's seed
        cfg = load_config(REPO / "configs" / "quickstart.yaml", [f"seed={seed}"])
        assert all(
            t.seed < HELD_OUT for i in range(50) for t in iteration_tasks(cfg.rollout, cfg.seed, i)
        )


def test_success_follows_each_environments_rule():
    from rollout.trajectory import Trajectory

    def traj(env, milestones, reward, infra=""):
        return Trajectory(
            episode_id="e",
            iteration=-1,
            group_id=0,
            env_id=env,
            seed=0,
            prompt_len=1,
            token_ids=[1],
            loss_mask=[0],
            rollout_logprobs=[0.0],
            milestones=milestones,
            reward=reward,
            infra_error=infra,
        )

    calc = [
        traj("tools/calculator-v0", [{"name": "product", "reward": 0.25}], 0.25),
        traj("tools/calculator-v0", [{"name": "solved", "reward": 1.0}], 1.0),
        traj("tools/calculator-v0", [], 0.0, infra="sandbox died"),
    ]
    s = summarise("tools/calculator-v0", calc)
    assert (s["episodes"], s["success"], s["infra_errors"]) == (2, 0.5, 1)
    assert s["milestones_mean"] == 1.0 and s["ci95"] == pytest.approx(list(wilson(1, 2)))
    maze = summarise(
        "vision/maze-v0", [traj("vision/maze-v0", [{"name": "exit", "reward": 0.5}], 0.5)]
    )
    assert maze["success"] == 1.0
    digits = summarise(
        "text/digits-v0", [traj("text/digits-v0", [{"name": "digits", "reward": 0.9}], 0.9)]
    )
    assert digits["success"] == 0.0


def test_the_expert_solves_every_held_out_task(tokenizer):
    chat = ChatFormat(tokenizer)
    tasks = eval_tasks(8)
    expert = ExpertPolicy(chat, [t.seed for t in tasks])
    summary, trajs = evaluate(
        expert,
        chat,
        "tools/calculator-v0",
        8,
        max_turns=5,
        max_new_tokens=64,
        max_episode_tokens=4096,
    )
    assert len(trajs) == 8 and {t.seed for t in trajs} == {HELD_OUT + i for i in range(8)}
    assert summary["success"] == 1.0 and summary["episodes"] == 8 and "pass@1" not in summary
    assert summary["ci95"] == pytest.approx(list(wilson(8, 8)))
    assert summary["milestones_mean"] == 2.0  # product and solved


def test_pass_at_k_counts_seeds_with_any_success():
    from rollout.trajectory import Trajectory

    solved, missed = [{"name": "solved", "reward": 1.0}], []
    trajs = [
        Trajectory(
            episode_id=f"e{i}",
            iteration=-1,
            group_id=g,
            env_id="tools/calculator-v0",
            seed=HELD_OUT + g,
            prompt_len=1,
            token_ids=[1],
            loss_mask=[0],
            rollout_logprobs=[0.0],
            milestones=m,
            reward=float(bool(m)),
        )
        for i, (g, m) in enumerate([(0, missed), (0, solved), (1, missed), (1, missed)])
    ]
    s = summarise("tools/calculator-v0", trajs, k=2)
    assert s["success"] == 0.25 and s["pass@2"] == 0.5


def assert_one_summary(
    success: float, ci95: list, pass_at_2: float, episodes: int, seeds: int
) -> None:
    """The figures of one evaluation describe one set of episodes: a whole number of wins, the
    Wilson interval of exactly that count, and a pass@2 (seeds with a win) that those wins allow:
    at least one seed per two wins, at most one per win."""
    wins = success * episodes
    assert wins == pytest.approx(round(wins)), success
    wins = round(wins)
    assert ci95 == pytest.approx(list(wilson(wins, episodes)))
    solved = pass_at_2 * seeds
    assert solved == pytest.approx(round(solved)), pass_at_2
    assert -(-wins // 2) <= round(solved) <= min(wins, seeds), (wins, pass_at_2)


@pytest.mark.slow
def test_eval_cli_on_a_run_directory(e2e_run):
    _, _, run_dir = e2e_run
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "longhorizon.cli",
            "eval",
            str(run_dir),
            "--episodes",
            "6",
            "--k",
            "2",
            "--json",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["env_id"] == "tools/calculator-v0" and out["episodes"] == 6 and out["k"] == 2
    assert out["policy"].endswith("checkpoints/version-000002")  # the run's newest weights
    assert_one_summary(out["success"], out["ci95"], out["pass@2"], episodes=6, seeds=3)
    bad = subprocess.run(
        [sys.executable, "-m", "longhorizon.cli", "eval", str(run_dir / "nope")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "neither a run directory nor a checkpoint" in bad.stderr
    ckpt = run_dir / "checkpoints" / "version-000002"
    bad = subprocess.run(
        [sys.executable, "-m", "longhorizon.cli", "eval", str(ckpt)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "--env is required" in bad.stderr


@pytest.mark.slow
def test_training_evaluates_on_held_out_seeds(e2e_run):
    _, rows, _ = e2e_run
    for row in rows:  # eval.every=1, 6 episodes as 3 seeds × 2
        assert row["eval/episodes"] == 6 and row["eval/policy_version"] == row["policy_version"]
        assert_one_summary(
            row["eval/success"],
            [row["eval/ci95_low"], row["eval/ci95_high"]],
            row["eval/pass@2"],
            episodes=6,
            seeds=3,
        )
        assert row["eval/s"] > 0
    assert envs.env_class("tools/calculator-v0").succeeded([{"name": "solved"}], 1.0)


def test_eval_of_a_run_without_checkpoints_serves_the_policy_rl_started_from(tmp_path):
    """`longhorizon eval RUN_DIR` before any checkpoint: the warm-started model, else the pretrained
    model the config names (its cached upcycled copy), else the path or the tiny model made."""
    from longhorizon.serve import initial_policy as _initial_policy
    from rl.config import RunConfig
    from rl.start.pretrained import dense

    cfg = RunConfig()
    assert _initial_policy(cfg, tmp_path) == tmp_path / "policy-init"
    cfg.policy.pretrained = "smollm2-135m-instruct"
    cfg.policy.upcycle.experts = (
        0  # the dense model `make install` converted (no upcycling in a fast test)
    )
    assert _initial_policy(cfg, tmp_path) == dense("smollm2-135m-instruct")
    (tmp_path / "warm-start").mkdir()
    (tmp_path / "warm-start" / "config.json").write_text("{}")
    assert _initial_policy(cfg, tmp_path) == tmp_path / "warm-start"

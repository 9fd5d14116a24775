"""`make demo`'s pipeline on the real policy, shortened: the upcycled SmolLM2 on the calculator,
the demo's own config (warm start on the scripted expert, GRPO with milestone credit through Ray,
vLLM, the learner and in-place sync), one warm-start round, 2 RL iterations and 64 test episodes.
Its test success rises from the pretrained policy's: that model, zero-shot through our chat format,
solves none (evaluated here by `longhorizon eval` on the same test seeds and sampling), and the 95%
intervals come apart. How much RL alone adds is the full demo's measurement (README, docs/demo.md):
2 iterations on 64 episodes cannot resolve it."""

import json
import subprocess
import sys

import pytest

from conftest import REPO

pytestmark = pytest.mark.slow

EPISODES = 64


def test_shortened_real_model_demo_raises_held_out_success(ray_cluster, tmp_path):
    from longhorizon.demo import run_demo
    from rl.config import load_config
    from rl.start.pretrained import policy

    config = REPO / "configs" / "demo" / "calculator.yaml"
    overrides = [
        "iterations=2",
        "eval.every=2",
        f"eval.episodes={EPISODES}",
        f"eval.test_episodes={EPISODES}",
        "warm_start.rounds=1",
        "eval.test=[{stages: [warm_start, rl]}]",
    ]
    cfg = load_config(config, overrides)
    upcycled = policy(cfg.policy.pretrained, cfg.policy.upcycle.experts, cfg.policy.upcycle.top_k)
    zero_shot = subprocess.run(
        [
            sys.executable,
            "-m",
            "longhorizon.cli",
            "eval",
            str(upcycled),
            "--env",
            cfg.env.id,
            "--env-kwargs",
            json.dumps(cfg.env.kwargs),
            "--episodes",
            str(EPISODES),
            "--temperature",
            str(cfg.rollout.temperature),
            "--split",
            "test",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert zero_shot.returncode == 0, zero_shot.stderr[-2000:]
    before = json.loads(zero_shot.stdout)  # --json: the only thing on stdout

    res = run_demo(tmp_path / "demo", [str(config)], overrides)
    warm, final = (next(r for r in res if r["stage"] == stage) for stage in ("warm_start", "rl"))
    assert before["episodes"] == warm["episodes"] == final["episodes"] == EPISODES
    # the pipeline's result lies above the policy it started from, 95% intervals apart
    assert final["ci95"][0] > before["ci95"][1], (before, res)
    rows = [
        json.loads(line)
        for line in (tmp_path / "demo" / "calculator" / "metrics.jsonl").read_text().splitlines()
    ]
    first = rows[0]["policy_version"]  # after the warm start's version(s)
    assert [r["policy_version"] for r in rows] == [first, first + 1] and all(
        r["grad_norm"] > 0 for r in rows
    )
    # the final evaluation ran on the RL-trained weights
    assert rows[-1]["eval/policy_version"] == first + 1
    table = (tmp_path / "demo" / "results.md").read_text()
    assert "| `tools/calculator-v0` |" in table and "2 iterations" in table


def test_a_demo_whose_rl_cannot_learn_records_why_and_still_compares(ray_cluster, tmp_path):
    """The tiny random policy earns nothing on the calculator, so no group has a learning signal and
    the guard stops RL after one iteration (stop_after_flat=1): the demo records that in results.md,
    still tests the weights it has at stage rl, and ends (green) with its comparison written."""
    from longhorizon.demo import run_demo

    overrides = [
        "iterations=3",
        "stop_after_flat=1",
        "eval.every=3",
        "eval.episodes=4",
        "eval.test_episodes=4",
        "rollout.num_workers=1",
        "rollout.groups_per_iteration=2",
        "rollout.group_size=2",
        "rollout.max_turns=2",
    ]
    rows = run_demo(tmp_path / "demo", [str(REPO / "configs" / "quickstart.yaml")], overrides)
    assert [r["stage"] for r in rows] == ["warm_start", "rl"] and all(
        r["episodes"] == 4 for r in rows
    )
    metrics = (tmp_path / "demo" / "quickstart" / "metrics.jsonl").read_text().splitlines()
    assert len(metrics) == 1  # stopped after its first flat iteration, not run to 3
    table = (tmp_path / "demo" / "results.md").read_text()
    assert "1 iterations" in table and "(stopped: no learning signal)" in table
    assert (
        "RL on `tools/calculator-v0` stopped: the run cannot learn: 1 iterations in a row" in table
    )
    assert json.loads((tmp_path / "demo" / "eval.json").read_text()) == rows

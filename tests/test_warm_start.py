"""Supervised warm start: expert demonstrations recorded through the agent loop, imitated by the
run's learner round after round (rl/start/warm_start.py), served by the rollout workers before RL starts;
`longhorizon demo`'s protocol around it (validation-chosen warm start, test seeds, more warm start
for RL's wall time)."""

import json

import pytest
import torch

from conftest import REPO
from rl.start.sft import DEMO_SEED, demonstrations
from rollout.chat import ChatFormat


def test_demonstrations_are_solved_episodes_in_the_rollout_format(tokenizer):
    chat = ChatFormat(tokenizer)
    demos = demonstrations(chat, "tools/calculator-v0", 3, max_turns=4)
    assert [t.seed for t in demos] == [DEMO_SEED, DEMO_SEED + 1, DEMO_SEED + 2]
    for t in demos:
        assert t.reward == pytest.approx(1.25) and t.stop_reason == "terminated"
        # the loss mask is exactly the assistant's turns, as in rollouts
        assert sum(t.loss_mask) == sum(turn.gen_end - turn.gen_start for turn in t.turns)
    (maze,) = demonstrations(
        chat, "vision/maze-v0", 1, env_kwargs={"size": 7, "max_turns": 20}, max_turns=20
    )
    assert maze.reward > 0
    # 64 seeds of a task with ~100 distinct prompts: some seeds share a prompt, each still solved
    digits = demonstrations(chat, "text/digits-v0", 64, max_turns=1)
    assert len({t.task for t in digits}) < 64 and all(t.reward == 1.0 for t in digits)
    # the shell task's prompt names only the log level, and the files it lists differ per seed:
    # episodes with one prompt see observations of different lengths, each still solved
    shell = demonstrations(chat, "tools/shell-v0", 6, max_turns=6)
    assert len({t.task for t in shell}) < 6 and all(t.reward == pytest.approx(1.0) for t in shell)


def _mean_assistant_logprob(logprobs, traj):
    return sum(lp for lp, m in zip(logprobs, traj.loss_mask[1:]) if m) / sum(traj.loss_mask[1:])


@pytest.mark.slow
def test_training_starts_from_the_warm_started_policy(
    ray_cluster, tiny_policy, tmp_path, tokenizer
):
    import ray
    from transformers import AutoModelForCausalLM

    from rl.config import load_config
    from rl.loop.trainer import Trainer

    cfg = load_config(
        REPO / "configs" / "quickstart.yaml",
        [
            "iterations=1",
            f"policy.path={tiny_policy}",
            "rollout.num_workers=1",
            "rollout.groups_per_iteration=2",
            "rollout.group_size=2",
            "warm_start.demos=24",
            "warm_start.epochs=3",
            "warm_start.lr=3e-3",
            "eval.every=1",
            "eval.episodes=4",
        ],
    )
    trainer = Trainer(cfg, tmp_path / "run")
    trainer.start()
    try:
        info = json.loads((tmp_path / "run" / "warm-start" / "warm_start.json").read_text())
        losses = info["per_round"][0]["losses"]
        # no patience: no validation
        assert info["demos"] == 24 and info["rounds"] == 1 and info["validation"] is None
        assert losses[-1] < losses[0] - 0.5
        # the rollout worker serves the warm-started weights: held-out expert turns are likelier than
        # under the initial policy
        (demo,) = demonstrations(ChatFormat(tokenizer), "tools/calculator-v0", 1, first_seed=7)
        served = _mean_assistant_logprob(
            ray.get(trainer.workers[0].score.remote(demo.token_ids)), demo
        )
        init = AutoModelForCausalLM.from_pretrained(tiny_policy, dtype=torch.float32).eval()
        with torch.no_grad():
            logits = init(torch.tensor([demo.token_ids])).logits[0, :-1]
        lp = (
            torch.log_softmax(logits, -1)
            .gather(-1, torch.tensor(demo.token_ids[1:])[:, None])
            .squeeze(-1)
        )
        assert served > _mean_assistant_logprob(lp.tolist(), demo) + 0.3
        rows = trainer.run()
    finally:
        trainer.close()
    initial = json.loads((tmp_path / "run" / "eval-initial.json").read_text())
    # the warm start's round is a version of its own (1); RL's first update makes 2
    assert initial["eval/episodes"] == 4 and initial["eval/policy_version"] == 1
    assert rows[-1]["eval/episodes"] == 4 and rows[-1]["eval/policy_version"] == 2


@pytest.mark.slow
def test_shortened_demo_improves_test_success_over_the_best_warm_start(ray_cluster, tmp_path):
    """The demo protocol on a one-turn task, shortened: the warm start runs rounds until validation
    success stops improving (patience 1) and RL starts from the best round; RL (12 iterations), the
    best warm start and the warm start continued for RL's wall time are played on test seeds;
    eval.json holds the issue's rows; test success after RL lies above the best warm start's,
    intervals apart."""
    from longhorizon.demo import run_demo
    from rl.loop.evaluate import SPLITS

    rows = run_demo(
        tmp_path / "demo",
        [str(REPO / "configs" / "demo" / "digits.yaml")],
        ["iterations=12", "eval.every=6", "eval.episodes=100", "eval.test_episodes=100"],
    )
    saved = json.loads((tmp_path / "demo" / "eval.json").read_text())
    assert saved == rows and [r["stage"] for r in rows] == ["warm_start", "rl", "warm_start_more"]
    keys = {
        "env",
        "horizon",
        "context",
        "stage",
        "split",
        "success",
        "ci95",
        "episodes",
        "mean_total_tokens",
        "max_model_len",
    }
    for r in rows:
        assert (
            keys <= set(r)
            and r["split"] == "test"
            and r["episodes"] == 100
            and r["env"] == "text/digits-v0"
        )
        assert r["context"] == "full" and r["horizon"] is None and r["mean_total_tokens"] > 0
    warm, rl, more = rows
    assert rl["ci95"][0] > warm["ci95"][1], rows  # clearly above: the 95% intervals do not overlap
    info = json.loads((tmp_path / "demo" / "digits" / "warm-start" / "warm_start.json").read_text())
    # it ran until validation stopped improving
    assert info["rounds"] >= 2 and 0 <= info["best_round"] < info["rounds"]
    successes = [r["validation"]["success"] for r in info["per_round"]]
    assert successes[info["best_round"]] == max(successes)
    assert info["rounds"] == len(successes) and (
        info["rounds"] == 6 or max(successes[info["best_round"] + 1 :]) <= max(successes)
    )
    more_info = json.loads((tmp_path / "demo" / "digits" / "warm_start_more.json").read_text())
    metrics = [
        json.loads(line)
        for line in (tmp_path / "demo" / "digits" / "metrics.jsonl").read_text().splitlines()
    ]
    rl_s = sum(m["iteration_s"] - m.get("eval/s", 0.0) for m in metrics)
    assert more_info["seconds"] >= rl_s and more_info["target_s"] == pytest.approx(rl_s)
    png = tmp_path / "demo" / "curve.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    # what the README's demo table is copied from
    table = (tmp_path / "demo" / "results.md").read_text()
    assert (
        f"| `text/digits-v0` | – | full | {warm['success']:.3f} [" in table
        and "| 12 iterations, " in table
    )
    assert SPLITS["test"] > SPLITS["validation"] + 10_000  # the splits' seeds never meet

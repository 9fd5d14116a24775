"""`reasoning/gym-v0`: reasoning-gym's datasets and scorers as a multi-step tool task, its arguments
checked when a config loads, trained through the whole loop from a config of a few lines."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import envs
from conftest import REPO
from envs.tool_calls import format_tool_call as call
from rl.config import ConfigError, load_config

CONFIG = REPO / "configs" / "quickstart_reasoning_gym.yaml"


@pytest.mark.parametrize("dataset", ["leg_counting", "basic_arithmetic", "spell_backward"])
def test_the_expert_solves_and_the_scorer_decides(dataset):
    import reasoning_gym

    env = envs.make("reasoning/gym-v0", dataset=dataset)
    report = envs.check_env(env, seed=3)  # the contract, determinism, malformed calls, the expert
    assert report["expert_reward"] == 1.0
    obs, _ = env.reset(seed=5)
    again, _ = envs.make("reasoning/gym-v0", dataset=dataset).reset(seed=5)
    assert obs == again and env.entry["question"] in obs  # the seed is the problem's
    # the reward is reasoning-gym's own score of the submitted text
    data = reasoning_gym.create_dataset(dataset, size=1, seed=env.problem_seed)
    assert data[0]["question"] == env.entry["question"]
    _, reward, done, _, info = env.step(call("submit", answer="certainly not the answer"))
    assert done and reward == 0.0 and info["milestones"] == []


def test_a_calculator_turn_then_the_answer():
    env = envs.make("reasoning/gym-v0", dataset="basic_arithmetic")
    env.reset(seed=1)
    _, reward, done, _, info = env.step(call("calculator", expression="6 * 7"))
    assert not done and reward == 0.0 and info["messages"][-1]["content"].endswith("42")
    _, reward, done, _, info = env.step(call("submit", answer=str(env.entry["answer"])))
    assert done and reward == 1.0 and [m["name"] for m in info["milestones"]] == ["solved"]


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"dataset": "leg_countin"}, "did you mean 'leg_counting'"),
        ({"dataset": "leg_counting", "config": {"min_animals": 5, "max_animals": 2}}, "config"),
        ({"dataset": "leg_counting", "config": {"no_such_setting": 1}}, "no_such_setting"),
        ({"dataset": "leg_counting", "config": [1]}, "config must be a mapping"),
    ],
)
def test_a_bad_dataset_or_setting_stops_the_config(kwargs, words):
    with pytest.raises(ConfigError, match="env.kwargs is wrong") as err:
        load_config(CONFIG, [f"env.kwargs={json.dumps(kwargs)}"])
    assert words in str(err.value)


@pytest.mark.slow
def test_a_run_trains_on_a_reasoning_gym_dataset(tmp_path):
    run_dir = tmp_path / "run"
    r = subprocess.run(
        [sys.executable, "-m", "longhorizon.cli", "train", str(CONFIG), "--run-dir", str(run_dir),
         "iterations=1"],
        cwd=REPO, capture_output=True, text=True, timeout=1200,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    row = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    assert row["episodes"] == 8 and "loss" in row
    shown = subprocess.run(
        [sys.executable, "-m", "longhorizon.cli", "inspect", str(run_dir), "--episodes", "--json"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    episodes = json.loads(shown.stdout)
    assert {e["env_id"] for e in episodes} == {"reasoning/gym-v0"} and len(episodes) == 8
    warm = json.loads((run_dir / "warm-start" / "warm_start.json").read_text())
    assert warm  # the warm start played the scorer's reference answers

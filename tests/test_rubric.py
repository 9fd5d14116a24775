"""Rubrics (rewards/rubric.py): an episode's reward as weighted parts over its record, scored in the
rollout workers, stored per part, credited by milestone credit, logged, shown, and rescored from
the command line."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import REPO
from rewards.rubric import DEFAULT, FORMAT_FAILURES, build, length, well_formed
from rl.learner.credit import episode_turn_rewards
from rollout.judge_actor import apply_rubric
from rollout.trajectory import TURN_FAILURES, Trajectory, Turn


def _episode(failures_per_turn, milestones, generated: int = 30) -> Trajectory:
    turns = [
        Turn(
            gen_start=10 * i,
            gen_end=10 * i + 5,
            obs_end=10 * i + 10,
            text="t",
            observation="o",
            tool_calls=1,
            tool_errors=0,
            policy_version=0,
            seed=0,
            finish_reason="stop",
            failures=list(f),
        )
        for i, f in enumerate(failures_per_turn)
    ]
    n = 10 * len(turns)
    mask = [1] * generated + [0] * (n - generated)
    return Trajectory(
        episode_id="e0",
        iteration=0,
        group_id=0,
        env_id="tools/calculator-v0",
        seed=1,
        prompt_len=0,
        token_ids=list(range(n)),
        loss_mask=mask,
        rollout_logprobs=[0.0] * n,
        turns=turns,
        milestones=milestones,
        reward=sum(m["reward"] for m in milestones),
    )


MILESTONES = [
    {"name": "product", "reward": 0.5, "turn": 0, "token": 5},
    {"name": "solved", "reward": 0.5, "turn": 2, "token": 25},
]


def test_a_rubric_is_the_weighted_sum_of_its_parts_each_kept():
    t = _episode([["malformed_call"], [], []], MILESTONES, generated=30)
    rubric = build(
        [
            {"fn": "milestones"},
            {"fn": "format", "weight": 0.2},
            {"fn": "length", "weight": 0.5, "kwargs": {"budget": 60}, "name": "short"},
        ]
    )
    total, parts = rubric.score(t)
    assert parts == {"milestones": 1.0, "format": pytest.approx(2 / 3), "short": -0.5}
    assert total == pytest.approx(1.0 + 0.2 * 2 / 3 - 0.25)
    assert build([]) is DEFAULT and DEFAULT.score(t) == (1.0, {"milestones": 1.0})
    assert build([{"fn": "solved"}]).score(_episode([[]], MILESTONES[:1]))[0] == 0.0
    assert (
        well_formed(_episode([], [])) == 1.0
        and length(_episode([[]], [], generated=10), budget=5) == -1.0
    )
    assert set(FORMAT_FAILURES) <= set(TURN_FAILURES)  # the names the environments report


def test_a_rubric_from_a_module_function_and_its_errors():
    rubric = build([{"fn": "rewards.milestones:terminal_only", "weight": 2}])
    assert (
        rubric.parts[0].name == "terminal_only"
        and rubric.score(_episode([[]], MILESTONES))[0] == 2.0
    )
    for spec, message in [
        ([{"fn": "nope"}], r"reward.parts\[0\]: unknown reward part 'nope'"),
        ([{"fn": "no.such.module:fn"}], "cannot be imported"),
        ([{"fn": "format", "weight": "x"}], r"reward.parts\[0\].weight must be a number"),
        ([{"fn": "format"}, {"fn": "format"}], "two parts named 'format'"),
        ([{"fn": "format", "wieght": 1}], "unknown key"),
        (["format"], "must be a mapping"),
        ([{"fn": "length", "kwargs": {"budgett": 3}}], "does not take these kwargs"),
    ]:
        with pytest.raises(ValueError, match=message):
            build(spec)
    nan = build([{"fn": "math:sqrt"}])  # sqrt(trajectory) raises: a part that fails
    t = apply_rubric(nan, _episode([[]], MILESTONES))
    assert t.infra_error.startswith("reward: TypeError") and t.failure == "infra_error"


def test_milestone_credit_pays_what_the_milestones_do_not_account_for_at_the_last_turn():
    t = _episode([[], [], []], MILESTONES)
    assert episode_turn_rewards(t) == [0.5, 0.0, 0.5]  # no rubric: the milestones alone
    t.reward, t.reward_parts = build([{"fn": "milestones"}, {"fn": "format", "weight": 0.3}]).score(
        t
    )
    assert episode_turn_rewards(t) == pytest.approx([0.5, 0.0, 0.8])
    assert sum(episode_turn_rewards(t)) == pytest.approx(t.reward)


def test_reward_parts_are_stored_and_older_shards_read_without_them(tmp_path):
    import pyarrow.parquet as pq

    from rl.store import TrajectoryStore

    t = _episode([[]], MILESTONES)
    t.reward, t.reward_parts = build([{"fn": "milestones"}, {"fn": "format", "weight": 0.1}]).score(
        t
    )
    store = TrajectoryStore(tmp_path)
    shard = store.write("iter-000000", [t])
    (back,) = store.trajectories()
    assert back.reward_parts == {"milestones": 1.0, "format": 1.0} and back.reward == pytest.approx(
        1.1
    )
    table = pq.read_table(shard).drop_columns(["reward_parts"])  # a schema-3 shard
    pq.write_table(table, shard)
    assert next(TrajectoryStore(tmp_path).trajectories()).reward_parts == {}


def test_the_reward_section_is_checked_when_the_config_loads():
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "longhorizon.cli",
            "train",
            "configs/quickstart.yaml",
            "reward.parts=[{fn: formatt}]",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "reward.parts" in r.stderr and "unknown reward part 'formatt'" in r.stderr


@pytest.mark.slow
def test_replay_rescores_a_run_with_a_rubric_file(e2e_run, tmp_path):
    _, _, run_dir = e2e_run
    rubric = tmp_path / "rubric.yaml"
    rubric.write_text("parts:\n  - {fn: milestones}\n  - {fn: format, weight: 0.5}\n")
    cli = lambda *a: subprocess.run(
        [sys.executable, "-m", "longhorizon.cli", "replay", str(run_dir), "--all", *a],  # noqa: E731
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    rows = json.loads(cli("--rescore", str(rubric), "--json").stdout)
    assert rows and all(set(r["parts"]) == {"milestones", "format"} for r in rows)
    assert all(
        r["rescored"] == pytest.approx(r["parts"]["milestones"] + 0.5 * r["parts"]["format"])
        for r in rows
    )
    # the run's own reward: what was stored
    run = json.loads(cli("--rescore", "run", "--json").stdout)
    assert [r["rescored"] for r in run] == pytest.approx([r["recorded"] for r in run])
    rubric.write_text("parts: [{fn: milestones")
    bad = cli("--rescore", str(rubric))
    assert bad.returncode == 2 and "not YAML" in bad.stderr and bad.stderr.count("\n") == 1


@pytest.mark.slow
def test_a_run_trains_on_its_rubric(ray_cluster, tiny_policy, tmp_path):
    """One iteration of the quickstart with a rubric: the rollout workers score every episode, the
    store keeps each part, metrics.jsonl logs each part's mean."""
    from conftest import started_trainer
    from rl.store import TrajectoryStore

    with started_trainer(
        "quickstart.yaml",
        [
            "iterations=1",
            f"policy.path={tiny_policy}",
            "rollout.max_new_tokens=16",
            "rollout.num_workers=1",
            "rollout.cpus_per_worker=0.1",
            "reward.parts=[{fn: milestones}, {fn: format, weight: 0.5}, {fn: length, weight: 0.1, kwargs: {budget: 32}}]",
        ],
        tmp_path,
    ) as trainer:
        (row,) = trainer.run()
    trajs = list(TrajectoryStore(tmp_path).trajectories())
    assert trajs and all(
        set(t.reward_parts) == {"milestones", "format", "length"}
        for t in trajs
        if not t.infra_error
    )
    for t in trajs:
        p = t.reward_parts
        assert t.reward == pytest.approx(p["milestones"] + 0.5 * p["format"] + 0.1 * p["length"])
    assert row["reward/format"] == pytest.approx(
        sum(t.reward_parts["format"] for t in trajs) / len(trajs)
    )
    assert row["mean_reward"] == pytest.approx(sum(t.reward for t in trajs) / len(trajs))
    # a random policy writes few well-formed calls and runs long: the parts are not all trivially 0
    assert any(t.reward != 0 for t in trajs)


def test_the_docs_rubric_example_builds():
    import yaml

    text = (REPO / "docs" / "rewards.md").read_text()
    start = text.index("```yaml\n") + len("```yaml\n")
    parts = yaml.safe_load(text[start : text.index("```\n", start)])["reward"]["parts"]
    rubric = build(parts)
    assert [p.name for p in rubric.parts] == ["milestones", "format", "length", "discounted"]
    total, values = rubric.score(_episode([[], []], MILESTONES))
    assert values["discounted"] == pytest.approx(0.5 + 0.5 * 0.9**2)

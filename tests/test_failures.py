"""The failure taxonomy: every turn records what went wrong in it, every episode one kind
(rollout/trajectory.py), through the real agent loop, the store and the metrics row."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

import envs
from envs.tool_calls import format_tool_call as call
from rl.loop.episodes import batch_metrics
from rl.store import TrajectoryStore
from rollout.agent_loop import run_episodes
from rollout.chat import ChatFormat
from rollout.expert import ExpertEngine
from rollout.trajectory import FAILURE_KINDS, EpisodeTask, Turn, failure_kind

SEED = 4


def _answer() -> int:
    env = envs.make("tools/calculator-v0")
    env.reset(seed=SEED)
    return env.answer


CASES = {  # the turns a policy writes -> (per-turn failures, the episode's kind)
    "chat": (
        ["I think the answer is 12.", "Let me think more."],
        [["no_tool_call"], ["no_tool_call"]],
        "no_tool_call",
    ),
    "broken json": (
        ['<tool_call>\n{"name": "calculator", "arguments": {"expression": "2*3"\n</tool_call>'] * 2,
        [["malformed_call"], ["malformed_call"]],
        "malformed_call",
    ),
    "made-up tool": (
        [call("python", code="print(1)"), call("calculator", expression="1/0")],
        [["unknown_tool"], ["tool_error"]],
        "tool_error",
    ),  # a tie goes to the later failure
    "wrong answer": ([call("submit", answer=1)], [[]], "wrong_answer"),
    "one slip": (
        [
            call("calculator", expression="2*"),
            call("calculator", expression="2*3"),
            call("calculator", expression="4*5"),
        ],
        [["tool_error"], [], []],
        "out_of_turns",
    ),
    "solved": ([call("submit", answer="{answer}")], [[]], "success"),
}


@pytest.mark.parametrize("case", CASES)
def test_each_episode_gets_its_kind_through_the_agent_loop(tokenizer, tmp_path, case):
    turns, per_turn, kind = CASES[case]
    turns = [t.replace("{answer}", str(_answer())) for t in turns]
    chat = ChatFormat(tokenizer)
    [t] = run_episodes(
        ExpertEngine(chat, [SEED], turns=turns),
        chat,
        lambda: envs.make("tools/calculator-v0", max_turns=len(turns)),
        "tools/calculator-v0",
        [EpisodeTask("e0", 0, SEED, 0)],
        max_turns=len(turns),
        max_new_tokens=64,
        max_episode_tokens=4096,
    )
    assert [turn.failures for turn in t.turns] == per_turn and t.failure == kind
    store = TrajectoryStore(tmp_path)
    store.write("iter-000000", [t])
    back = next(store.trajectories())
    assert back.failure == kind and [turn.failures for turn in back.turns] == per_turn


def test_a_sandbox_limit_is_a_turn_failure():
    env = envs.make("tools/shell-v0", timeout_s=1.0)
    env.reset(seed=0)
    _, _, _, _, info = env.step(call("bash", command="sleep 5"))
    assert info["failures"] == ["sandbox_limit"] and "wall_time limit reached" in " ".join(
        info["sandbox_events"]
    )
    env.close()


def test_rules_for_episodes_that_ran_out():
    def turns(*failures):
        return [Turn(0, 1, 1, "", "", 0, 0, 0, 0, "stop", failures=list(f)) for f in failures]

    # 1 of 3 failed
    assert failure_kind("max_turns", turns([], ["tool_error"], []), False) == "out_of_turns"
    assert failure_kind("max_tokens", turns([], []), False) == "out_of_tokens"
    assert (
        failure_kind("truncated", turns(["no_tool_call"], ["tool_error", "tool_error"]), False)
        == "tool_error"
    )
    assert (
        failure_kind("max_turns", turns(["no_tool_call"], ["no_tool_call"], ["tool_error"]), False)
        == "no_tool_call"
    )
    assert failure_kind("infra_error", [], False, "sandbox died") == "infra_error"
    # the env's test decides
    assert failure_kind("max_turns", turns(["no_tool_call"]), True) == "success"


def test_every_kind_is_a_share_of_the_iteration_in_metrics(tokenizer):
    chat = ChatFormat(tokenizer)
    answer = _answer()
    trajs = []
    for i, turns in enumerate(
        [[call("submit", answer=answer)], ["no call"] * 2, ["no call"] * 2, ["hm"] * 2]
    ):
        trajs += run_episodes(
            ExpertEngine(chat, [SEED], turns=turns),
            chat,
            lambda: envs.make("tools/calculator-v0", max_turns=2),
            "tools/calculator-v0",
            [EpisodeTask(f"e{i}", 0, SEED, 0)],
            max_turns=2,
            max_new_tokens=64,
            max_episode_tokens=4096,
        )
    row = batch_metrics(trajs)
    assert {k: v for k, v in row.items() if k.startswith("failure/") and v} == {
        "failure/success": 0.25,
        "failure/no_tool_call": 0.75,
    }
    assert sum(row[f"failure/{k}"] for k in FAILURE_KINDS) == pytest.approx(1.0)  # zeros included


def test_a_shard_from_before_the_taxonomy_reads_with_its_kind(tmp_path, tokenizer):
    """Schema 2 shards have no `failure` column and no per-turn failures: the kind is derived from
    what they hold (success, wrong answer, ran out)."""
    chat = ChatFormat(tokenizer)
    [t] = run_episodes(
        ExpertEngine(chat, [SEED], turns=[call("submit", answer=_answer())]),
        chat,
        lambda: envs.make("tools/calculator-v0"),
        "tools/calculator-v0",
        [EpisodeTask("e0", 0, SEED, 0)],
        max_turns=2,
        max_new_tokens=64,
        max_episode_tokens=4096,
    )
    store = TrajectoryStore(tmp_path)
    path = store.write("iter-000000", [t])
    table = pq.read_table(path)
    old = table.drop_columns(["failure"]).set_column(
        table.schema.get_field_index("turns"),
        "turns",
        [
            [
                json.dumps(
                    [
                        {k: v for k, v in turn.items() if k != "failures"}
                        for turn in json.loads(table["turns"][0].as_py())
                    ]
                )
            ]
        ],
    )
    path.unlink()
    pq.write_table(old, path)
    back = next(store.trajectories())
    assert back.failure == "success" and back.turns[0].failures == []
    from longhorizon.inspect import episode_list

    assert [(r["episode_id"], r["failure"]) for r in episode_list(tmp_path)] == [("e0", "success")]


def test_a_shard_from_before_the_taxonomy_reads_its_turn_failures_from_observations(
    tmp_path, tokenizer
):
    """Schema-2 turns carry no failures; the observations envs/base.py wrote for them tell."""
    chat = ChatFormat(tokenizer)
    turns = ["just text", call("python", code="1"), call("calculator", expression="2*")]
    [t] = run_episodes(
        ExpertEngine(chat, [SEED], turns=turns),
        chat,
        lambda: envs.make("tools/calculator-v0", max_turns=3),
        "tools/calculator-v0",
        [EpisodeTask("e0", 0, SEED, 0)],
        max_turns=3,
        max_new_tokens=64,
        max_episode_tokens=4096,
    )
    store = TrajectoryStore(tmp_path)
    path = store.write("iter-000000", [t])
    table = pq.read_table(path)
    legacy = [
        {k: v for k, v in turn.items() if k != "failures"}
        for turn in json.loads(table["turns"][0].as_py())
    ]
    old = table.drop_columns(["failure"]).set_column(
        table.schema.get_field_index("turns"), "turns", [[json.dumps(legacy)]]
    )
    path.unlink()
    pq.write_table(old, path)
    back = next(store.trajectories())
    assert [turn.failures for turn in back.turns] == [
        ["no_tool_call"],
        ["unknown_tool"],
        ["tool_error"],
    ]
    assert back.failure == t.failure == "tool_error"  # a tie of one each: the latest

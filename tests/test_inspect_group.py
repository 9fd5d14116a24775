"""`inspect --group ID`: one GRPO group side by side, from episodes recorded by the real agent
loop and the learner's own sidecar records; `--failure` and `--min-tool-errors` filters."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import envs
from conftest import REPO
from envs.tool_calls import format_tool_call as call
from rl.store import TrajectoryStore
from rollout.agent_loop import run_episodes
from rollout.chat import ChatFormat
from rollout.expert import ExpertEngine
from rollout.trajectory import EpisodeTask

SEED = 9


def cli(*argv):
    return subprocess.run(
        [sys.executable, "-m", "longhorizon.cli", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )


@pytest.fixture(scope="module")
def group_run(tmp_path_factory, tokenizer):
    """Group 3 of a run: the expert (solves it), one that starts like the expert and then submits a
    wrong answer, one that only chats; the learner's advantages as its sidecar records them."""
    env = envs.make("tools/calculator-v0")
    env.reset(seed=SEED)
    expert = env.expert_turns()
    plays = {
        "e-expert": expert,
        "e-wrong": [expert[0], call("submit", answer=1)],
        "e-chat": ["Hmm.", "Let me see."],
    }
    chat = ChatFormat(tokenizer)
    trajs = []
    for eid, turns in plays.items():
        trajs += run_episodes(
            ExpertEngine(chat, [SEED], turns=turns),
            chat,
            lambda: envs.make("tools/calculator-v0"),
            "tools/calculator-v0",
            [EpisodeTask(eid, 3, SEED, 0)],
            max_turns=len(turns),
            max_new_tokens=64,
            max_episode_tokens=4096,
        )
    d = tmp_path_factory.mktemp("group-run")
    store = TrajectoryStore(d)
    store.write("iter-000000", trajs)
    advantage = {"e-expert": 1.2, "e-wrong": -0.3, "e-chat": -0.9}
    store.write_learner(
        "iter-000000",
        {
            t.episode_id: {
                "learner_logprobs": [0.0] * len(t.token_ids),
                "advantages": [advantage[t.episode_id] * m for m in t.loss_mask],
            }
            for t in trajs
        },
        0,
    )
    return d, {t.episode_id: t for t in trajs}


def test_the_group_side_by_side(group_run):
    run_dir, trajs = group_run
    r = cli("inspect", str(run_dir), "--group", "3", "--json")
    assert r.returncode == 0, r.stderr
    view = json.loads(r.stdout)
    assert view["best"] == "e-expert" and view["task"] == trajs["e-expert"].task and view["task"]
    rows = {e["episode_id"]: e for e in view["episodes"]}
    assert [e["episode_id"] for e in view["episodes"]] == [
        "e-expert",
        "e-wrong",
        "e-chat",
    ]  # best first
    assert rows["e-expert"]["advantage"] == pytest.approx(1.2) and rows["e-chat"][
        "advantage"
    ] == pytest.approx(-0.9)
    assert rows["e-expert"]["failure"] == "success" and rows["e-wrong"]["failure"] == "wrong_answer"
    assert (
        rows["e-chat"]["failure"] == "no_tool_call"
        and rows["e-chat"]["turns"] == ["no_tool_call"] * 2
    )
    assert rows["e-expert"]["turns"] == ["calculator", "calculator", "submit"]
    # the wrong one follows the expert for a whole turn (same tokens, same observation) and departs in turn 1
    assert rows["e-wrong"]["diverges_at_turn"] == 1 and rows["e-chat"]["diverges_at_turn"] == 0
    assert rows["e-wrong"]["diverges_at_token"] == trajs["e-wrong"].turns[1].gen_start + next(
        i
        for i, (a, b) in enumerate(
            zip(
                trajs["e-wrong"].token_ids[trajs["e-wrong"].turns[1].gen_start :],
                trajs["e-expert"].token_ids[trajs["e-expert"].turns[1].gen_start :],
            )
        )
        if a != b
    )
    text = cli("inspect", str(run_dir), "--group", "3").stdout
    assert "e-expert" in text and "(best)" in text and "turn 1" in text and "+1.200" in text
    assert "no group 7" in cli("inspect", str(run_dir), "--group", "7").stderr
    bad = cli("inspect", str(run_dir), "--group", "g3")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "i1-g2" in bad.stderr
    # a turn without a tool call says so in the terminal too (it counts no tool error)
    episode = cli("inspect", str(run_dir), "--episode", "e-chat").stdout
    assert (
        episode.count("turn 0 · no_tool_call ·") == 1
        and episode.count("turn 1 · no_tool_call ·") == 1
    )


def test_failure_and_tool_error_filters(group_run):
    run_dir, _ = group_run
    rows = json.loads(
        cli("inspect", str(run_dir), "--episodes", "--failure", "no_tool_call", "--json").stdout
    )
    assert [r["episode_id"] for r in rows] == ["e-chat"] and rows[0]["tool_errors"] == 0
    assert (
        json.loads(
            cli("inspect", str(run_dir), "--episodes", "--min-tool-errors", "1", "--json").stdout
        )
        == []
    )
    r = cli("inspect", str(run_dir), "--episodes", "--failure", "lazy")
    assert (
        r.returncode == 2
        and "'lazy' is not a failure kind" in r.stderr
        and "no_tool_call" in r.stderr
    )
    # not a terminal: no cell is cut short
    piped = cli("inspect", str(run_dir), "--episodes").stdout
    assert "tools/calculator-v0" in piped and "wrong_answer" in piped and "…" not in piped


def test_the_viewer_explains_a_failed_episode_by_its_group(group_run, tmp_path):
    """In headless Chromium, the page opened on the failed episode shows its failure kind, its group
    best first with advantages, it next to the best from the turn where they part, failed turns red
    on the timeline and their error observations styled as errors; the failure filter works."""
    from conftest import chromium_flags

    run_dir, _ = group_run
    page = tmp_path / "viewer.html"
    assert cli("inspect", str(run_dir), "--html", str(page)).returncode == 0

    def dom(query: str) -> str:
        return subprocess.run(
            chromium_flags() + ["--dump-dom", page.as_uri() + query],
            capture_output=True,
            text=True,
            timeout=120,
        ).stdout

    wrong = dom("?episode=e-wrong")
    assert (
        '<h1 id="episode-title">e-wrong</h1>' in wrong
        and 'class="fail"' in wrong
        and ">wrong_answer<" in wrong
    )
    assert 'id="group-title">group 3: 3 episode(s), best first' in wrong
    assert "e-expert (best)" in wrong and "+1.200" in wrong and "-0.900" in wrong
    assert "outlined: from turn 1, where the two first differ" in wrong
    assert wrong.count('class="turn departs"') == 1 + 2  # its turn 1; the best's turns 1 and 2
    chat = dom("?episode=e-chat")
    # its two chatty turns: red on the timeline, their observations as errors (next to the best and below)
    assert (
        chat.count('class="turn-box failed"') == 2 and chat.count('class="turn obs err"') == 2 * 2
    )
    assert "<text" in dom("") and "iteration</text>" in dom("")  # the reward chart has its axes
    only = dom("?failure=no_tool_call")
    assert (
        'data-id="e-chat"' in only
        and 'class="episode-row' in only
        and 'data-id="e-expert"' not in only.split('id="eplist"')[1].split("</table>")[0]
    )


def test_the_group_as_episode_ids_print_it(group_run, tmp_path):
    """`--group i2-g1` names the group whose episodes print as i2-g1-e0, i2-g1-e1, ...: the same
    group the run-wide number names, and never another iteration's group of the same index."""
    import dataclasses

    _, trajs = group_run
    store = TrajectoryStore(tmp_path)
    renamed = [
        dataclasses.replace(t, episode_id=f"i2-g1-e{k}", group_id=7, iteration=2)
        for k, t in enumerate(trajs.values())
    ]
    other = [  # iteration 0's group 1: the same index in another iteration
        dataclasses.replace(t, episode_id=f"i0-g1-e{k}", group_id=1, iteration=0)
        for k, t in enumerate(trajs.values())
    ]
    store.write("iter-000000", other)
    store.write("iter-000002", renamed)
    by_name = json.loads(cli("inspect", str(tmp_path), "--group", "i2-g1", "--json").stdout)
    by_number = json.loads(cli("inspect", str(tmp_path), "--group", "7", "--json").stdout)
    assert by_name == by_number
    assert by_name["group"] == "i2-g1" and by_name["group_id"] == 7 and by_name["iteration"] == 2
    assert {e["episode_id"] for e in by_name["episodes"]} == {"i2-g1-e0", "i2-g1-e1", "i2-g1-e2"}
    text = cli("inspect", str(tmp_path), "--group", "i2-g1").stdout
    assert "group i2-g1 (run-wide 7)" in text
    missing = cli("inspect", str(tmp_path), "--group", "i2-g5")
    assert missing.returncode == 2 and "no group i2-g5" in missing.stderr

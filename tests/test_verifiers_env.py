"""`verifiers/env-v0`: verifiers environments, unchanged, as agent programs (envs/verifiers_env.py).

The tasksets are examples/verifiers/lh-addition (single-turn) and lh-tool-sum (a tool served over
MCP), written with verifiers' own classes and installed into .venv-verifiers by `make install`.
Everything here is real: verifiers' own environment, harness and tool server in its interpreter,
the project's endpoint, and for the run the whole loop on the tiny policy.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

import envs
from conftest import REPO
from rl.config import ConfigError, load_config
from rollout.chat import ChatFormat
from rollout.engines.base import Generation
from rollout.trajectory import EpisodeTask

CONFIG = REPO / "configs" / "quickstart_verifiers.yaml"


def _kwargs(**extra) -> str:
    return "env.kwargs=" + json.dumps({"taskset": "lh-addition", **extra})


@pytest.mark.parametrize(
    "override, words",
    [
        (_kwargs(taskset="lh-adition"), "taskset 'lh-adition' not found"),
        (
            _kwargs(config={"num_tasks": "many"}),
            "config.num_tasks: Input should be a valid integer",
        ),
        (
            _kwargs(config={"no_such_knob": 1}),
            "config.no_such_knob: Extra inputs are not permitted",
        ),
        (_kwargs(harness="bash"), "harness bash runs model-written commands"),
        (_kwargs(config=[1]), "config must be a mapping"),
        (_kwargs(timeout_s=0), "timeout_s must be > 0"),
        (_kwargs(max_turns=-1), "max_turns must be an integer >= 0"),
    ],
)
def test_a_bad_taskset_or_value_stops_the_config(override, words):
    """verifiers itself builds the taskset from its config when the run's config loads."""
    with pytest.raises(ConfigError, match="env.kwargs is wrong") as err:
        load_config(CONFIG, [override])
    assert words in str(err.value) and "\n" not in str(err.value)


def test_a_missing_interpreter_is_named_before_anything_starts(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "longhorizon.cli", "train", str(CONFIG), "--run-dir",
         str(tmp_path / "run"), _kwargs(python=str(tmp_path / "no-python"))],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert f"no Python with verifiers at {tmp_path / 'no-python'}" in r.stderr
    assert not (tmp_path / "run").exists()


def test_envs_check_runs_a_verifiers_environment():
    """`envs check` plays three verifiers episodes against an endpoint with a fixed reply (no model)."""
    r = subprocess.run(
        [sys.executable, "-m", "longhorizon.cli", "envs", "check", "verifiers/env-v0",
         "taskset=lh-addition"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == (
        "verifiers/env-v0: ok — an agent program; calls per episode [1, 1, 1], "
        "rewards [0.0, 0.0, 0.0]; every episode one token sequence"
    )


class ToolUser:
    """An engine that plays lh-tool-sum as a competent agent would: a call of `calc_add` with the
    question's number, then the number the tool answered. It reads the prompt as rendered, so what
    it sees is what the harness and the endpoint made of the conversation."""

    version = 0

    def __init__(self, tokenizer):
        self.tok, self.prompts = tokenizer, []

    def generate(self, prompts, *, max_tokens, **_):
        out = []
        for ids in prompts:
            text = self.tok.decode(ids)
            self.prompts.append(text)
            answered = re.findall(r"<tool_response>\s*(-?\d+)\s*</tool_response>", text)
            if answered:
                reply = answered[-1]
            else:
                a = re.findall(r"what is (\d+) \+ 7", text)[-1]
                call = {"name": "calc_add", "arguments": {"a": int(a), "b": 7}}
                reply = f"<tool_call>\n{json.dumps(call)}\n</tool_call>"
            gen = self.tok.encode(reply, add_special_tokens=False)
            gen.append(self.tok.convert_tokens_to_ids("<|im_end|>"))
            out.append(Generation(gen, [0.0] * len(gen), "stop"))
        return out


def test_a_tool_episode_plays_several_turns_with_exact_tokens(tokenizer):
    """lh-tool-sum through verifiers' chat harness and its MCP tool server: the harness sends the
    tool's answer back, the second call extends the first token for token, verifiers' reward
    functions become the reward and milestones, and the task is the taskset's prompt."""
    from rollout.openai_api import OpenAIServer
    from rollout.program_episodes import run_agent_episodes

    engine = ToolUser(tokenizer)
    server = OpenAIServer(engine, tokenizer, "tiny", max_model_len=4096)
    server.start()
    try:
        tasks = [EpisodeTask(f"vf-{k}", 0, seed, 0) for k, seed in enumerate((3, 25))]
        trajs = run_agent_episodes(
            server,
            "verifiers/env-v0",
            {"taskset": "lh-tool-sum"},
            tasks,
            ChatFormat(tokenizer),
            "tiny",
        )
    finally:
        server.stop()
    # seed 25 of a 20-task taskset is its task 5
    for t, n in zip(trajs, (3, 5)):
        assert not t.infra_error, t.infra_error
        assert t.task == f"Use the add tool: what is {n} + 7?"
        assert t.reward == 1.5 and t.failure == "success"
        assert [m["name"] for m in t.milestones] == ["correct", "used_tool", "solved"]
        assert [m["reward"] for m in t.milestones] == [1.0, 0.5, 0.0]
        first, second = t.turns
        assert second.gen_start == first.obs_end > first.gen_end  # one sequence
        observed = tokenizer.decode(t.token_ids[first.gen_end : first.obs_end])
        assert f"<tool_response>\n{n + 7}\n</tool_response>" in observed
        assert tokenizer.decode(t.token_ids[second.gen_start : second.gen_end]).startswith(
            str(n + 7)
        )
        assert sum(t.loss_mask) == sum(u.gen_end - u.gen_start for u in t.turns)
    assert '"name": "calc_add"' in engine.prompts[0]  # the taskset's tool, offered by verifiers
    # max_turns caps the harness: one call, the tool's answer never read back, not solved
    server = OpenAIServer(engine, tokenizer, "tiny", max_model_len=4096)
    server.start()
    try:
        (t,) = run_agent_episodes(
            server, "verifiers/env-v0", {"taskset": "lh-tool-sum", "max_turns": 1},
            [EpisodeTask("vf-cut", 0, 3, 0)], ChatFormat(tokenizer), "tiny",
        )  # fmt: skip
    finally:
        server.stop()
    assert not t.infra_error and len(t.turns) == 1 and "solved" not in str(t.milestones)


def test_a_failed_verifiers_episode_is_an_infrastructure_error(tokenizer):
    """A taskset that cannot load in the worker (its config checked nowhere before: the episode is
    run directly) ends the episode as an infrastructure error naming verifiers' reason."""
    from rollout.openai_api import OpenAIServer
    from rollout.program_episodes import run_agent_episodes
    from rollout.recorded import FixedEngine

    chat = ChatFormat(tokenizer)
    server = OpenAIServer(
        FixedEngine(chat.encode("4") + [chat.eot_id]), tokenizer, "tiny", max_model_len=4096
    )
    server.start()
    try:
        (t,) = run_agent_episodes(
            server, "verifiers/env-v0", {"taskset": "lh-addition", "config": {"num_tasks": 0}},
            [EpisodeTask("vf-bad", 0, 1, 0)], chat, "tiny",
        )  # fmt: skip
    finally:
        server.stop()
    assert t.infra_error and "the taskset has no tasks" in t.infra_error


@pytest.mark.slow
@pytest.mark.parametrize("taskset", ["lh-addition", "lh-tool-sum"])
def test_a_run_trains_a_verifiers_environment(ray_cluster, tiny_policy, tmp_path, taskset):
    """configs/quickstart_verifiers.yaml with the tiny policy, one iteration through the whole loop
    on each taskset; the stored episodes hold the engine's ids, and replay re-runs verifiers on the
    recorded completions to the same calls and rewards."""
    from conftest import started_trainer
    from rl.store import TrajectoryStore

    overrides = [
        "policy.pretrained=",
        f"policy.path={tiny_policy}",
        "lora.enabled=false",
        "rollout.cpus_per_worker=0.1",
        "rollout.groups_per_iteration=1",
        "rollout.group_size=2",
        "iterations=1",
        "stop_after_flat=0",
        "rollout.max_new_tokens=12",
        _kwargs(taskset=taskset),
    ]
    run_dir = tmp_path / "run"
    with started_trainer("quickstart_verifiers.yaml", overrides, run_dir) as trainer:
        row = trainer.iteration(0)
    assert row["episodes"] == 2 and row["infra_errors"] == 0, row
    assert row["rollout_logprob_diff_max"] < 1e-3  # the learner scores the ids the engine sampled
    stored = list(TrajectoryStore(run_dir).trajectories())
    assert len(stored) == 2 and {t.env_id for t in stored} == {"verifiers/env-v0"}
    for t in stored:
        assert t.task.endswith(("Reply with the number only.", "+ 7?")) and t.turns
        assert sum(t.loss_mask) == sum(u.gen_end - u.gen_start for u in t.turns) > 0
    out = subprocess.run(
        [sys.executable, "-m", "longhorizon.cli", "replay", str(run_dir), "--all", "--json"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout)
    assert report["replayed"] == 2 and report["diverged"] == 0


def test_registered_and_described():
    assert envs.is_agent_program(envs.env_class("verifiers/env-v0"))
    assert envs.config_problem("verifiers/env-v0", {"taskset": "lh-addition"}) is None
    r = subprocess.run(
        [sys.executable, "-m", "longhorizon.cli", "envs", "show", "verifiers/env-v0", "--json"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    shown = json.loads(r.stdout)
    # a required argument is shown by its name, not with a default it does not have
    assert shown["kwargs"][:2] == ["taskset", "config=None"]
    assert "verifiers environment, unchanged" in shown["description"]

"""Agent programs as environments (envs/agent_program.py) and their episodes (rollout/agent_program.py):
registration and kwargs checks, results, and the assembly of a session's recorded calls into one
trajectory; on the real engine, an agent written with the `openai` client through the endpoint."""

from __future__ import annotations

import asyncio

import pytest

import envs
from envs.agent_program import AgentResult, AgentTask, result_of, run_program
from rollout.agent_program import assemble, run_agent_episodes
from rollout.chat import ChatFormat
from rollout.openai_api import CallRecord
from rollout.trajectory import EpisodeTask


def echo_agent(task: AgentTask, bonus: float = 0.0) -> AgentResult:
    """Two turns with the model, sending back what it said; reward 1 + bonus when it answered twice."""
    client = task.client()
    messages = [{"role": "user", "content": f"Task {task.seed}: say something."}]
    for turn in range(2):
        reply = client.chat.completions.create(model=task.model, messages=messages, max_tokens=6,
                                               seed=task.seed * 10 + turn).choices[0].message
        messages += [{"role": "assistant", "content": reply.content or ""},
                     {"role": "user", "content": "Again."}]
    return AgentResult(milestones=[{"name": "answered", "reward": 1.0 + bonus}], task=messages[0]["content"])


async def async_agent(task: AgentTask) -> float:
    await asyncio.sleep(0)
    return 0.5


envs.register("agents/echo-v0", "test_agent_program:echo_agent")
TASK = EpisodeTask("i0-g0-e0", 0, 7, 0)


def _records(eot: int, extend: bool = True) -> list[CallRecord]:
    a = CallRecord("s", [1, 2, 3], [10, 11, eot], [-0.1, -0.2, -0.3], 4, "stop", 70)
    prompt = (a.prompt_ids + a.completion_ids if extend else [1, 2, 3, 10, 99, eot]) + [20, 21]
    b = CallRecord("s", prompt, [12, eot], [-0.4, -0.5], 5, "stop", 71)
    return [a, b]


def test_extending_calls_are_one_episode(tokenizer):
    chat = ChatFormat(tokenizer)
    a, b = _records(chat.eot_id)
    result = AgentResult(milestones=[{"name": "solved", "reward": 1.0}], task="the task")
    t = assemble(TASK, "agents/echo-v0", [a, b], result, "", chat, 1.5)
    assert t.token_ids == b.prompt_ids + b.completion_ids and t.prompt_len == 3 and t.task == "the task"
    assert t.loss_mask == [0, 0, 0, 1, 1, 1, 0, 0, 1, 1]
    assert t.rollout_logprobs == [0.0, 0.0, 0.0, -0.1, -0.2, -0.3, 0.0, 0.0, -0.4, -0.5]
    assert [(u.gen_start, u.gen_end, u.obs_end, u.policy_version, u.seed) for u in t.turns] == [(3, 6, 8, 4, 70), (8, 10, 10, 5, 71)]
    assert t.milestones == [{"name": "solved", "reward": 1.0, "turn": 1, "token": 10}]
    assert t.reward == 1.0 and t.failure == "success" and t.stop_reason == "terminated" and not t.infra_error
    assert t.timings == {"agent_s": 1.5} and t.num_generated == 5


def test_a_rewritten_history_or_a_failed_agent_is_an_infrastructure_error(tokenizer):
    chat = ChatFormat(tokenizer)
    t = assemble(TASK, "agents/echo-v0", _records(chat.eot_id, extend=False), AgentResult(reward=1.0), "", chat)
    assert t.failure == "infra_error" and "call 1's prompt does not extend call 0's" in t.infra_error
    assert t.token_ids == [] and t.reward == 0.0  # never trained on re-rendered tokens, never scored 0 either
    t = assemble(TASK, "agents/echo-v0", [], None, "agent program: KeyError: 'x'", chat)
    assert t.infra_error == "agent program: KeyError: 'x'" and t.stop_reason == "infra_error"
    assert "made no call" in assemble(TASK, "agents/echo-v0", [], AgentResult(reward=1.0), "", chat).infra_error


def test_agent_results_and_registration():
    assert result_of(0.5).total() == 0.5 and result_of({"milestones": [{"name": "a", "reward": 0.25}]}).total() == 0.25
    assert result_of(AgentResult(reward=2.0, milestones=[{"name": "a", "reward": 0.25}])).total() == 2.0
    for bad, message in [("yes", "returns a number"), ({"score": 1}, "takes milestones, reward, task"),
                         ({"milestones": [{"name": "a"}]}, "a milestone is"), (float("nan"), "NaN"),
                         ({"milestones": [{"name": "a", "reward": 1}, {"name": "a", "reward": 1}]}, "reached twice")]:
        with pytest.raises(TypeError, match=message):
            result_of(bad)
    task = AgentTask("e", 1, "http://127.0.0.1:1/sessions/e/v1", "m")
    assert run_program(async_agent, task, {}).total() == 0.5  # a coroutine function runs in its own loop
    assert str(task.client().base_url).rstrip("/") == task.base_url
    assert envs.is_agent_program(envs.env_class("agents/echo-v0"))
    assert envs.config_problem("agents/echo-v0", {"bonus": 1.0}) is None
    kind, why = envs.config_problem("agents/echo-v0", {"bonsu": 1.0})
    assert kind == "kwargs" and "does not accept them" in why and "bonus" in why
    assert envs.judge_reference("agents/echo-v0", 3) == "" and envs.host_problem("agents/echo-v0") is None
    with pytest.raises(TypeError, match="is an agent program"):
        envs.make("agents/echo-v0")


def _episodes(engine, tokenizer, env_id: str, kwargs: dict, tasks: list[EpisodeTask]):
    """The agent program's episodes through an endpoint on the session's engine; nothing left recorded."""
    from rollout.openai_api import OpenAIServer

    server = OpenAIServer(engine, tokenizer, "tiny", max_model_len=4096)
    server.start()
    try:
        trajs = run_agent_episodes(server, env_id, kwargs, tasks, ChatFormat(tokenizer), "tiny")
    finally:
        server.stop()
    assert [t.episode_id for t in trajs] == [t.episode_id for t in tasks] and server.records == {}
    return trajs


@pytest.mark.slow
def test_an_openai_client_agent_runs_as_episodes_with_exact_tokens(engine, tokenizer):
    trajs = _episodes(engine, tokenizer, "agents/echo-v0", {"bonus": 0.5},
                      [EpisodeTask(f"i0-g0-e{k}", 0, 3 + k, 0) for k in range(3)])
    for t in trajs:
        assert not t.infra_error and t.reward == 1.5 and len(t.turns) == 2 and t.task.startswith(f"Task {t.seed}")
        first, second = t.turns
        assert second.gen_start == first.obs_end > first.gen_end  # the second prompt extends the first call exactly
        assert tokenizer.decode(t.token_ids[first.gen_end:first.obs_end]).endswith("Again.<|im_end|>\n<|im_start|>assistant\n")
        gen = engine.generate([t.token_ids[:first.gen_start]], max_tokens=6, temperature=1.0, top_p=1.0,
                              stop_token_ids=[tokenizer.eos_token_id], seeds=[t.seed * 10])[0]
        assert t.token_ids[first.gen_start:first.gen_end] == gen.token_ids  # what the engine sampled, not re-rendered
        assert sum(t.loss_mask) == t.num_generated == (first.gen_end - first.gen_start) + (second.gen_end - second.gen_start)


@pytest.mark.slow
def test_a_run_trains_an_openai_client_agent_through_the_endpoint(ray_cluster, tiny_policy, tmp_path):
    """configs/quickstart_openai.yaml with the tiny policy: the calculator agent written with the
    `openai` client runs as episodes; the stored trajectories hold the ids the engine sampled (the
    learner computes the engine's log-probs on them), turns carry their policy version, and the
    run goes on to the next version."""
    from conftest import started_trainer
    from rl.store import TrajectoryStore

    overrides = ["policy.pretrained=", f"policy.path={tiny_policy}", "lora.enabled=false", "warm_start.demos=0",
                 "warm_start.envs=[]", "rollout.cpus_per_worker=0.1", "rollout.groups_per_iteration=1",
                 "rollout.group_size=4", "iterations=2", "stop_after_flat=0", "rollout.temperature=1.0",
                 "algo.entropy_coef=0.01", "env.kwargs={max_turns: 2, max_tokens: 24}"]
    run_dir = tmp_path / "run"
    with started_trainer("quickstart_openai.yaml", overrides, run_dir) as trainer:
        rows = [trainer.iteration(0), trainer.iteration(1)]
    for row in rows:
        assert row["episodes"] == 4 and row["infra_errors"] == 0, row
        assert row["rollout_logprob_diff_max"] < 1e-3  # the learner scores the stored ids as the engine sampled them
    stored = list(TrajectoryStore(run_dir).trajectories())
    assert len(stored) == 8 and all(t.env_id == "agents/calculator-openai-v0" for t in stored)
    for t in stored:
        assert t.task.startswith(("A warehouse", "A library", "A farm")) and 1 <= len(t.turns) <= 2
        assert {u.policy_version for u in t.turns} == {t.iteration}
        assert sum(t.loss_mask) == sum(u.gen_end - u.gen_start for u in t.turns) > 0
        for a, b in zip(t.turns, t.turns[1:]):
            assert a.gen_end <= a.obs_end == b.gen_start  # one sequence: each call extends the last


@pytest.mark.slow
def test_an_agents_sdk_agent_runs_through_the_endpoint(engine, tokenizer):
    """The OpenAI Agents SDK, unchanged but for its model client, drives episodes through the endpoint."""
    trajs = _episodes(engine, tokenizer, "agents/calculator-agents-sdk-v0", {"max_tokens": 16},
                      [EpisodeTask(f"sdk-{k}", 0, 5 + k, 0) for k in range(2)])
    for t in trajs:
        assert not t.infra_error, t.infra_error
        assert t.task.startswith(("A warehouse", "A library", "A farm")) and len(t.turns) >= 1
        assert tokenizer.decode(t.token_ids[:t.prompt_len]).startswith("<|im_start|>system\n# Tools")  # the SDK's tools
        assert '"name": "calculator"' in tokenizer.decode(t.token_ids[:t.prompt_len])

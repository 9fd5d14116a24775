"""Agent programs as environments (envs/agent_program.py) and their episodes (rollout/program_episodes.py):
registration and kwargs checks, results, and the assembly of a session's recorded calls into one
trajectory; on the real engine, an agent written with the `openai` client through the endpoint."""

from __future__ import annotations

import asyncio

import pytest
import torch

import envs
from envs.agent_program import AgentResult, AgentTask, result_of, run_program
from rollout.chat import ChatFormat
from rollout.openai_api import CallRecord
from rollout.program_episodes import assemble, run_agent_episodes
from rollout.trajectory import EpisodeTask


def echo_agent(task: AgentTask, bonus: float = 0.0) -> AgentResult:
    """Two turns with the model, sending back what it said; reward 1 + bonus when it answered twice."""
    client = task.client()
    messages = [{"role": "user", "content": f"Task {task.seed}: say something."}]
    for turn in range(2):
        reply = (
            client.chat.completions.create(
                model=task.model, messages=messages, max_tokens=6, seed=task.seed * 10 + turn
            )
            .choices[0]
            .message
        )
        messages += [
            {"role": "assistant", "content": reply.content or ""},
            {"role": "user", "content": "Again."},
        ]
    return AgentResult(
        milestones=[{"name": "answered", "reward": 1.0 + bonus}], task=messages[0]["content"]
    )


async def async_agent(task: AgentTask) -> float:
    await asyncio.sleep(0)
    return 0.5


def restless_agent(task: AgentTask) -> float:
    """Poses a different task every time, whatever the seed (what `envs check` must catch)."""
    import random

    task.client(max_retries=0).chat.completions.create(
        model=task.model,
        messages=[{"role": "user", "content": f"Add {random.random()} and 1."}],
        max_tokens=4,
    )
    return 0.0


envs.register("agents/echo-v0", "test_agent_program:echo_agent")
envs.register("agents/restless-v0", "test_agent_program:restless_agent")
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
    assert (
        t.token_ids == b.prompt_ids + b.completion_ids
        and t.prompt_len == 3
        and t.task == "the task"
    )
    assert t.loss_mask == [0, 0, 0, 1, 1, 1, 0, 0, 1, 1]
    assert t.rollout_logprobs == [0.0, 0.0, 0.0, -0.1, -0.2, -0.3, 0.0, 0.0, -0.4, -0.5]
    assert [(u.gen_start, u.gen_end, u.obs_end, u.policy_version, u.seed) for u in t.turns] == [
        (3, 6, 8, 4, 70),
        (8, 10, 10, 5, 71),
    ]
    assert t.milestones == [{"name": "solved", "reward": 1.0, "turn": 1, "token": 10}]
    assert (
        t.reward == 1.0
        and t.failure == "success"
        and t.stop_reason == "terminated"
        and not t.infra_error
    )
    assert t.timings == {"agent_s": 1.5} and t.num_generated == 5


def test_a_rewritten_history_becomes_one_sample_per_sequence(tokenizer):
    """A call whose prompt does not extend the call before starts a sequence of its own; calls that
    do extend stay one sequence; the departing call's new tokens are the turn's observation."""
    chat = ChatFormat(tokenizer)
    a, b = _records(chat.eot_id, extend=False)
    c = CallRecord(
        "s", b.prompt_ids + b.completion_ids + [22], [13, chat.eot_id], [-0.6, -0.7], 5, "stop", 72
    )
    result = AgentResult(milestones=[{"name": "solved", "reward": 1.0}])
    t = assemble(TASK, "agents/echo-v0", [a, b, c], result, "", chat)
    assert not t.infra_error and t.reward == 1.0 and t.failure == "success"
    assert t.sample_starts == [0, 6] and t.sample_spans() == [(0, 6), (6, 19)]
    assert t.token_ids == a.prompt_ids + a.completion_ids + c.prompt_ids + c.completion_ids
    assert [i for i, m in enumerate(t.loss_mask) if m] == [3, 4, 5, 14, 15, 17, 18]
    assert [t.rollout_logprobs[i] for i in (3, 14, 15, 17, 18)] == [-0.1, -0.4, -0.5, -0.6, -0.7]
    assert [(u.gen_start, u.gen_end, u.obs_end) for u in t.turns] == [
        (3, 6, 6),
        (14, 16, 17),
        (17, 19, 19),
    ]
    assert t.turns[1].observation == tokenizer.decode([22])  # call 2 extends call 1: one sequence
    # call 1 departs from call 0's sequence at its fifth token: [99, eot, 20, 21] is what it was shown
    assert t.turns[0].observation == tokenizer.decode([99, chat.eot_id, 20, 21])
    assert [p for p in range(len(t.token_ids)) if t.in_prompt(p)] == [0, 1, 2, *range(6, 14)]
    assert t.prompt_len == 3 and t.milestones == [
        {"name": "solved", "reward": 1.0, "turn": 2, "token": 19}
    ]


def test_a_failed_agent_is_an_infrastructure_error(tokenizer):
    chat = ChatFormat(tokenizer)
    t = assemble(TASK, "agents/echo-v0", [], None, "agent program: KeyError: 'x'", chat)
    assert (
        t.infra_error == "agent program: KeyError: 'x'"
        and t.stop_reason == "infra_error"
        and t.reward == 0.0
    )
    assert (
        "made no call"
        in assemble(TASK, "agents/echo-v0", [], AgentResult(reward=1.0), "", chat).infra_error
    )


def _call(chat, messages, text, tools=("add",), seed=0, finish="stop"):
    """A recorded call: its request's messages, the prompt the template renders, `text` sampled."""
    prompt = chat.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    completion = chat.tok.encode(text, add_special_tokens=False) + [chat.eot_id]
    return CallRecord(
        "s",
        list(prompt),
        completion,
        [-0.1] * len(completion),
        0,
        finish,
        seed,
        messages=messages,
        tool_names=list(tools) if tools is not None else None,
    )


def test_an_agent_episode_reads_like_a_native_one(tokenizer):
    """Observations are the tool text the agent sent back (not template tokens); a call to a tool
    the request did not offer is unknown_tool; an agent that stopped while still calling tools ran
    out of requests; the task is the first user message when the agent recorded none."""
    from envs.tool_calls import format_tool_call

    chat = ChatFormat(tokenizer)
    task = [{"role": "user", "content": "Add 2 and 3, then submit."}]
    first = _call(chat, task, format_tool_call("mul", a=2, b=3))
    sent = [
        *task,
        {"role": "assistant", "content": "", "tool_calls": []},
        {"role": "tool", "content": "error: no tool mul"},
    ]
    second = _call(chat, sent, format_tool_call("add", a=2, b=3), seed=1)
    t = assemble(TASK, "agents/echo-v0", [first, second], AgentResult(reward=0.0), "", chat)
    assert t.task == "Add 2 and 3, then submit."
    assert t.turns[0].observation == "error: no tool mul"  # no <|im_start|>, no <tool_response>
    assert t.turns[0].failures == ["unknown_tool"] and t.turns[1].failures == []
    # it stopped while still calling tools: out of requests, put down (as a native episode out of
    # turns is) to the failure of at least half its turns
    assert t.failure == "unknown_tool"
    more = [*sent, {"role": "assistant", "content": ""}, {"role": "tool", "content": "5"}]
    third = _call(chat, more, format_tool_call("add", a=5, b=0), seed=2)
    t = assemble(TASK, "agents/echo-v0", [first, second, third], AgentResult(reward=0.0), "", chat)
    assert t.failure == "out_of_turns" and t.turns[1].observation == "5"
    # the same episode, the agent's last call a plain answer: it answered wrong
    answered = _call(chat, sent, "It is 6.", seed=1)
    wrong = assemble(TASK, "agents/echo-v0", [first, answered], AgentResult(reward=0.0), "", chat)
    assert wrong.failure == "wrong_answer"
    # its last completion cut by max_tokens: out of tokens
    cut = _call(chat, more, "It is", seed=2, finish="length")
    t = assemble(TASK, "agents/echo-v0", [first, second, cut], AgentResult(reward=0.0), "", chat)
    assert t.failure == "out_of_tokens"
    # offered no tools (tool_names None): a call is not held against it
    free = _call(chat, task, format_tool_call("mul", a=2, b=3), tools=None)
    assert (
        assemble(TASK, "agents/echo-v0", [free], AgentResult(reward=1.0), "", chat)
        .turns[0]
        .failures
        == []
    )


def _crashing_agent(task):
    return {"answer": 1}["missing"]


def test_a_crashed_agent_is_named_with_its_line_and_keeps_its_task(tokenizer):
    from rollout.program_episodes import crash_line

    chat = ChatFormat(tokenizer)
    try:
        run_program(_crashing_agent, AgentTask("e", 0, "http://x", "m"), {})
    except KeyError as exc:
        line = crash_line(exc)
    code = _crashing_agent.__code__
    assert line == (
        f"agent program: KeyError: 'missing' (at test_agent_program.py:{code.co_firstlineno + 1} "
        "in _crashing_agent)"
    )
    task = [{"role": "user", "content": "Add 2 and 3."}]
    t = assemble(TASK, "agents/echo-v0", [_call(chat, task, "Hm")], None, line, chat)
    assert t.infra_error == line and t.task == "Add 2 and 3."


def _split_batch(learner, tokenizer) -> list:
    """Group 0: a split episode (two calls whose second prompt re-renders the first: one sample
    each) beside a plain one; group 1: two plain ones. Engine log-probs are the learner's own."""
    from rollout.trajectory import Trajectory, Turn

    def turn(a, b, k):
        return Turn(a, b, b, "x", "", 0, 0, 0, k, "stop")

    out = []
    for i, reward in enumerate([1.0, 0.0, 0.0, 1.0]):
        first = tokenizer.encode(f"ask {i}: what is {i} plus {i}?")
        second = tokenizer.encode(f"ask {i}: what is it? It is {2 * i}, twice {i}.")
        samples = [first, second] if i == 0 else [first + second]
        ids = [x for s in samples for x in s]
        starts = [0, len(first)] if i == 0 else []
        turns = [turn(3, len(first), 0), turn(len(first) + 4, len(ids), 1)]
        mask = [int(any(u.gen_start <= p < u.gen_end for u in turns)) for p in range(len(ids))]
        # each sample scored on its own
        lps = [x for s in samples for x in [0.0] + learner.logprobs(s)]
        milestones = [
            {"name": "half", "reward": reward / 4, "turn": 0, "token": turns[0].gen_end},
            {"name": "rest", "reward": 3 * reward / 4, "turn": 1, "token": len(ids)},
        ]
        out.append(
            Trajectory(
                f"e{i}",
                0,
                i // 2,
                "agents/echo-v0",
                0,
                3,
                ids,
                mask,
                [lp if m else 0.0 for lp, m in zip(lps, mask)],
                turns,
                milestones,
                reward,
                sample_starts=starts,
            )
        )
    return out


@pytest.mark.parametrize("credit", ["episode", "milestone"])
def test_the_learner_trains_each_sample_of_a_split_episode_with_the_episode_s_advantage(
    tiny_policy, tokenizer, credit
):
    """Against a naive reference: the split episode's samples are run as sequences of their own (the
    learner's pre-update log-probs equal each sample scored alone, and the engine's log-probs of
    the samples match them), and every sample's tokens get the episode's advantages (GRPO over the
    group's episodes, the split one counted once; with milestone credit, each turn's own)."""
    from rl.config import AlgoConfig, LearnerConfig
    from rl.learner.credit import token_advantages
    from rl.learner.grpo import group_advantages
    from rl.learner.learner import Learner

    learner = Learner(
        tiny_policy,
        AlgoConfig(credit=credit, scale_rewards="none"),
        LearnerConfig(threads=1),
        seed=0,
    )
    batch = _split_batch(learner, tokenizer)
    split = batch[0]
    alone = [[0.0] + learner.logprobs(split.token_ids[s:e]) for s, e in split.sample_spans()]
    stats = learner.train_step(batch)
    assert stats["rollout_logprob_diff_max"] < 1e-4  # the same numbers as each sample on its own
    assert stats["microbatches"] >= 1 and stats["grad_norm"] > 0
    note = stats["annotations"]["e0"]
    gen = [p for p, m in enumerate(split.loss_mask) if m]
    joined = [x for s in alone for x in s]
    assert [note["learner_logprobs"][p] for p in gen] == pytest.approx(
        [joined[p] for p in gen], abs=1e-5
    )
    if credit == "episode":
        adv = group_advantages(
            torch.tensor([t.reward for t in batch]), torch.tensor([0, 0, 1, 1]), scale="none"
        )
        expected = [[float(adv[i]) if m else 0.0 for m in t.loss_mask] for i, t in enumerate(batch)]
    else:
        expected = [
            [a if m else 0.0 for a, m in zip(row, t.loss_mask)]
            for row, t in zip(token_advantages(batch, baseline="loo"), batch)
        ]
    for i, t in enumerate(batch):
        assert stats["annotations"][t.episode_id]["advantages"] == pytest.approx(
            expected[i], abs=1e-6
        )
    assert len({round(a, 6) for a, m in zip(note["advantages"], split.loss_mask) if m}) == (
        1 if credit == "episode" else 2
    )


def test_ppo_values_of_a_split_episode_s_samples_fit_their_returns(tiny_policy, tokenizer):
    """PPO's returns reach each sample at its own positions: turn-level values before the first
    call (return 2.0: the episode's reward) and before the second (-1.0 to go) fit them."""
    from rl.config import AlgoConfig, LearnerConfig
    from rl.learner.learner import Learner

    learner = Learner(
        tiny_policy,
        AlgoConfig(
            name="ppo", lr=3e-3, vf_coef=1.0, value_clip=10.0, ppo_level="turn", gae_lambda=1.0
        ),
        LearnerConfig(threads=1),
    )
    split = _split_batch(learner, tokenizer)[0]
    split.milestones = [
        {**split.milestones[0], "reward": 3.0},
        {**split.milestones[1], "reward": -1.0},
    ]
    split.reward = 2.0
    losses = [learner.train_step([split, split])["value_loss"] for _ in range(30)]
    assert losses[-1] < 0.2 * losses[0]
    for (s, e), turn, target in zip(split.sample_spans(), split.turns, (2.0, -1.0)):
        with torch.no_grad():
            v = learner.value_head(learner.lm.hidden(torch.tensor([split.token_ids[s:e]]))[:, :-1])[
                0
            ]
        assert v[turn.gen_start - s - 1].item() == pytest.approx(target, abs=0.3)


def test_agent_results_and_registration():
    assert (
        result_of(0.5).total() == 0.5
        and result_of({"milestones": [{"name": "a", "reward": 0.25}]}).total() == 0.25
    )
    assert (
        result_of(AgentResult(reward=2.0, milestones=[{"name": "a", "reward": 0.25}])).total()
        == 2.0
    )
    for bad, message in [
        ("yes", "returns a number"),
        ({"score": 1}, "takes milestones, reward, task"),
        ({"milestones": [{"name": "a"}]}, "a milestone is"),
        (float("nan"), "NaN"),
        ({"milestones": [{"name": "a", "reward": 1}, {"name": "a", "reward": 1}]}, "reached twice"),
    ]:
        with pytest.raises(TypeError, match=message):
            result_of(bad)
    task = AgentTask("e", 1, "http://127.0.0.1:1/sessions/e/v1", "m")
    # a coroutine function runs in its own loop
    assert run_program(async_agent, task, {}).total() == 0.5
    assert str(task.client().base_url).rstrip("/") == task.base_url
    assert envs.is_agent_program(envs.env_class("agents/echo-v0"))
    assert envs.config_problem("agents/echo-v0", {"bonus": 1.0}) is None
    kind, why = envs.config_problem("agents/echo-v0", {"bonsu": 1.0})
    assert kind == "kwargs" and "does not accept them" in why and "bonus" in why
    assert (
        envs.judge_reference("agents/echo-v0", 3) == ""
        and envs.host_problem("agents/echo-v0") is None
    )
    with pytest.raises(TypeError, match="is an agent program"):
        envs.make("agents/echo-v0")


def test_an_external_agent_command(tmp_path):
    """`agents/command-v0`: the session reaches the command through OPENAI_* variables, its last line
    is its result, and every way it can fail is named: exit status with stderr, a timeout that kills
    its whole process group, a last line that is no result, a program that is not there."""
    import sys
    import time
    from pathlib import Path

    from envs.agent_command import command_agent

    task = AgentTask("i0-g0-e1", 9, "http://127.0.0.1:1/sessions/i0-g0-e1/v1", "policy", "key")
    script = (
        "import json, os; print('thinking...'); print(json.dumps({'task': ' '.join(os.environ[k] for k in "
        "('OPENAI_BASE_URL', 'OPENAI_API_KEY', 'OPENAI_MODEL', 'LONGHORIZON_SEED', 'LONGHORIZON_EPISODE_ID', 'EXTRA')),"
        " 'milestones': [{'name': 'solved', 'reward': 1}]}))"
    )
    result = command_agent(task, [sys.executable, "-c", script], env={"EXTRA": 5})
    assert result.task == f"{task.base_url} key policy 9 i0-g0-e1 5" and result.total() == 1.0
    # a shell-quoted string
    assert command_agent(task, f"{sys.executable} -c 'print(0.25)'").total() == 0.25
    with pytest.raises(RuntimeError, match="agent command exited 3: boom"):
        command_agent(
            task, [sys.executable, "-c", "import sys; sys.stderr.write('boom'); sys.exit(3)"]
        )
    with pytest.raises(ValueError, match="last line is not a number or a JSON object: 'done'"):
        command_agent(task, [sys.executable, "-c", "print('done')"])
    with pytest.raises(TypeError, match="returns a number"):
        command_agent(task, [sys.executable, "-c", "print('[1, 2]')"])
    pid_file = tmp_path / "child"
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="timed out after 1 s"):
        command_agent(task, ["sh", "-c", f"sleep 60 & echo $! > {pid_file}; wait"], timeout_s=1)
    assert time.monotonic() - t0 < 10
    child = int(pid_file.read_text())
    time.sleep(0.2)
    # the command's own child went with it (gone, or a zombie
    status = Path(f"/proc/{child}/status")
    assert not status.exists() or "State:\tZ" in status.read_text()  # where PID 1 does not reap)
    problem = envs.config_problem("agents/command-v0", {"command": []})
    assert problem[0] == "kwargs" and "command must be a non-empty list" in problem[1]
    assert (
        "timeout_s must be"
        in envs.config_problem("agents/command-v0", {"command": "x", "timeout_s": 0})[1]
    )
    assert "not an executable program here" in envs.host_problem(
        "agents/command-v0", {"command": ["no-such-agent-x"]}
    )
    assert envs.host_problem("agents/command-v0", {"command": [sys.executable]}) is None


def test_envs_check_runs_an_agent_program_without_a_model(tokenizer):
    """`envs check` on an agent program: episodes against an engine that answers every call with a
    fixed reply; a sound agent passes with its calls counted, a task that changes with the same seed
    and an agent that fails are named, all at once."""
    import subprocess
    import sys

    from envs.check import EnvCheckError
    from rollout.program_episodes import check_agent_program

    report = check_agent_program("agents/echo-v0", {"bonus": 1.0}, tokenizer, seed=4)
    assert (
        report["calls"] == [2, 2, 2]
        and report["rewards"] == [2.0, 2.0, 2.0]
        and report["samples"] == [1, 1, 1]
    )
    assert report["task"] == "Task 4: say something."
    with pytest.raises(EnvCheckError) as err:
        check_agent_program("agents/restless-v0", {}, tokenizer)
    assert err.value.problems == [
        "seed 0 posed two different tasks (its first prompts differ): the same seed must "
        "give the same task, or groups compare episodes of different tasks"
    ]
    with pytest.raises(EnvCheckError) as err:
        check_agent_program("agents/echo-v0", {"bonus": "x"}, tokenizer)
    assert len(err.value.problems) == 3 and all(
        "agent program: TypeError" in p for p in err.value.problems
    )
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "longhorizon.cli",
            "envs",
            "check",
            "agents/calculator-openai-v0",
            "max_turns=2",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == (
        "agents/calculator-openai-v0: ok — an agent program; calls per episode [2, 2, 2], "
        "rewards [0.0, 0.0, 0.0]; every episode one token sequence"
    )


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
    trajs = _episodes(
        engine,
        tokenizer,
        "agents/echo-v0",
        {"bonus": 0.5},
        [EpisodeTask(f"i0-g0-e{k}", 0, 3 + k, 0) for k in range(3)],
    )
    for t in trajs:
        assert (
            not t.infra_error
            and t.reward == 1.5
            and len(t.turns) == 2
            and t.task.startswith(f"Task {t.seed}")
        )
        first, second = t.turns
        # the second prompt extends the first call exactly
        assert second.gen_start == first.obs_end > first.gen_end
        assert tokenizer.decode(t.token_ids[first.gen_end : first.obs_end]).endswith(
            "Again.<|im_end|>\n<|im_start|>assistant\n"
        )
        gen = engine.generate(
            [t.token_ids[: first.gen_start]],
            max_tokens=6,
            temperature=1.0,
            top_p=1.0,
            stop_token_ids=[tokenizer.eos_token_id],
            seeds=[t.seed * 10],
        )[0]
        # what the engine sampled, not re-rendered
        assert t.token_ids[first.gen_start : first.gen_end] == gen.token_ids
        assert (
            sum(t.loss_mask)
            == t.num_generated
            == (first.gen_end - first.gen_start) + (second.gen_end - second.gen_start)
        )


@pytest.mark.slow
def test_a_template_that_rewrites_history_gives_one_sample_per_call(engine, thinking_policy):
    """With a thinking template (the generation prompt opens `<think>`, history drops it), the second
    call's prompt cannot extend the first call's ids: the episode is two samples, each its call's
    rendered prompt and exactly what the engine sampled for it."""
    from transformers import AutoTokenizer

    thinking = AutoTokenizer.from_pretrained(thinking_policy)
    trajs = _episodes(
        engine,
        thinking,
        "agents/echo-v0",
        {},
        [EpisodeTask(f"i0-g0-e{k}", 0, 3 + k, 0) for k in range(2)],
    )
    for t in trajs:
        assert (
            not t.infra_error
            and t.reward == 1.0
            and len(t.turns) == 2
            and len(t.sample_starts) == 2
        )
        spans = t.sample_spans()
        for (s, e), turn, k in zip(spans, t.turns, range(2)):
            prompt = t.token_ids[s : turn.gen_start]
            assert (
                thinking.decode(prompt).endswith("<|im_start|>assistant\n<think>\n")
                and turn.gen_end == e
            )
            gen = engine.generate(
                [prompt],
                max_tokens=6,
                temperature=1.0,
                top_p=1.0,
                stop_token_ids=[thinking.eos_token_id],
                seeds=[t.seed * 10 + k],
            )[0]
            # what the engine sampled for that prompt
            assert t.token_ids[turn.gen_start : e] == gen.token_ids
        second = thinking.decode(t.token_ids[spans[1][0] : t.turns[1].gen_start])
        # history re-rendered without it
        assert second.count("<think>") == 1 and "Again.<|im_end|>" in second
        first_seq = t.token_ids[: spans[0][1]]
        assert t.token_ids[spans[1][0] : spans[1][0] + len(first_seq)] != first_seq


@pytest.mark.slow
def test_a_run_trains_the_samples_of_a_rewriting_template(ray_cluster, thinking_policy, tmp_path):
    """A training run through the endpoint with the thinking template: every episode (two calls, the
    second after "No tool call found") is split, counted, trained with the learner scoring each
    sample as the engine did, and stored with its samples."""
    from conftest import started_trainer
    from rl.store import TrajectoryStore

    overrides = [
        "policy.pretrained=",
        f"policy.path={thinking_policy}",
        "lora.enabled=false",
        "warm_start.demos=0",
        "warm_start.envs=[]",
        "rollout.cpus_per_worker=0.1",
        "rollout.groups_per_iteration=1",
        "rollout.group_size=4",
        "iterations=1",
        "stop_after_flat=0",
        "rollout.temperature=1.0",
        "algo.entropy_coef=0.01",
        "env.kwargs={max_turns: 2, max_tokens: 24}",
    ]
    with started_trainer("quickstart_openai.yaml", overrides, tmp_path / "run") as trainer:
        row = trainer.iteration(0)
    stored = list(TrajectoryStore(tmp_path / "run").trajectories())
    calls = [len(t.turns) for t in stored]
    assert row["infra_errors"] == 0 and row["episodes_trained"] == 4, row
    assert row["split_episodes"] == sum(n > 1 for n in calls) > 0, (row, calls)
    # each sample scored on its own, as the engine sampled it
    assert row["rollout_logprob_diff_max"] < 1e-3
    for t in stored:
        assert len(t.sample_spans()) == len(t.turns) and t.sample_spans()[-1][1] == len(t.token_ids)
    # replay: the recorded completions give the agent the same calls, split where they were split
    import dataclasses

    from longhorizon.replay import agent_tokenizer, replay_episode

    tok = agent_tokenizer(tmp_path / "run", stored)
    kwargs = {"max_turns": 2, "max_tokens": 24}
    results = [replay_episode(t, kwargs, tokenizer=tok) for t in stored]
    assert all(r.ok for r in results) and [r.turns_checked for r in results] == calls, results
    first = next(t for t in stored if t.sample_starts)
    turn = first.turns[0]

    def answered_otherwise(pos: int):  # the first call's answer with one token changed
        ids = list(first.token_ids)
        ids[pos] ^= 1
        return replay_episode(dataclasses.replace(first, token_ids=ids), kwargs, tokenizer=tok)

    # the change must be one the agent sees: this template drops what precedes `</think>` (and leading
    # newlines) from the history, so a change there rightly replays fine. The last token before the
    # stop token is kept unless it closes the think block, so the search from the end ends at once.
    replays = (answered_otherwise(pos) for pos in range(turn.gen_end - 2, turn.gen_start - 1, -1))
    bad = next((r for r in replays if not r.ok), None)
    assert (
        bad is not None
        and bad.turns_checked == 1
        and "call 1's prompt departs from the record at token" in bad.divergence
    )
    # inspect and the viewer show the samples: where each starts, its prompt as prompt, not observation
    import io
    import re

    from rich.console import Console

    from longhorizon.inspect import print_episode, token_rows
    from longhorizon.viewer import write_html

    split = next(t for t in stored if t.sample_starts)
    console = Console(file=io.StringIO(), width=200)
    print_episode(tmp_path / "run", split.episode_id, console)
    shown = console.file.getvalue()
    assert "2 samples" in shown and re.search(
        r"sample 2 of 2: the history was rewritten .* \((\d+) tokens\)", shown
    )
    page = token_rows(tmp_path / "run", split.episode_id, 0, len(split.token_ids))
    roles = [r["role"] for r in page["rows"]]
    second = split.sample_starts[1]
    assert (
        set(roles[second : split.turns[1].gen_start]) == {"prompt"} and "observation" not in roles
    )
    assert all(r["learner_logprob"] is not None for r in page["rows"] if r["role"] == "generated")
    html = write_html(tmp_path / "run", tmp_path / "v.html").read_text()
    assert f'"samples": [0, {second}]' in html and "sample-start" in html


@pytest.mark.slow
def test_a_run_trains_an_openai_client_agent_through_the_endpoint(
    ray_cluster, tiny_policy, tmp_path
):
    """configs/quickstart_openai.yaml with the tiny policy: the calculator agent written with the
    `openai` client runs as episodes; the stored trajectories hold the ids the engine sampled (the
    learner computes the engine's log-probs on them), turns carry their policy version, and the
    run goes on to the next version."""
    from conftest import started_trainer
    from rl.store import TrajectoryStore

    overrides = [
        "policy.pretrained=",
        f"policy.path={tiny_policy}",
        "lora.enabled=false",
        "warm_start.demos=0",
        "warm_start.envs=[]",
        "rollout.cpus_per_worker=0.1",
        "rollout.groups_per_iteration=1",
        "rollout.group_size=4",
        "iterations=2",
        "stop_after_flat=0",
        "rollout.temperature=1.0",
        "algo.entropy_coef=0.01",
        "env.kwargs={max_turns: 2, max_tokens: 24}",
    ]
    run_dir = tmp_path / "run"
    with started_trainer("quickstart_openai.yaml", overrides, run_dir) as trainer:
        rows = [trainer.iteration(0), trainer.iteration(1)]
    for row in rows:
        assert row["episodes"] == 4 and row["infra_errors"] == 0, row
        # the learner scores the stored ids as the engine sampled them
        assert row["rollout_logprob_diff_max"] < 1e-3
    stored = list(TrajectoryStore(run_dir).trajectories())
    assert len(stored) == 8 and all(t.env_id == "agents/calculator-openai-v0" for t in stored)
    for t in stored:
        assert t.task.startswith(("A warehouse", "A library", "A farm")) and 1 <= len(t.turns) <= 2
        assert {u.policy_version for u in t.turns} == {t.iteration}
        assert sum(t.loss_mask) == sum(u.gen_end - u.gen_start for u in t.turns) > 0
        for a, b in zip(t.turns, t.turns[1:]):
            assert a.gen_end <= a.obs_end == b.gen_start  # one sequence: each call extends the last
    # replay: the agent runs again on the recorded completions and makes the same calls, earns the same
    import json
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "longhorizon.cli", "replay", str(run_dir), "--all", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout)
    assert report["replayed"] == 8 and report["diverged"] == 0
    assert sorted(r["turns_checked"] for r in report["results"]) == sorted(
        len(t.turns) for t in stored
    )


@pytest.mark.slow
def test_an_agent_command_runs_through_the_endpoint(engine, tokenizer):
    """`agents/calculator-command-v0`: the calculator agent in a process of its own, reading its session
    from OPENAI_BASE_URL, runs as episodes with the tokens the engine sampled."""
    trajs = _episodes(
        engine,
        tokenizer,
        "agents/calculator-command-v0",
        {"max_turns": 2, "max_tokens": 16},
        [EpisodeTask(f"cmd-{k}", 0, 11 + k, 0) for k in range(2)],
    )
    for t in trajs:
        assert not t.infra_error, t.infra_error
        assert t.task.startswith(("A warehouse", "A library", "A farm")) and 1 <= len(t.turns) <= 2
        assert '"name": "calculator"' in tokenizer.decode(t.token_ids[: t.prompt_len])
        assert sum(t.loss_mask) == sum(u.gen_end - u.gen_start for u in t.turns) > 0


@pytest.mark.slow
def test_an_agents_sdk_agent_runs_through_the_endpoint(engine, tokenizer):
    """The OpenAI Agents SDK, unchanged but for its model client, drives episodes through the endpoint."""
    trajs = _episodes(
        engine,
        tokenizer,
        "agents/calculator-agents-sdk-v0",
        {"max_tokens": 16},
        [EpisodeTask(f"sdk-{k}", 0, 5 + k, 0) for k in range(2)],
    )
    for t in trajs:
        assert not t.infra_error, t.infra_error
        assert t.task.startswith(("A warehouse", "A library", "A farm")) and len(t.turns) >= 1
        assert tokenizer.decode(t.token_ids[: t.prompt_len]).startswith(
            "<|im_start|>system\n# Tools"
        )  # the SDK's tools
        assert '"name": "calculator"' in tokenizer.decode(t.token_ids[: t.prompt_len])

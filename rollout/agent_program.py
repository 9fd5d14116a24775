"""Episodes of an agent program (envs/agent_program.py): run it against an OpenAI-compatible
endpoint on the rollout engine (rollout/openai_api.py), one session per episode, and assemble each
session's recorded calls into the episode's `Trajectory`.

Assembly: when every call's prompt extends the previous call's prompt + completion — the endpoint
splices them whenever the agent sends back what it got and the template only appends — the episode
is one token sequence, exactly as the agent loop would have recorded it: the last call's prompt +
completion, loss mask 1 on each call's completion with the engine's log-probs, one `Turn` per call
(its observation: the tokens the next call added). The agent's milestones count at its last call.

Not covered here (yet): an episode whose history was rewritten between calls (a template that drops
earlier reasoning, an agent that edits or summarises its messages, `n` > 1 with one choice kept)
should become one training sample per call with the episode's advantage; until the learner takes
such samples, it is an infrastructure error that says which call broke the chain, counted and kept
out of training, never trained on re-rendered tokens. Per-session limits on calls and tokens are
the agent's own business.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import envs
from envs.agent_program import AgentResult, AgentTask, run_program
from envs.tool_calls import parse_tool_calls
from rewards.milestones import solved
from rollout.chat import ChatFormat
from rollout.openai_api import CallRecord
from rollout.trajectory import EpisodeTask, Trajectory, Turn, failure_kind

REWRITTEN = "the agent's history was rewritten"


def extends(prev: CallRecord, rec: CallRecord) -> bool:
    """`rec`'s prompt starts with `prev`'s prompt and completion, token for token."""
    seq = prev.prompt_ids + prev.completion_ids
    return rec.prompt_ids[: len(seq)] == seq


def assemble(task: EpisodeTask, env_id: str, records: list[CallRecord], result: AgentResult | None, error: str,
             chat: ChatFormat, seconds: float = 0.0) -> Trajectory:
    """The episode's trajectory from its session's calls (see the module doc)."""
    t = Trajectory(task.episode_id, task.iteration, task.group_id, env_id, task.seed, 0, [], [], [],
                   task=result.task if result else "", timings={"agent_s": seconds})
    if not records and not error:
        error = "the agent program made no call to the model"
    broken = next((k for k in range(1, len(records)) if not extends(records[k - 1], records[k])), None)
    if broken is not None and not error:
        error = (f"{REWRITTEN}: call {broken}'s prompt does not extend call {broken - 1}'s prompt and completion "
                 "(per-call samples are not trained yet)")
    if records and broken is None:
        last = records[-1]
        t.token_ids = last.prompt_ids + last.completion_ids
        t.prompt_len = len(records[0].prompt_ids)
        t.loss_mask, t.rollout_logprobs = [0] * len(t.token_ids), [0.0] * len(t.token_ids)
        for k, rec in enumerate(records):
            start, end = len(rec.prompt_ids), len(rec.prompt_ids) + len(rec.completion_ids)
            t.loss_mask[start:end] = [1] * (end - start)
            t.rollout_logprobs[start:end] = rec.logprobs
            obs_end = len(records[k + 1].prompt_ids) if k + 1 < len(records) else end
            text = chat.decode(rec.completion_ids)
            calls, bad = parse_tool_calls(text)
            t.turns.append(Turn(start, end, obs_end, text, chat.tok.decode(t.token_ids[end:obs_end]), len(calls), len(bad),
                                rec.policy_version, rec.seed, rec.finish_reason,
                                failures=["malformed_call"] * len(bad)))
    if error:
        t.infra_error, t.stop_reason, t.failure = error, "infra_error", "infra_error"
        return t
    end = t.turns[-1].gen_end
    t.milestones = [{"name": m["name"], "reward": float(m["reward"]), "turn": len(t.turns) - 1, "token": end}
                    for m in result.milestones]
    t.reward, t.stop_reason = result.total(), "terminated"
    t.failure = failure_kind("terminated", t.turns, solved(t.milestones))
    return t


def run_agent_episodes(server, env_id: str, env_kwargs: dict, tasks: list[EpisodeTask], chat: ChatFormat,
                       model: str) -> list[Trajectory]:
    """Each task as one run of the agent program registered as `env_id`, all at once (a thread
    each: the endpoint batches their calls), through `server`'s sessions."""
    program = envs.env_class(env_id)
    kwargs = {**envs.spec(env_id).kwargs, **(env_kwargs or {})}

    def one(task: EpisodeTask) -> Trajectory:
        t0, result, error = time.perf_counter(), None, ""
        try:
            result = run_program(program, AgentTask(task.episode_id, task.seed, server.base_url(task.episode_id), model,
                                                    server.api_key or "unused"), kwargs)
        except Exception as exc:  # noqa: BLE001  (user code: its failure is the episode's, named)
            error = f"agent program: {type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
        return assemble(task, env_id, server.take(task.episode_id), result, error, chat, time.perf_counter() - t0)

    if not tasks:
        return []
    with ThreadPoolExecutor(max_workers=min(64, len(tasks)), thread_name_prefix="agent") as pool:
        futures = [pool.submit(one, task) for task in tasks]
        if server.batcher.needs_driver:  # the engine is this thread's to drive (rollout/openai_api.py Batcher)
            server.batcher.drive(lambda: all(f.done() for f in futures))
        return [f.result() for f in futures]

"""Episodes of an agent program (envs/agent_program.py): run it against an OpenAI-compatible
endpoint on the rollout engine (rollout/openai_api.py), one session per episode, and assemble each
session's recorded calls into the episode's `Trajectory`.

Assembly: when every call's prompt extends the previous call's prompt + completion — the endpoint
splices them whenever the agent sends back what it got and the template only appends — the episode
is one token sequence, exactly as the agent loop would have recorded it: the last call's prompt +
completion, loss mask 1 on each call's completion with the engine's log-probs, one `Turn` per call
(its observation: the tokens the next call added). The agent's milestones count at its last call.

When a call's prompt does not extend the previous call's (a template that drops earlier reasoning
from the history, an agent that edits or summarises its messages, `n` > 1 with one choice kept),
the sequence ends there and that call starts a new one: the episode is stored as its sequences one
after another (`Trajectory.sample_starts`), each trained as a sample of its own with the episode's
advantage, so nothing is ever trained on tokens the policy did not see. The turn before such a
break shows as its observation what the next call's prompt holds from where it departs from the
earlier sequence. Per-session limits on calls and tokens are the agent's own business.

What an episode shows reads like a native one: a turn's observation is what the agent sent back
after it, as text (tool results as their content, other messages with their role), taken from the
requests' messages rather than decoded template tokens; a call to a tool the request did not offer
is an `unknown_tool` turn, a malformed block a `malformed_call` one; an unsolved episode whose last
call still called a tool ran out of requests (`out_of_turns`, or the failure most of its turns
had), one whose last completion hit max_tokens `out_of_tokens`, the rest `wrong_answer`. The task
is the agent's own record, else its first request's first user message, so a crashed agent's
episode still shows what it was asked; its crash names the file, line and function it came from.
"""

from __future__ import annotations

import sysconfig
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import envs
from envs.agent_program import AgentResult, AgentTask, run_program
from envs.tool_calls import parse_tool_calls
from rewards.milestones import solved
from rollout.chat import ChatFormat
from rollout.openai_api import CallRecord
from rollout.trajectory import EpisodeTask, Trajectory, Turn, failure_kind, first_difference

RUNNER = Path(envs.agent_program.__file__)


def extends(prev: CallRecord, rec: CallRecord) -> bool:
    """`rec`'s prompt starts with `prev`'s prompt and completion, token for token."""
    seq = prev.prompt_ids + prev.completion_ids
    return rec.prompt_ids[: len(seq)] == seq


def chains(records: list[CallRecord]) -> list[list[CallRecord]]:
    """The calls cut where one does not extend the one before: each chain is one token sequence."""
    out: list[list[CallRecord]] = []
    for k, rec in enumerate(records):
        if k and extends(records[k - 1], rec):
            out[-1].append(rec)
        else:
            out.append([rec])
    return out


def shown(before: list[dict], after: list[dict]) -> list[dict]:
    """The messages of a request (`after`) that the request before it (`before`) did not hold,
    without the assistant's reply between them: what the agent was given since its last call."""
    p = 0
    while p < min(len(before), len(after)) and before[p] == after[p]:
        p += 1
    new = after[p:]
    while new and new[0]["role"] == "assistant":
        new = new[1:]
    return new


def as_text(messages: list[dict]) -> str:
    """Tool results as their content, other messages as `role: content`."""
    return "\n".join(
        m["content"] if m["role"] == "tool" else f"{m['role']}: {m['content']}" for m in messages
    )


def first_user_message(records: list[CallRecord]) -> str:
    """The first request's first user message: the task as the agent posed it."""
    messages = records[0].messages if records else []
    return next((m["content"] for m in messages if m["role"] == "user"), "")


def crash_line(exc: BaseException) -> str:
    """An agent program's exception as one line, with the file, line and function it came from:
    the last frame of the agent's own code (not of a library it called, nor of what runs it here),
    else the last frame."""
    frames = traceback.extract_tb(exc.__traceback__)
    libraries = (sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"])
    runners = {str(RUNNER), __file__}
    own = [
        f for f in frames if not f.filename.startswith(libraries) and f.filename not in runners
    ] or frames[-1:]
    where = ""
    if own:
        last = own[-1]
        where = f" (at {Path(last.filename).name}:{last.lineno} in {last.name})"
    return f"agent program: {type(exc).__name__}: {' '.join(str(exc).split())[:300]}{where}"


def assemble(
    task: EpisodeTask,
    env_id: str,
    records: list[CallRecord],
    result: AgentResult | None,
    error: str,
    chat: ChatFormat,
    seconds: float = 0.0,
) -> Trajectory:
    """The episode's trajectory from its session's calls (see the module doc)."""
    t = Trajectory(
        task.episode_id,
        task.iteration,
        task.group_id,
        env_id,
        task.seed,
        0,
        [],
        [],
        [],
        task=(result.task if result else "") or first_user_message(records),
        timings={"agent_s": seconds},
    )
    if not records and not error:
        error = "the agent program made no call to the model"
    parts = chains(records)
    # the call that departs
    following = {id(chain[-1]): nxt[0] for chain, nxt in zip(parts, parts[1:])}
    for chain in parts:
        offset, last = len(t.token_ids), chain[-1]
        if len(parts) > 1:
            t.sample_starts.append(offset)
        n = len(last.prompt_ids) + len(last.completion_ids)
        t.token_ids += last.prompt_ids + last.completion_ids
        t.loss_mask += [0] * n
        t.rollout_logprobs += [0.0] * n
        for k, rec in enumerate(chain):
            start = offset + len(rec.prompt_ids)
            end = start + len(rec.completion_ids)
            t.loss_mask[start:end] = [1] * (end - start)
            t.rollout_logprobs[start:end] = rec.logprobs
            obs_end = offset + len(chain[k + 1].prompt_ids) if k + 1 < len(chain) else end
            nxt = chain[k + 1] if k + 1 < len(chain) else following.get(id(rec))
            if nxt is not None and rec.messages and nxt.messages:
                observation = as_text(shown(rec.messages, nxt.messages))
            elif id(rec) in following:  # the next call's prompt, from where it departs
                ids = following[id(rec)].prompt_ids
                observation = chat.tok.decode(
                    ids[first_difference(rec.prompt_ids + rec.completion_ids, ids) :]
                )
            else:
                observation = chat.tok.decode(t.token_ids[end:obs_end])
            text = chat.decode(rec.completion_ids)
            calls, bad = parse_tool_calls(text)
            offered = rec.tool_names
            unknown = [c for c in calls if offered is not None and c.name not in offered]
            t.turns.append(
                Turn(
                    start,
                    end,
                    obs_end,
                    text,
                    observation,
                    len(calls),
                    len(bad) + len(unknown),
                    rec.policy_version,
                    rec.seed,
                    rec.finish_reason,
                    failures=["malformed_call"] * len(bad) + ["unknown_tool"] * len(unknown),
                )
            )
    t.prompt_len = len(records[0].prompt_ids) if records else 0
    if error:
        t.infra_error, t.stop_reason, t.failure = error, "infra_error", "infra_error"
        return t
    end = t.turns[-1].gen_end
    t.milestones = [
        {"name": m["name"], "reward": float(m["reward"]), "turn": len(t.turns) - 1, "token": end}
        for m in result.milestones
    ]
    t.reward, t.stop_reason = result.total(), "terminated"
    last = t.turns[-1]
    if last.tool_calls:  # it stopped while still acting: out of requests
        t.failure = failure_kind("max_turns", t.turns, solved(t.milestones))
    elif last.finish_reason == "length":
        t.failure = failure_kind("max_tokens", t.turns, solved(t.milestones))
    else:
        t.failure = failure_kind("terminated", t.turns, solved(t.milestones))
    return t


def run_agent_episodes(
    server, env_id: str, env_kwargs: dict, tasks: list[EpisodeTask], chat: ChatFormat, model: str
) -> list[Trajectory]:
    """Each task as one run of the agent program registered as `env_id`, all at once (a thread
    each: the endpoint batches their calls), through `server`'s sessions."""
    program = envs.env_class(env_id)
    kwargs = {**envs.spec(env_id).kwargs, **(env_kwargs or {})}

    def one(task: EpisodeTask) -> Trajectory:
        t0, result, error = time.perf_counter(), None, ""
        try:
            result = run_program(
                program,
                AgentTask(
                    task.episode_id,
                    task.seed,
                    server.base_url(task.episode_id),
                    model,
                    server.api_key or "unused",
                ),
                kwargs,
            )
        except Exception as exc:  # noqa: BLE001  (user code: its failure is the episode's, named)
            error = crash_line(exc)
        return assemble(
            task,
            env_id,
            server.take(task.episode_id),
            result,
            error,
            chat,
            time.perf_counter() - t0,
        )

    if not tasks:
        return []
    with ThreadPoolExecutor(max_workers=min(64, len(tasks)), thread_name_prefix="agent") as pool:
        futures = [pool.submit(one, task) for task in tasks]
        # the engine is this thread's to drive (rollout/openai_api.py Batcher)
        if server.batcher.needs_driver:
            server.batcher.drive(lambda: all(f.done() for f in futures))
        return [f.result() for f in futures]


def check_agent_program(
    env_id: str,
    kwargs: dict,
    tokenizer,
    seed: int = 0,
    reply: str = "I am not sure how to do this.",
) -> dict:
    """`envs check` for an agent program: three episodes (`seed` twice, then `seed + 1`) through an
    endpoint whose engine answers every call with `reply` (rollout/recorded.py `FixedEngine`, no
    model), checking what a run relies on: each episode makes calls, ends without an error and
    returns a valid result, and the same seed poses the same task (the same first prompt). Every
    problem is raised at once (`EnvCheckError`); else a report of calls, samples and rewards."""
    from envs.check import EnvCheckError
    from rollout.openai_api import OpenAIServer
    from rollout.recorded import FixedEngine

    chat = ChatFormat(tokenizer)
    server = OpenAIServer(
        FixedEngine(chat.encode(reply) + [chat.eot_id]), tokenizer, "check", max_model_len=1 << 20
    )
    server.start()
    try:
        tasks = [EpisodeTask(f"check-{k}", 0, s, 0) for k, s in enumerate((seed, seed, seed + 1))]
        trajs = run_agent_episodes(server, env_id, kwargs, tasks, chat, "check")
    finally:
        server.stop()
    problems = [f"seed {t.seed}: {t.infra_error}" for t in trajs if t.infra_error]
    a, b = trajs[0], trajs[1]
    if (
        a.turns
        and b.turns
        and (
            a.task != b.task
            or a.token_ids[: a.turns[0].gen_start] != b.token_ids[: b.turns[0].gen_start]
        )
    ):
        problems.append(
            f"seed {seed} posed two different tasks (its first prompts differ): the same seed must "
            "give the same task, or groups compare episodes of different tasks"
        )
    if problems:
        raise EnvCheckError(problems)
    return {
        "calls": [len(t.turns) for t in trajs],
        "samples": [len(t.sample_spans()) for t in trajs],
        "rewards": [t.reward for t in trajs],
        "task": a.task,
    }

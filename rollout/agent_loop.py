"""The agent loop: generate → parse tool calls → env.step → append observation, for a batch of
episodes (in lockstep, or each on its own: below), token-in/token-out.

Every episode's context is a list of token ids that only grows: the prompt, then for each turn the
ids the engine sampled (loss mask 1, with their log-probs) and the tokenised observation (mask 0).
Two ways to drive the episodes, the same turns either way:
- lockstep: each turn is one batched `engine.generate` over all live episodes, then all their env
  steps at once; a slow environment holds back its batch's next turn.
- each on its own (per-episode asynchrony), where the engine batches continuously
  (`engine.continuous_batching`: rollout/engines/shared.py): every episode runs its turns on a
  thread of its own, one generate request per turn; the engine batches the requests of whichever
  episodes are generating at each step, so an episode's tool call starts as soon as its own turn
  is sampled and its next turn joins the batch as soon as its tool returns.

What an environment tells the loop beside its observations is typed: `envs.ResetInfo` and
`envs.StepInfo` (envs/base.py). An environment that raises (in reset or step) or reports
`info["infra_error"]` ends that episode with stop reason `infra_error` and the message; the batch
and the worker carry on, and the learner keeps such episodes out of its group statistics.

The episodes' environments are reset and stepped concurrently on threads: sandboxed tools spend
their time in subprocesses, remote environments (`envs.env_worker.RemoteEnv`) in Ray calls.

Partial rollouts (`continue_episodes` with a `token_budget`): once a call has generated its budget
of tokens, the episodes still running are handed back suspended, their environments open, and the
next call continues them (with whatever weights the engine holds by then; every turn records its
policy version). An episode in its `max_segments`-th call runs to its end whatever the budget, so
no episode spans more calls than that.

Context management (`context`, rollout/context.py): in `window` and `compact` modes an episode
whose context passes the threshold continues from a rebuilt one, a new segment of its token ids
(`Trajectory.sample_starts`); each context is bounded by `max_model_len` and the whole episode by
`max_episode_tokens`. A compaction turn (the policy's summary) runs no tool and counts against no
turn limit; `max_turns` counts the turns that act.

Not covered: per-episode asynchrony on an engine that cannot batch continuously (the native
engine: the episodes then run in lockstep).
"""

from __future__ import annotations

import threading
import time
import zlib
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait

import envs
from rollout.chat import ChatFormat
from rollout.context import COMPACT_INSTRUCTION, ContextConfig, summary_note, window_note
from rollout.engines.base import Engine
from rollout.trajectory import EpisodeTask, Trajectory, Turn, failure_kind

FULL = ContextConfig()


def turn_seed(run_seed: int, episode_id: str, turn: int) -> int:
    return zlib.crc32(f"{run_seed}:{episode_id}:{turn}".encode()) & 0x7FFFFFFF


class _Episode:
    """One running episode: its token ids (every segment so far), the current segment's start, and
    what a rebuilt context is made of (the task, the tools, each acting turn's own tokens)."""

    def __init__(self, task: EpisodeTask, env, prompt: list[int]):
        self.task, self.env = task, env
        self.ids = list(prompt)
        self.mask = [0] * len(prompt)
        self.logprobs = [0.0] * len(prompt)
        self.turns: list[Turn] = []
        self.milestones: list[dict] = []
        self.reward = 0.0
        self.stop_reason = ""
        self.task_text = ""
        self.infra_error = ""
        self.gen_s = 0.0
        self.env_s = 0.0
        self.turn_start = 0
        self.routed: list[list[list[int]]] = [[] for _ in prompt]
        self.any_routed = False
        self.max_tokens = 0  # the episode's token limit (all its segments), fixed when it starts
        self.context_limit = 0  # the most tokens one context may hold
        self.segments = 1  # calls it has run in (partial rollouts)
        self.tools: list | None = None
        self.context_start = (
            0  # where the context the engine sees (the current context segment) begins in `ids`
        )
        # every context segment's start, once there is more than one
        self.sample_starts: list[int] = []
        # acting turn -> its generated ids and its observation
        self.own_ids: dict[int, list[int]] = {}
        self.summarising = False  # the next turn is a compaction turn
        self.managed = FULL  # the context management it runs under (rollout/context.py)

    @property
    def context(self) -> list[int]:
        return self.ids[self.context_start :]

    def room(self) -> int:
        """Tokens the next turn may take: what both the context and the episode still hold."""
        return min(
            self.context_limit - len(self.ids) + self.context_start, self.max_tokens - len(self.ids)
        )

    def fail(self, message: str) -> None:
        self.stop_reason, self.infra_error = "infra_error", message

    def append(self, ids: list[int]) -> None:
        """Tokens the policy did not generate (observations, a rebuilt context's prompt)."""
        self.ids += ids
        self.mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.routed += [[] for _ in ids]


def _room_to_generate(ep: _Episode) -> bool:
    """At least one sampled token plus a possible closing token still fit the context and the budget."""
    return ep.room() >= 2


def _start(
    task: EpisodeTask,
    make_env,
    chat: ChatFormat,
    max_episode_tokens: int,
    context: ContextConfig,
    max_model_len: int,
) -> _Episode:
    """Make and reset one episode's environment and render its prompt."""
    t0 = time.perf_counter()
    try:
        env = make_env()
        obs, info = env.reset(seed=task.seed)
        if info.get("infra_error"):  # reported by an EnvWorker that could not build the environment
            raise RuntimeError(info["infra_error"])
        prompt = chat.prompt_ids([{"role": "user", "content": obs}], info.get("tools"))
        ep = _Episode(task, env, prompt)
        ep.task_text, ep.tools = obs, info.get("tools")
    except Exception as exc:  # the environment's failure, not the policy's: keep the worker up
        ep = _Episode(task, None, [])
        ep.fail(f"reset: {type(exc).__name__}: {exc}")
    ep.env_s += time.perf_counter() - t0
    ep.max_tokens = max_episode_tokens
    # full: one context, the whole episode; window/compact: each context within the engine's length
    ep.context_limit = max_episode_tokens if context.mode == "full" else max_model_len
    ep.managed = context
    if not ep.stop_reason and not _room_to_generate(ep):
        ep.stop_reason = "max_tokens"
    return ep


def _step(ep: _Episode, text: str, turn: int) -> tuple | None:
    """One env step, timed; an environment's failure becomes the episode's infra error. None for a
    compaction turn (its text is the policy's summary: no tool runs)."""
    if ep.summarising:
        return None
    t0 = time.perf_counter()
    try:
        out = ep.env.step(text)
    except Exception as exc:  # environment crash: an infrastructure error, not reward 0
        out = ("", 0.0, False, False, {})
        ep.fail(f"step {turn}: {type(exc).__name__}: {exc}")
    if out[4].get("infra_error"):  # reported by the environment itself (sandbox died, ...)
        ep.fail(str(out[4]["infra_error"]))
    ep.env_s += time.perf_counter() - t0
    return out


def _close(episodes: list[_Episode]) -> None:
    for ep in episodes:  # sandboxed environments hold a workspace and processes until closed
        if ep.env is not None and hasattr(ep.env, "close"):
            try:
                ep.env.close()
            except Exception:
                pass


def run_episodes(
    engine: Engine,
    chat: ChatFormat,
    make_env: Callable[[], object],
    env_id: str,
    tasks: list[EpisodeTask],
    *,
    max_turns: int,
    max_new_tokens: int,
    max_episode_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    run_seed: int = 0,
    context: ContextConfig = FULL,
    max_model_len: int = 0,
) -> list[Trajectory]:
    """Run the tasks' episodes to their ends; their trajectories in task order."""
    done, suspended = continue_episodes(
        engine,
        chat,
        make_env,
        env_id,
        tasks,
        max_turns=max_turns,
        max_new_tokens=max_new_tokens,
        max_episode_tokens=max_episode_tokens,
        temperature=temperature,
        top_p=top_p,
        run_seed=run_seed,
        context=context,
        max_model_len=max_model_len,
    )
    assert not suspended  # no token budget: every episode ran to its end
    return done


def continue_episodes(
    engine: Engine,
    chat: ChatFormat,
    make_env: Callable[[], object],
    env_id: str,
    tasks: list[EpisodeTask],
    *,
    max_turns: int,
    max_new_tokens: int,
    max_episode_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    run_seed: int = 0,
    suspended: list[_Episode] | None = None,
    token_budget: int = 0,
    max_segments: int = 1,
    context: ContextConfig = FULL,
    max_model_len: int = 0,
) -> tuple[list[Trajectory], list[_Episode]]:
    """Start the tasks' episodes and continue the `suspended` ones (first), together, until each has
    ended or, with a `token_budget` > 0, until this call has generated that many tokens. Returns the
    trajectories of the episodes that ended and the episodes still running (suspended: pass them to
    the next call). `max_episode_tokens`, `context` and `max_model_len` (the engine's, which bounds
    each context under window and compact) apply to the episodes started here."""
    if context.mode != "full" and max_model_len < 1:
        raise ValueError(f"context mode {context.mode!r} needs the engine's max_model_len")
    pool = ThreadPoolExecutor(max_workers=max(1, min(32, len(tasks) + len(suspended or []))))
    episodes: list[_Episode] = []
    carried = list(suspended or [])
    for ep in carried:
        ep.segments += 1
    sampling = dict(
        max_turns=max_turns,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        run_seed=run_seed,
    )
    ok = False
    try:
        started = list(
            pool.map(
                lambda task: _start(
                    task, make_env, chat, max_episode_tokens, context, max_model_len
                ),
                tasks,
            )
        )
        episodes = carried + started
        budget = _Budget(token_budget, max_segments)
        if getattr(engine, "continuous_batching", False):
            _each_on_its_own(engine, chat, episodes, budget, **sampling)
        else:
            while live := budget.live(episodes):
                budget.spend(_turn(engine, chat, live, pool, **sampling))
        ok = True
    finally:
        pool.shutdown()
        if not ok:  # an error: nothing is handed back, every environment is closed
            _close(episodes or carried)
    _close([ep for ep in episodes if ep.stop_reason])
    done = [_record(ep, env_id) for ep in episodes if ep.stop_reason]
    return done, [ep for ep in episodes if not ep.stop_reason]


class _Budget:
    """A call's token budget (partial rollouts): once spent, only the episodes in their last
    allowed call go on; the others are handed back suspended. Lockstep checks it between turns
    (`live`, `spend`). Episodes on their own threads check it before each turn but their first in
    the call, counting the turns in flight at their most (`start_turn`, `end_turn`): as in lockstep,
    no turn starts once the tokens sampled would reach the budget, whatever order the threads run in."""

    def __init__(self, tokens: int, max_segments: int):
        self.tokens, self.max_segments = tokens, max_segments
        self.generated = 0
        self.in_flight = 0  # the most the turns running now may still sample
        self._lock = threading.Lock()

    def _spent(self) -> bool:
        return bool(self.tokens) and self.generated + self.in_flight >= self.tokens

    def _goes_on(self, ep: _Episode, spent: bool) -> bool:
        # its last call: to the end
        return not ep.stop_reason and (not spent or ep.segments >= self.max_segments)

    def live(self, episodes: list[_Episode]) -> list[_Episode]:
        with self._lock:
            spent = self._spent()
        return [ep for ep in episodes if self._goes_on(ep, spent)]

    def spend(self, n: int) -> None:
        with self._lock:
            self.generated += n

    def start_turn(self, ep: _Episode, first: bool, at_most: int) -> bool:
        with self._lock:
            if not self._goes_on(ep, not first and self._spent()):
                return False
            self.in_flight += at_most
            return True

    def end_turn(self, at_most: int, n: int) -> None:
        with self._lock:
            self.in_flight -= at_most
            self.generated += n


def _turn(
    engine,
    chat: ChatFormat,
    live: list[_Episode],
    pool,
    *,
    max_turns,
    max_new_tokens,
    temperature,
    top_p,
    run_seed,
) -> int:
    """Lockstep: one batched generation over the live episodes, then all their env steps at once;
    returns the number of tokens generated. Each episode is at its own turn (partial rollouts mix them)."""
    t0 = time.perf_counter()
    gens = _generate(engine, chat, live, max_new_tokens, temperature, top_p, run_seed)
    dt = (time.perf_counter() - t0) / max(1, len(live))
    texts = [_sampled(ep, gen, chat, dt) for ep, gen in zip(live, gens)]
    steps = list(
        pool.map(lambda pair: _step(pair[0], pair[1], len(pair[0].turns)), zip(live, texts))
    )
    for ep, gen, text, step in zip(live, gens, texts, steps):
        _stepped(ep, engine, chat, gen, text, step, max_turns, max_new_tokens, run_seed)
    return sum(len(g.token_ids) for g in gens)


def _each_on_its_own(
    engine,
    chat: ChatFormat,
    episodes: list[_Episode],
    budget: _Budget,
    *,
    max_turns,
    max_new_tokens,
    temperature,
    top_p,
    run_seed,
) -> None:
    """Per-episode asynchrony: each episode runs its turns on its own thread (generate, then its env
    step, until it ends or the budget suspends it); the engine batches whichever are generating."""
    failed = threading.Event()  # one episode's engine error stops the others at their next turn

    def run(ep: _Episode) -> None:
        first = True
        try:
            while not failed.is_set() and budget.start_turn(
                ep, first, at_most := _turn_limit(ep, max_new_tokens)
            ):
                first = False
                t0 = time.perf_counter()
                gen = _generate(engine, chat, [ep], max_new_tokens, temperature, top_p, run_seed)[0]
                # (an error ends the call: nothing to give back)
                budget.end_turn(at_most, len(gen.token_ids))
                text = _sampled(ep, gen, chat, time.perf_counter() - t0)
                _stepped(
                    ep,
                    engine,
                    chat,
                    gen,
                    text,
                    _step(ep, text, len(ep.turns)),
                    max_turns,
                    max_new_tokens,
                    run_seed,
                )
        except BaseException:
            failed.set()
            raise

    live = [ep for ep in episodes if not ep.stop_reason]
    with ThreadPoolExecutor(max_workers=max(1, len(live)), thread_name_prefix="episode") as threads:
        futures = [threads.submit(run, ep) for ep in live]
        wait(futures, return_when=FIRST_EXCEPTION)
    for f in futures:
        f.result()  # the first error, raised in the caller's thread


def _turn_limit(ep: _Episode, max_new_tokens: int) -> int:
    # Each episode may generate at most what its context and token budget still allow, keeping one
    # token for the end-of-turn token appended when a turn is cut by the limit.
    return min(ep.managed.summary_tokens if ep.summarising else max_new_tokens, ep.room() - 1)


def _generate(
    engine, chat: ChatFormat, live: list[_Episode], max_new_tokens, temperature, top_p, run_seed
):
    return engine.generate(
        [ep.context for ep in live],
        max_tokens=[_turn_limit(ep, max_new_tokens) for ep in live],
        temperature=temperature,
        top_p=top_p,
        stop_token_ids=[chat.eot_id],
        seeds=[turn_seed(run_seed, ep.task.episode_id, len(ep.turns)) for ep in live],
    )


def _sampled(ep: _Episode, gen, chat: ChatFormat, gen_s: float) -> str:
    """Append a sampled turn to the episode's context; its text."""
    ep.gen_s += gen_s
    if gen.prompt_routed_experts is not None:  # the context's routing, where not recorded yet
        for pos, r in enumerate(gen.prompt_routed_experts, start=ep.context_start):
            if r and not ep.routed[pos]:
                ep.routed[pos] = r
                ep.any_routed = True
    ep.turn_start = len(ep.ids)
    ep.ids += gen.token_ids
    ep.mask += [1] * len(gen.token_ids)
    ep.logprobs += gen.logprobs
    ep.routed += (
        gen.routed_experts if gen.routed_experts is not None else [[] for _ in gen.token_ids]
    )
    ep.any_routed |= gen.routed_experts is not None
    if not gen.token_ids or gen.token_ids[-1] != chat.eot_id:
        # Cut by the token limit: close the turn so the next observation is well formed.
        # The closing token is not the policy's, so it is masked out.
        ep.ids.append(chat.eot_id)
        ep.mask.append(0)
        ep.logprobs.append(0.0)
        ep.routed.append([])
    return chat.decode(gen.token_ids)


def _stepped(
    ep: _Episode,
    engine,
    chat: ChatFormat,
    gen,
    text: str,
    step: tuple | None,
    max_turns: int,
    max_new_tokens: int,
    run_seed: int,
) -> None:
    """Record a turn from its env step: reward, milestones, the observation appended (the context
    rebuilt or a summary asked for, when it passes the threshold) or the end. A compaction turn
    (`step` None) rebuilds the context from its summary."""
    gen_start, gen_end = ep.turn_start, len(ep.ids)
    turn = len(ep.turns)
    record = dict(
        gen_start=gen_start,
        gen_end=gen_end,
        text=text,
        policy_version=engine.version if gen.version is None else gen.version,
        seed=turn_seed(run_seed, ep.task.episode_id, turn),
        finish_reason=gen.finish_reason,
    )
    if step is None:  # a compaction turn: the summary is written, the episode goes on from it
        ep.summarising = False
        ep.turns.append(
            Turn(
                obs_end=gen_end,
                observation="",
                tool_calls=0,
                tool_errors=0,
                kind="summary",
                **record,
            )
        )
        _rebuild(ep, chat, text)
        return
    obs, reward, terminated, truncated, info = step
    ep.reward += float(reward)
    for m in info.get("milestones", []):
        ep.milestones.append({**m, "turn": turn, "token": gen_end - 1})
    n_errors = int(info.get("tool_errors", 0))
    n_calls = sum(1 for m in info.get("messages", []) if m.get("role") == "tool")
    acted = sum(t.kind == "action" for t in ep.turns) + 1
    rebuild = False
    if ep.stop_reason == "infra_error":
        pass
    elif terminated or truncated:
        ep.stop_reason = "terminated" if terminated else "truncated"
    elif acted >= max_turns:
        ep.stop_reason = "max_turns"
    else:
        obs_ids = chat.observation_ids(info["messages"])
        m = ep.managed
        if m.mode != "full":
            # what a rebuilt context copies of it
            ep.own_ids[turn] = ep.ids[gen_start:gen_end] + obs_ids
        past = len(ep.context) + len(obs_ids) > m.threshold(ep.context_limit)
        # ask for the summary with this observation, while there is room for it
        if m.mode == "compact":
            asking = chat.observation_ids(
                info["messages"] + [{"role": "user", "content": COMPACT_INSTRUCTION}]
            )
            if past or len(ep.context) + len(asking) + m.summary_tokens + 1 > ep.context_limit:
                obs_ids, ep.summarising = asking, True
        elif m.mode == "window":  # the observation goes to the new context only
            rebuild = past or len(ep.context) + len(obs_ids) + max_new_tokens + 1 > ep.context_limit
        if rebuild:
            pass
        elif (
            len(ep.context) + len(obs_ids) + 2 > ep.context_limit
            or len(ep.ids) + len(obs_ids) + 2 > ep.max_tokens
        ):
            ep.stop_reason = "max_tokens"
        else:
            ep.append(obs_ids)
    ep.turns.append(
        Turn(
            obs_end=len(ep.ids),
            observation=obs,
            tool_calls=n_calls,
            tool_errors=n_errors,
            sandbox_events=list(info.get("sandbox_events", [])),
            failures=list(info.get("failures", [])),
            **record,
        )
    )
    if rebuild:
        _rebuild(ep, chat, None)


def _rebuild(ep: _Episode, chat: ChatFormat, summary: str | None) -> None:
    """Continue the episode from a new context segment: the task, a note (the policy's `summary`, or
    the window's stub when None) and its last `keep_turns` acting turns, token for token; fewer of
    them when they would take more than half the room between the task's prompt and the threshold.
    Ends the episode (`max_tokens`) when even the task and the note do not leave room for a turn,
    or the episode's budget has no room for them."""
    acting = [i for i, t in enumerate(ep.turns) if t.kind == "action"]
    keep = acting[len(acting) - ep.managed.keep_turns :] if ep.managed.keep_turns else []
    # at most half the room between the task's prompt and the threshold: the new context must not
    # pass the threshold again within a turn or two
    first_prompt = ep.turns[0].gen_start
    limit = first_prompt + (ep.managed.threshold(ep.context_limit) - first_prompt) // 2
    while True:
        shown = len(acting) - len(keep)  # acting turns 1..shown are no longer shown
        note = (
            summary_note(summary, 1, shown)
            if summary is not None
            else window_note(1, shown, len(keep))
        )
        ids = chat.prompt_ids(
            [{"role": "user", "content": ep.task_text}, {"role": "user", "content": note}], ep.tools
        )
        for i in keep:
            ids += ep.own_ids[i]
        if len(ids) <= limit or not keep:
            break
        keep = keep[1:]
    if len(ids) + 2 > ep.context_limit or len(ep.ids) + len(ids) + 2 > ep.max_tokens:
        ep.stop_reason = "max_tokens"
        return
    ep.sample_starts = ep.sample_starts or [0]
    ep.sample_starts.append(len(ep.ids))
    ep.context_start = len(ep.ids)
    ep.append(ids)


def succeeded_in(env_id: str, milestones: list[dict], reward: float) -> bool:
    """The environment's own success test; reaching `solved` for an id that is not registered
    (an environment made by a factory the caller passed)."""
    try:
        return envs.succeeded(env_id, milestones, reward)
    except KeyError:
        from rewards.milestones import solved

        return solved(milestones)


def _record(ep: _Episode, env_id: str) -> Trajectory:
    stop_reason = ep.stop_reason or "max_turns"
    succeeded = not ep.infra_error and succeeded_in(env_id, ep.milestones, ep.reward)
    return Trajectory(
        episode_id=ep.task.episode_id,
        iteration=ep.task.iteration,
        group_id=ep.task.group_id,
        env_id=env_id,
        seed=ep.task.seed,
        task=ep.task_text,
        prompt_len=ep.turns[0].gen_start if ep.turns else len(ep.ids),
        token_ids=ep.ids,
        loss_mask=ep.mask,
        rollout_logprobs=ep.logprobs,
        turns=ep.turns,
        milestones=ep.milestones,
        reward=ep.reward,
        stop_reason=stop_reason,
        infra_error=ep.infra_error,
        timings={"generate_s": ep.gen_s, "env_s": ep.env_s},
        routed_experts=ep.routed if ep.any_routed else None,
        failure=failure_kind(stop_reason, ep.turns, succeeded, ep.infra_error),
        sample_starts=ep.sample_starts,
        context=ep.managed.mode,
    )


def play(
    engine, chat, env_id: str, env_kwargs: dict | None, tasks: list[EpisodeTask], **loop
) -> list[Trajectory]:
    """Evaluation episodes to their ends, in environments made here (`loop`: the agent loop's limits
    and sampling); nothing is suspended or kept. Held-out evaluation
    (rl/loop/evaluate.py) runs this way, on the rollout workers."""
    kwargs = dict(env_kwargs or {})
    return run_episodes(engine, chat, lambda: envs.make(env_id, **kwargs), env_id, tasks, **loop)

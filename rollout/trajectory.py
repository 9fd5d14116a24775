"""The one record that travels end to end: rollout worker → store → learner → inspect (and the
task a rollout worker is handed to produce it).

Token ids are exactly what the engine sampled plus the tokenised observations; the learner never
re-tokenises decoded text (a byte-level BPE re-encoding of sampled text usually differs from the
sampled ids, and training on it would train on tokens the policy never produced).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class EpisodeTask:
    """What a rollout worker is asked to run."""

    episode_id: str
    group_id: int
    seed: int
    iteration: int


@dataclass
class Turn:
    """One model turn and the observation that followed it, as spans of `Trajectory.token_ids`."""

    gen_start: int
    """Index of the first generated token."""
    gen_end: int
    """One past the last generated token."""
    obs_end: int
    """One past the last observation token (== gen_end when the episode ended on this turn)."""
    text: str
    """The generated text, decoded from the generated ids (for people and the tool parser)."""
    observation: str
    """The environment's observation text after this turn."""
    tool_calls: int
    """Tool calls parsed from the turn."""
    tool_errors: int
    """Malformed or failed tool calls in the turn."""
    policy_version: int
    """Version of the weights that generated this turn."""
    seed: int
    """Sampling seed of this turn (with the same weights and prompt, vLLM reproduces the turn)."""
    finish_reason: str
    """`stop` (end-of-turn token) or `length` (hit `max_new_tokens`)."""
    sandbox_events: list[str] = field(default_factory=list)
    """Limits hit by the turn's sandboxed tool calls (e.g. `bwrap: memory limit reached`)."""
    failures: list[str] = field(default_factory=list)
    """What went wrong in the turn, one entry per problem (`TURN_FAILURES`; empty: nothing)."""
    kind: str = "action"
    """`action` (a turn the environment steps), or `summary`: a compaction turn, the policy's summary
    of its progress, which ends its context segment (rollout/context.py; no tool runs, no observation)."""


STOP_REASONS = {
    "terminated": "the environment ended the episode (solved, or a final answer given)",
    "truncated": "the environment's own turn limit",
    "max_turns": "the agent loop's rollout.max_turns",
    "max_tokens": "no room left in rollout.max_episode_tokens",
    "infra_error": "the environment or its worker failed (kept out of the group statistics)",
}
"""Why an episode ended: the values of `Trajectory.stop_reason`."""


TURN_FAILURES = {
    "no_tool_call": "the turn called no tool (plain text)",
    "malformed_call": "a <tool_call> block that is not a JSON object with a name and arguments",
    "unknown_tool": "a call to a tool the environment does not have",
    "tool_error": "the tool refused its arguments or failed on them",
    "sandbox_limit": "a sandboxed call hit a limit (time, memory, processes, output, ...)",
}
"""Per-turn failure kinds, as environments report them in `info["failures"]` (envs/base.py)."""

FAILURE_KINDS = {
    "success": "the environment's success test passed",
    "infra_error": "the environment or its worker failed: not the policy's doing, not trained on",
    "wrong_answer": "the episode ended itself (e.g. submitted) without success",
    **TURN_FAILURES,
    "out_of_turns": "ran out of turns, most of them without a failure",
    "out_of_tokens": "ran out of episode tokens, most turns without a failure",
}
"""Why an episode ended as it did, one kind per episode (`failure_kind`)."""


def failure_kind(
    stop_reason: str, turns: list[Turn], succeeded: bool, infra_error: str = ""
) -> str:
    """One kind per episode (`FAILURE_KINDS`). An episode that ran out of turns or tokens is put
    down to the failure of most of its turns when at least half of them failed (ties: the later
    failure), else to the limit itself."""
    if infra_error or stop_reason == "infra_error":
        return "infra_error"
    if succeeded:
        return "success"
    if stop_reason == "terminated":
        return "wrong_answer"
    turns = [t for t in turns if t.kind == "action"]  # a summary has no failures: it does not vote
    failed = [t for t in turns if t.failures]
    if turns and 2 * len(failed) >= len(turns):
        counts: dict[str, int] = {}
        for t in failed:
            for kind in dict.fromkeys(t.failures):  # one vote per turn and kind
                counts[kind] = counts.get(kind, 0) + 1
        last = {kind: i for i, t in enumerate(turns) for kind in t.failures}
        return max(counts, key=lambda k: (counts[k], last[k]))
    return "out_of_tokens" if stop_reason == "max_tokens" else "out_of_turns"


def first_difference(a: list, b: list) -> int | None:
    """Where two token sequences first differ (the shorter one's length when one extends the
    other), or None when they are equal."""
    at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    return at if at is not None or len(a) == len(b) else min(len(a), len(b))


@dataclass
class Trajectory:
    episode_id: str
    """Unique across the run: `i{iteration}-g{group}-e{index}`."""
    iteration: int
    """Trainer iteration that collected the episode."""
    group_id: int
    """Episodes with the same group id share a task; GRPO normalises rewards within it."""
    env_id: str
    """Registered environment id."""
    seed: int
    """Environment reset seed (the task)."""
    prompt_len: int
    """Tokens of the initial prompt (system + tools + task)."""
    token_ids: list[int]
    """The whole episode: prompt, generated turns, observations."""
    loss_mask: list[int]
    """1 where the policy generated the token, else 0."""
    rollout_logprobs: list[float]
    """The engine's log-prob of each generated token (0.0 elsewhere)."""
    turns: list[Turn] = field(default_factory=list)
    """Turn boundaries, texts and versions."""
    milestones: list[dict] = field(default_factory=list)
    """Milestone events: name, reward, turn index, token index (end of the turn that reached it)."""
    reward: float = 0.0
    """Total episode reward (sum of milestone rewards)."""
    stop_reason: str = ""
    """`terminated`, `truncated` (env), `max_turns` or `max_tokens` (agent loop), or `infra_error`."""
    infra_error: str = ""
    """Why the environment failed (crash, sandbox death), when it did; such episodes never count as reward 0."""
    timings: dict = field(default_factory=dict)
    """Seconds spent generating and in the environment."""
    task: str = ""
    """The environment's first observation (the task as the model saw it, before templating)."""
    routed_experts: list[list[list[int]]] | None = None
    """Per token, per MoE layer, the expert ids the engine routed it to ([] where not recorded); None
    when the engine records none. For rollout routing replay in the learner."""
    failure: str = ""
    """Why the episode ended as it did (`FAILURE_KINDS`: `success`, `no_tool_call`, `wrong_answer`, ...)."""
    reward_parts: dict = field(default_factory=dict)
    """Each part's own value when the run's reward is a rubric (the `reward:` section, rewards/rubric.py):
    `reward` is then their weighted sum. Empty: the reward is the milestones the environment paid."""
    sample_starts: list[int] = field(default_factory=list)
    """Where each of the episode's training samples starts in `token_ids`, when it has more than one
    (empty: the episode is one token sequence). The agent loop under `window` or `compact` context
    management stores each context segment this way (rollout/context.py), and an agent program whose
    history was rewritten between calls (rollout/program_episodes.py) its calls' sequences, each its
    call's prompt and completion; the learner trains each as a sequence of its own, with the
    episode's advantage."""
    context: str = ""
    """The agent loop's context management (`full`, `window`, `compact`; rollout/context.py); empty
    for an agent program's episode and for records older than it (both: `full`)."""
    stored_schema: int = field(default=0, compare=False)
    """Transient: the store schema version the record was read from (0: made in this process), so
    replay can reproduce what environments did when it was written (rl/store.py SCHEMA_VERSION)."""
    judging: object = None
    """Transient, never stored: the judge's pending scores for the episode's judge parts, from the
    rollout worker until the trainer applies the rubric (rollout/judge_actor.py `ask`, `ask_groups`, `settle`)."""

    @property
    def num_generated(self) -> int:
        return sum(self.loss_mask)

    def sample_spans(self) -> list[tuple[int, int]]:
        """(start, end) of each training sample in `token_ids`: the whole episode, or each of its
        `sample_starts`' sequences."""
        starts = self.sample_starts or [0]
        return list(zip(starts, [*starts[1:], len(self.token_ids)]))

    def sample_openers(self) -> dict[int, int]:
        """Turn index → sample index, for each turn that opens a sample after the first (the first
        turn of a rebuilt context, or a call whose prompt was rendered anew)."""
        out = {}
        for k, (s, e) in enumerate(self.sample_spans()[1:], start=1):
            first = next((i for i, t in enumerate(self.turns) if s <= t.gen_start < e), None)
            if first is not None:
                out[first] = k
        return out

    def in_prompt(self, p: int) -> bool:
        """Whether token `p` belongs to a prompt: the tokens of its sample before the sample's first
        generated one (the episode's first prompt, or a later sample's own)."""
        start, end = next(
            ((s, e) for s, e in self.sample_spans() if s <= p < e), (0, len(self.token_ids))
        )
        if start == 0:
            return p < self.prompt_len
        return p < min((t.gen_start for t in self.turns if start <= t.gen_start < end), default=end)

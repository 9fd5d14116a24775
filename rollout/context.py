"""Context management: what the policy sees when an episode outgrows its context window.

Three modes (`rollout.context.mode`):

- `full`: the context only grows: the task, then every turn and observation. An episode whose
  next observation would not fit ends (stop reason `max_tokens`). The loop as it always was.
- `window`: once the context passes `at_tokens` (or would leave no room for a turn), the episode
  continues from a new context: the task, a one-line stub saying which turns are no longer shown,
  and the last `keep_turns` turns.
- `compact`: once the context passes `at_tokens` (or would leave no room for a summary), the loop
  asks the *policy* for a summary of its progress: the observation that crossed the threshold ends with a fixed instruction
  (`COMPACT_INSTRUCTION`), and the policy's next turn is a compaction turn (`Turn.kind ==
  "summary"`; no tool runs). The episode then continues from the task, that summary and the last
  `keep_turns` turns.

Either way a rebuilt context starts a new segment of the episode: the stored `token_ids` are the
segments one after another, each exactly the tokens the engine saw, and `Trajectory.sample_starts`
says where each begins. The learner trains every segment as a sample of its own with the episode's
advantage, so the tokens of a summary are trained like any other action: a summary that kept what
the rest of the episode needed is credited with what followed it. Kept turns are copied into the
new segment token for token (their generated ids and their observation, without the compaction
instruction), as part of its prompt: they are trained once, in the segment that sampled them.

What the rebuilt context looks like, rendered by the checkpoint's chat template:

    system (tools)   user: the task   user: NOTE (the summary, or the window's stub)
    assistant: kept turn 1   tool: its result   ...   assistant: <the next turn is sampled here>

Not covered: a rebuild in the middle of a turn (a single observation longer than the window ends
the episode), and summaries of summaries beyond what the policy writes itself (each compaction
sees the previous summary in its context and is asked for the whole progress).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from typed_yaml import bounded

COMPACT_INSTRUCTION = (
    "Your context is nearly full. Write a summary of your progress for yourself: what the task asks, "
    "everything you found that you will still need, and what to do next. Do not call a tool. Only the "
    "task, this summary and your last turns will remain."
)
"""The user message that asks the policy for a summary (appended after the tool results)."""


def summary_note(summary: str, first: int, last: int) -> str:
    """The message a compacted context shows in place of turns `first`..`last` (1-based)."""
    return f"Summary of your progress (you wrote it; turns {first}-{last} are no longer shown):\n{summary.strip()}"


def window_note(first: int, last: int, kept: int) -> str:
    """The window's one-line stub for turns `first`..`last` (1-based)."""
    return f"(Turns {first}-{last} are no longer shown: the context keeps the task and the last {kept} turns.)"


@dataclass
class ContextConfig:
    mode: Literal["full", "window", "compact"] = "full"
    """full: the context only grows, and an episode ends when the next observation does not fit; window: past `at_tokens` the episode continues from the task, a one-line stub and the last `keep_turns` turns; compact: past `at_tokens` the policy writes a summary of its progress (a compaction turn, trained like any other) and the episode continues from the task, that summary and the last `keep_turns` turns (rollout/context.py)."""
    at_tokens: int = bounded(0, ge=0, note="0: 3/4 of rollout.max_model_len")
    """window, compact: the context length (tokens) past which the context is rebuilt; 0: three quarters of `rollout.max_model_len`. compact needs room above it for the instruction and `summary_tokens`."""
    keep_turns: int = bounded(2, ge=0)
    """window, compact: the last turns kept verbatim (their exact tokens) in a rebuilt context (0: none); fewer when they would take more than half the room between the task's prompt and the threshold."""
    summary_tokens: int = bounded(192, ge=8)
    """compact: the most tokens a summary turn may generate."""

    def threshold(self, max_model_len: int) -> int:
        """`at_tokens`, its default resolved."""
        return self.at_tokens or max_model_len * 3 // 4

    def problems(self, max_model_len: int, max_new_tokens: int) -> list[tuple[str, bool, str]]:
        """What ties the threshold to the engine's context (key, ok, why), for the run config's
        `validate`; each field's own range is declared with it."""
        at = self.threshold(max_model_len)
        managed = self.mode != "full"
        return [
            (
                "rollout.context.at_tokens",
                not managed or at + max_new_tokens < max_model_len,
                f"({at}) plus rollout.max_new_tokens ({max_new_tokens}) must stay below rollout.max_model_len "
                f"({max_model_len}): a turn must fit after the threshold",
            ),
            (
                "rollout.context.at_tokens",
                self.mode != "compact" or at + self.summary_tokens + 96 <= max_model_len,
                f"({at}) plus rollout.context.summary_tokens ({self.summary_tokens}) and ~96 tokens for the "
                f"instruction must fit rollout.max_model_len ({max_model_len})",
            ),
        ]


__all__ = ["ContextConfig", "COMPACT_INSTRUCTION", "summary_note", "window_note"]

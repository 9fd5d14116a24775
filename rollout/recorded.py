"""Engines that answer without a model, for the endpoint (rollout/openai_api.py) when no policy
should run: replaying an agent program's episode, and checking an agent program (`FixedEngine`).

Replay: the agent runs again against an endpoint whose engine answers each call with the completion
recorded for it, so a deterministic agent makes the same calls and earns the same reward — or the
first call that departs from the record is named.

`recorded_calls(t)` reads the calls back from a stored `Trajectory` (each turn is one call: its
prompt is its sample's tokens before the turn, its completion the turn's generated ids);
`RecordedEngine` is an engine (rollout/engines/base.py) that serves them. A call whose prompt is
not the prompt of a recorded call that has not been answered yet is refused with a 400 (an OpenAI
client does not retry it) that says which call and token it departs at, and the engine keeps that
as `departure`.

Not covered: an agent whose own behaviour is random (it draws without a seed, reads the clock or
the network) replays only as far as it repeats itself; what it departs with is reported, never
papered over.
"""

from __future__ import annotations

import threading

from rollout.engines.base import Generation
from rollout.openai_api import RequestError
from rollout.trajectory import Trajectory, first_difference


def recorded_calls(t: Trajectory) -> list[tuple[list[int], Generation]]:
    """(prompt ids, the completion as the engine gave it) of each of the episode's calls, in order."""
    out = []
    for turn in t.turns:
        start = max((s for s, _ in t.sample_spans() if s <= turn.gen_start), default=0)
        gen = Generation(
            list(t.token_ids[turn.gen_start : turn.gen_end]),
            list(t.rollout_logprobs[turn.gen_start : turn.gen_end]),
            turn.finish_reason,
        )
        out.append((list(t.token_ids[start : turn.gen_start]), gen))
    return out


class RecordedEngine:
    """Answers each prompt with the first not yet answered recorded call that has exactly that prompt."""

    def __init__(self, calls: list[tuple[list[int], Generation]], detok=None):
        self.calls, self.detok = calls, detok
        self.used = [False] * len(calls)
        self.version = 0
        self.departure = ""
        self._lock = threading.Lock()

    def generate(
        self, prompts, *, max_tokens, temperature, top_p, stop_token_ids, seeds, stop=None, **_
    ):
        out = []
        with self._lock:
            for prompt in prompts:
                k = next(
                    (
                        k
                        for k, (p, _) in enumerate(self.calls)
                        if not self.used[k] and p == list(prompt)
                    ),
                    None,
                )
                if k is None:
                    self.departure = self.departure or self._why(list(prompt))
                    raise RequestError(f"replay: {self.departure}", "messages")
                self.used[k] = True
                out.append(self.calls[k][1])
        return out

    def _why(self, prompt: list[int]) -> str:
        nxt = next((k for k, u in enumerate(self.used) if not u), None)
        if nxt is None:
            return f"call {len(self.calls)} was never made in the recorded episode ({len(self.calls)} calls)"
        want = self.calls[nxt][0]
        at = first_difference(want, prompt)  # not None: an equal prompt would have been answered
        show = (
            (lambda ids: repr(self.detok(ids)[:80])) if self.detok else (lambda ids: str(ids[:8]))
        )
        return (
            f"call {nxt}'s prompt departs from the record at token {at} of {len(want)}: "
            f"recorded {show(want[at:])}, replayed {show(prompt[at:])}"
        )

    @property
    def answered(self) -> int:
        return sum(self.used)


class FixedEngine:
    """Answers every prompt with the same completion (`ids`, log-prob 0 each): what `envs check`
    runs an agent program against, so the check needs no model."""

    def __init__(self, ids: list[int]):
        self.ids, self.version, self.calls = list(ids), 0, 0

    def generate(
        self, prompts, *, max_tokens, temperature, top_p, stop_token_ids, seeds, stop=None, **_
    ):
        self.calls += len(prompts)
        out = []
        for m in max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts):
            ids = self.ids[:m]
            out.append(
                Generation(ids, [0.0] * len(ids), "stop" if len(ids) == len(self.ids) else "length")
            )
        return out

"""LLM-as-judge reward parts: what a judge model is asked about an episode, how its answer becomes a
score, and the cache that makes a judged score reproducible.

A `Judge` is a rubric part (rewards/rubric.py, `fn: judge`) that cannot score on its own: it turns
a recorded episode into a `JudgeRequest`, a prompt and the continuations to score, which a judge
model served by vLLM answers in its own Ray actor (rollout/judge_actor.py). Both ways of judging read
only the judge's log-probabilities of fixed continuations, so a score is a deterministic function
of (judge model, prompt): no sampling, nothing to parse.

- `verdict` (the default; for judges that follow instructions): the judge is shown the task, the
  agent's answer, the environment's reference answer if it has one, and the criteria, and asked
  whether the answer meets them. Score = P(Yes) / (P(Yes) + P(No)) of its next token.
- `rank` (group-relative, as ART's RULER): the judge is shown the task and all the answers of a
  GRPO group, labelled A, B, C, ..., and asked which meets the criteria best. Each episode's score
  is the judge's probability of its letter (normalised over the group's letters), averaged over
  `rotations` cyclic orders of the answers (all of them by default), which cancels the judge's
  preference for a position: the packaged SmolLM2 puts 0.53-0.60 on "A" whatever answer it
  labels, and averaged over the four rotations of four answers it scores them 0.23-0.27.
- `likelihood` (GPTScore-style, for small judges): the judge reads the task and the agent's answer,
  then the criteria as a question, and the score is how likely it finds the environment's reference
  answer as the reply: exp(mean log p(reference tokens | prompt)), the geometric mean of the
  per-token probabilities, in (0, 1]. An answer that carries the reference's facts makes them
  predictable. Measured with the packaged SmolLM2-135M on incident reports: a good report 0.33-0.35,
  a vague or wrong one 0.02-0.03; asked for a verdict, the same model gave every report 0.4-0.5.

The judge sees the episode's `task` and its answer: the last turn's text (`show: final`) or every
turn with the observations that followed (`show: transcript`), cut to `max_chars` from the end.

`JudgeCache` keeps every score by the hash of (judge model, mode, prompt, continuations): a JSON
line per score, appended by the one judge actor of a run, read back by `replay --rescore`, which
so reproduces the stored judge scores without a judge engine.

Not covered here: judges that sample a written critique before their verdict.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

MODES = ("verdict", "likelihood", "rank")
LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
SHOW = ("final", "transcript")

VERDICT_SYSTEM = "You are a strict grader. You check an agent's answer against criteria and answer only Yes or No."
RANK_SYSTEM = (
    "You are a strict grader. You compare agents' answers to the same task and name the best one."
)


@dataclass(frozen=True)
class JudgeRequest:
    """What the judge model scores for one episode and one judge part."""

    mode: str
    """`verdict` or `likelihood`."""
    messages: tuple = ()
    """verdict: the chat (system, user) the judge answers Yes or No to."""
    prompt: str = ""
    """likelihood: the plain-text prompt before the reference."""
    target: str = ""
    """likelihood: the reference answer whose likelihood is the score."""
    chats: tuple = ()
    """rank: one chat per rotation of the group's answers; the answer of member i is labelled
    `LETTERS[(i - r) % size]` in rotation r."""
    size: int = 1
    """How many scores the request gives: 1, or (rank) the group's size."""

    def key(self, model: str) -> str:
        """The cache key: the same judge, asked the same thing, gives the same score."""
        blob = json.dumps(
            [model, self.mode, list(self.messages), self.prompt, self.target, list(self.chats)],
            sort_keys=True,
        )
        return hashlib.sha256(blob.encode()).hexdigest()


@dataclass(frozen=True)
class Judge:
    """A judged rubric part: `{fn: judge, kwargs: {criteria, mode, show, max_chars}}`."""

    criteria: str
    """verdict: what a good answer does, asked as a yes/no question; likelihood: the question whose
    reply should be the environment's reference answer."""
    mode: str = "verdict"
    """`verdict` (P(Yes) of the judge's answer), `likelihood` (the reference answer's likelihood) or `rank` (the group's answers compared)."""
    show: str = "final"
    """What of the episode the judge reads: `final` (the last turn's text) or `transcript`."""
    max_chars: int = 4000
    """At most this many characters of the episode (the end is kept)."""
    rotations: int = 0
    """rank: how many cyclic orders of the answers the judge sees (0: as many as answers; 1: one)."""

    def __post_init__(self):
        if not isinstance(self.criteria, str) or not self.criteria.strip():
            raise ValueError("judge: criteria must be a non-empty string")
        if self.mode not in MODES:
            raise ValueError(f"judge: mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.show not in SHOW:
            raise ValueError(f"judge: show must be one of {', '.join(SHOW)}, got {self.show!r}")
        if (
            isinstance(self.max_chars, bool)
            or not isinstance(self.max_chars, int)
            or self.max_chars < 100
        ):
            raise ValueError(f"judge: max_chars must be an integer >= 100, got {self.max_chars!r}")
        if (
            isinstance(self.rotations, bool)
            or not isinstance(self.rotations, int)
            or self.rotations < 0
        ):
            raise ValueError(f"judge: rotations must be an integer >= 0, got {self.rotations!r}")

    def __call__(self, trajectory) -> float:
        raise RuntimeError(
            "a judge part is scored by the judge model (rollout/judge_actor.py), not called"
        )

    def answer(self, trajectory) -> str:
        """The part of the episode the judge reads."""
        turns = trajectory.turns
        if not turns:
            return ""
        if self.show == "final":
            text = turns[-1].text
        else:
            text = "\n\n".join(
                f"[turn {i}] agent:\n{t.text}"
                + (f"\n[turn {i}] tools:\n{t.observation}" if t.observation else "")
                for i, t in enumerate(turns)
            )
        return text if len(text) <= self.max_chars else "…" + text[-self.max_chars :]

    def request(self, trajectory, reference: str = "") -> JudgeRequest:
        """What to ask the judge about this episode; `reference`: the environment's reference
        answer for its task (`ToolEnv.judge_reference`), required by `likelihood`."""
        answer = self.answer(trajectory)
        if self.mode == "likelihood":
            if not reference:
                raise ValueError(
                    f"judge (likelihood) needs the environment's reference answer; {trajectory.env_id} "
                    "gives none (ToolEnv.judge_reference)"
                )
            prompt = (
                f"Task: {trajectory.task}\n\nThe agent's answer:\n{answer}\n\n"
                f"{self.criteria.strip()}\nAnswer according to the agent:"
            )
            return JudgeRequest("likelihood", prompt=prompt, target=" " + reference.strip())
        ref = f"A reference answer:\n{reference.strip()}\n\n" if reference else ""
        user = (
            f"Task given to the agent:\n{trajectory.task}\n\nThe agent's answer:\n{answer}\n\n{ref}"
            f"Criteria: {self.criteria.strip()}\nDoes the agent's answer meet the criteria? Answer Yes or No."
        )
        return JudgeRequest("verdict", messages=(("system", VERDICT_SYSTEM), ("user", user)))

    def group_request(self, group: list) -> JudgeRequest:
        """rank: what to ask the judge about a group's episodes (one task, in this order)."""
        n = len(group)
        if not 1 <= n <= len(LETTERS):
            raise ValueError(
                f"judge (rank) compares 1 to {len(LETTERS)} answers, got a group of {n}"
            )
        answers = [self.answer(t) for t in group]
        chats = []
        for r in range(min(n, self.rotations or n)):
            order = [(k + r) % n for k in range(n)]  # the member labelled LETTERS[k]
            listing = "\n\n".join(
                f"Answer {LETTERS[k]}:\n{answers[i]}" for k, i in enumerate(order)
            )
            user = (
                f"Task given to the agents:\n{group[0].task}\n\n{listing}\n\nCriteria: {self.criteria.strip()}\n"
                f"Which answer meets the criteria best? Answer with its letter only."
            )
            chats.append((("system", RANK_SYSTEM), ("user", user)))
        return JudgeRequest("rank", chats=tuple(chats), size=n)


def verdict_score(logp_yes: float, logp_no: float) -> float:
    """P(Yes) / (P(Yes) + P(No)) from the two log-probs (stable for any magnitudes)."""
    return 1.0 / (1.0 + math.exp(max(-700.0, min(700.0, logp_no - logp_yes))))


def rank_scores(logps_RK: list[list[float]]) -> list[float]:
    """Per member, its letter's probability (normalised over the group's letters) averaged over the
    rotations; `logps_RK[r][k]`: log-prob of letter k in rotation r, whose letter k is member (k + r) % n."""
    n = len(logps_RK[0])
    out = [0.0] * n
    for r, row in enumerate(logps_RK):
        top = max(row)
        probs = [math.exp(x - top) for x in row]
        total = sum(probs)
        for k, p in enumerate(probs):
            out[(k + r) % n] += p / total / len(logps_RK)
    return out


def likelihood_score(logps: list[float]) -> float:
    """exp(mean log-prob): the geometric mean of the reference tokens' probabilities."""
    if not logps:
        raise ValueError("likelihood score of an empty reference")
    return math.exp(sum(logps) / len(logps))


class JudgeCache:
    """Scores by request key, kept in a JSON-lines file (one writer: the run's judge actor).

    A line cut short by a crash is skipped on load (it is the last one, and its score is computed
    again); nothing already written is rewritten."""

    def __init__(self, path: str | Path | None):
        self.path = Path(path) if path else None
        self.scores: dict[str, float | list[float]] = {}  # a list for a rank request
        if self.path is not None and self.path.exists():
            for line in self.path.read_text().splitlines():
                try:
                    row = json.loads(line)
                    score = row["score"]
                    self.scores[row["key"]] = (
                        [float(x) for x in score] if isinstance(score, list) else float(score)
                    )
                except (ValueError, KeyError, TypeError):
                    continue

    def get(self, key: str) -> float | list[float] | None:
        return self.scores.get(key)

    def put(self, rows: list[tuple[str, float | list[float]]], model: str) -> None:
        if not rows:
            return
        self.scores.update(rows)
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # a last line cut short by a crash must not swallow the next
        with open(self.path, "ab+") as f:
            cut = f.seek(0, os.SEEK_END) > 0 and (
                f.seek(-1, os.SEEK_END) >= 0 and f.read(1) != b"\n"
            )
        with open(self.path, "a") as f:
            f.write(
                ("\n" if cut else "")
                + "".join(
                    json.dumps({"key": k, "score": s, "model": model}) + "\n" for k, s in rows
                )
            )
            f.flush()
            os.fsync(f.fileno())

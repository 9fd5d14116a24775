"""`text/incident-v0`: read a service log and write a short incident report; the report's quality is
judged, not checked.

Each task is a generated log of a few services (about 40 lines, seeded) in which one service starts
failing with one error at some time. Tools: `read_log(start, count)` shows numbered lines,
`grep(text)` the lines containing a text, `submit(report)` ends the episode.

Milestones (what can be checked):
- `found_error` (0.2): a tool result showed one of the incident's error lines;
- `reported` (0.2): a report of 3 to 60 words was submitted (the episode then counts as a success:
  the report was delivered).

Whether the report is right — it names the failing service, the error and when it started — is a
judge's call: the environment's `judge_reference()` is the answer a good report carries, which a
rubric's judge part (rewards/judge.py) compares the report with. `configs/quickstart_judge.yaml`
trains on the two together. Deterministic given the reset seed; no sandbox (nothing model-written
runs).
"""

from __future__ import annotations

from envs.base import ToolEnv, ToolFailure, ToolSpec
from envs.tool_calls import format_tool_call as call
from rewards.milestones import Milestone

SERVICES = ("auth", "billing", "search", "checkout", "gateway", "storage", "mailer")
ERRORS = (
    "connection pool exhausted",
    "disk full on /var/data",
    "upstream timeout after 30 s",
    "out of memory",
    "TLS certificate expired",
    "too many open files",
)
_INFO = (
    "request served in {ms} ms",
    "health check ok",
    "cache hit ratio {pct}%",
    "session started",
    "config reloaded",
    "{n} jobs queued",
)
MAX_LINES_PER_READ = 40
MIN_WORDS, MAX_WORDS = 3, 60


def _clock(seconds: int) -> str:
    return f"{seconds // 3600:02d}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class IncidentEnv(ToolEnv):
    tools = [
        ToolSpec(
            "read_log",
            "Show lines of the log, numbered from 1.",
            {
                "type": "object",
                "properties": {
                    "start": {"type": "integer", "description": "first line (1-based)"},
                    "count": {
                        "type": "integer",
                        "description": f"how many lines (at most {MAX_LINES_PER_READ})",
                    },
                },
                "required": [],
            },
        ),
        ToolSpec(
            "grep",
            "Show the log lines that contain a text (case-insensitive).",
            {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]},
        ),
        ToolSpec(
            "submit",
            f"Submit the incident report ({MIN_WORDS} to {MAX_WORDS} words); ends the episode.",
            {
                "type": "object",
                "properties": {"report": {"type": "string"}},
                "required": ["report"],
            },
        ),
    ]

    milestones = (
        Milestone("found_error", 0.2, "a tool result showed one of the incident's error lines"),
        Milestone("reported", 0.2, f"a report of {MIN_WORDS} to {MAX_WORDS} words was submitted"),
    )

    def __init__(self, max_turns: int = 4, lines: int = 40):
        super().__init__()
        self.max_turns = max_turns
        self.n_lines = lines

    @classmethod
    def kwargs_problem(cls, kwargs: dict) -> str | None:
        lines = kwargs.get("lines", 40)
        if isinstance(lines, bool) or not isinstance(lines, int) or not 20 <= lines <= 2000:
            return f"lines must be an integer from 20 to 2000, not {lines!r}"
        return super().kwargs_problem(kwargs)

    @classmethod
    def succeeded(cls, milestones: list[dict], reward: float) -> bool:
        """A report was delivered; how good it is, is the judge's part of the reward."""
        return any(m["name"] == "reported" for m in milestones)

    def _reset_task(self) -> str:
        rng = self.np_random
        self.service = SERVICES[int(rng.integers(len(SERVICES)))]
        self.error = ERRORS[int(rng.integers(len(ERRORS)))]
        first_error = int(rng.integers(self.n_lines // 3, 2 * self.n_lines // 3))
        t = 9 * 3600 + int(rng.integers(0, 3600))
        self.log, self.error_lines = [], set()
        for i in range(self.n_lines):
            t += int(rng.integers(1, 40))
            if i >= first_error and (i == first_error or rng.random() < 0.35):
                if i == first_error:
                    self.since = _clock(t)
                self.error_lines.add(len(self.log))
                self.log.append(f"2026-03-14 {_clock(t)} ERROR {self.service}: {self.error}")
                continue
            other = SERVICES[int(rng.integers(len(SERVICES)))]
            level = "WARN" if rng.random() < 0.08 else "INFO"
            msg = "slow response" if level == "WARN" else _INFO[int(rng.integers(len(_INFO)))]
            msg = msg.format(
                ms=int(rng.integers(3, 900)),
                pct=int(rng.integers(40, 99)),
                n=int(rng.integers(1, 50)),
            )
            self.log.append(f"2026-03-14 {_clock(t)} {level} {other}: {msg}")
        return (
            f"Our services wrote {len(self.log)} log lines today; read them with read_log or search them with grep. "
            f"Find the incident and submit a short report ({MAX_WORDS} words at most): which service failed, "
            "with what error, and since when."
        )

    def judge_reference(self) -> str:
        return f"The {self.service} service failed with '{self.error}', starting at {self.since}."

    def tool_functions(self):
        return {"read_log": self._read_log, "grep": self._grep, "submit": self._submit}

    def _show(self, indices: list[int]) -> str:
        if any(i in self.error_lines for i in indices):
            self.reach("found_error", 0.2, self._events)
        return "\n".join(f"{i + 1}: {self.log[i]}" for i in indices)

    def _read_log(self, start: int = 1, count: int = 20) -> str:
        if (
            isinstance(start, bool)
            or not isinstance(start, int)
            or isinstance(count, bool)
            or not isinstance(count, int)
        ):
            raise ToolFailure("start and count must be integers")
        if not 1 <= start <= len(self.log):
            raise ToolFailure(f"start must be from 1 to {len(self.log)}")
        count = max(1, min(count, MAX_LINES_PER_READ))
        return self._show(list(range(start - 1, min(len(self.log), start - 1 + count))))

    def _grep(self, text: str) -> str:
        if not isinstance(text, str) or not text.strip():
            raise ToolFailure("text must be a non-empty string")
        hits = [i for i, line in enumerate(self.log) if text.lower() in line.lower()]
        if not hits:
            return "no line contains it"
        shown = self._show(hits[:MAX_LINES_PER_READ])
        return shown + (
            f"\n({len(hits) - MAX_LINES_PER_READ} more)" if len(hits) > MAX_LINES_PER_READ else ""
        )

    def _submit(self, report) -> str:
        if not isinstance(report, str):
            raise ToolFailure("report must be a string")
        words = len(report.split())
        if not MIN_WORDS <= words <= MAX_WORDS:
            raise ToolFailure(
                f"the report has {words} words; it must have {MIN_WORDS} to {MAX_WORDS}"
            )
        self.finish()
        self.reach("reported", 0.2, self._events)
        return "report received"

    def expert_turns(self) -> list[str]:
        """A scripted expert's turns (tests, demonstrations): find the errors, report them."""
        n = len(self.error_lines)
        return [
            "Look for errors.\n" + call("grep", text="ERROR"),
            call(
                "submit",
                report=f"Incident: the {self.service} service fails with '{self.error}' since "
                f"{self.since} ({n} errors in the log).",
            ),
        ]

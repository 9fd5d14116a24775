"""`long/oncall-v0`: an on-call investigation over a fleet's logs, as long as its `horizon` asks.

The workspace (a sandbox, default backend `bwrap`) holds a chain of `horizon` services that a request
passes through: `logs/<service>.log` (timestamped INFO and WARN lines, and for a few failing services
ERROR lines from the time they started failing) and `routes/<service>` (the next service downstream).
The task names the first service. Tools: `check(service)` runs `grep` over that service's log and
reads its route in the sandbox, and answers with a verdict (`FAILING billing: 4 ERROR lines
(disk full on /var/data). Next: ledger.`, or `ok search: no ERROR lines. ...`) and the next service
downstream; `report(failing)` submits the comma-separated failing services and
ends the episode. A solution takes `horizon` checks and the report: `horizon + 1` tool calls.

Built so that what the agent found early is needed at the end: the failing services are spread
over the whole chain (one in every quarter of it at least, at `horizon` >= 4) and the report must
name all of them, while where to go next is always in the last observation. An agent that keeps
only its last turns (`rollout.context.mode: window`) still finds its way but has lost the early
failures by the end; one whose context only grows (`full`) runs out of it at long horizons; one that
carries its findings in its own summaries (`compact`) can finish. The scripted expert writes those
summaries (`expert_summary`): the failing services so far and the next check.

Milestones (sparse):
- `found:<service>` (0.25 / failing services, each): a check showed a failing service's errors;
- `named:<service>` (0.25 / failing services, each): the report names a failing service, and no
  healthy one (a report naming a healthy service earns none of these);
- `solved` (0.5): the report names exactly the failing services.

`horizon` may be a list: each episode draws one from it by its seed (training over a range of
horizons). Deterministic given the seed.
"""

from __future__ import annotations

from envs.base import SandboxedEnv, ToolFailure, ToolSpec
from envs.tool_calls import format_tool_call as call
from rewards.milestones import Milestone

_BASE = [
    "auth",
    "billing",
    "search",
    "checkout",
    "gateway",
    "storage",
    "mailer",
    "ledger",
    "catalog",
    "pricing",
    "inventory",
    "shipping",
    "profile",
    "session",
    "media",
    "feed",
    "notify",
    "export",
    "quota",
    "audit",
    "backup",
    "cache",
    "queue",
    "scheduler",
    "metrics",
    "tracing",
    "config",
    "secrets",
    "payments",
    "orders",
    "cart",
    "reviews",
]
SERVICES = _BASE + [f"{b}-worker" for b in _BASE]
"""The pool a task draws its services from (64: the longest horizon)."""
SLACK = 4
"""Turns an episode has beyond the `horizon` + 1 calls a solution takes (its `max_turns` by default)."""

_ERRORS = [
    "connection pool exhausted",
    "disk full on /var/data",
    "upstream timeout after 30 s",
    "out of memory",
    "TLS certificate expired",
    "too many open files",
    "replica lag above 60 s",
    "deadlock detected",
]
_INFO = [
    "request served in {n} ms",
    "health check ok",
    "cache hit ratio {n}%",
    "session started",
    "config reloaded",
    "{n} jobs queued",
    "flushed {n} records",
]
_WARN = [
    "slow request: {n} ms",
    "retrying call (attempt {k})",
    "queue depth {n}",
    "GC pause {n} ms",
]


def _clock(seconds: int) -> str:
    return f"{seconds // 3600:02d}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class OncallEnv(SandboxedEnv):
    tools = [
        ToolSpec(
            "check",
            "Show a service's ERROR lines (grep over its log) and the next service downstream.",
            {
                "type": "object",
                "properties": {"service": {"type": "string"}},
                "required": ["service"],
            },
        ),
        ToolSpec(
            "report",
            "Report the failing services, comma-separated; ends the episode.",
            {
                "type": "object",
                "properties": {"failing": {"type": "string"}},
                "required": ["failing"],
            },
        ),
    ]

    milestones = (
        Milestone(
            "found:*",
            None,
            "a check showed a failing service's errors (0.25 / failing services each)",
        ),
        Milestone(
            "named:*",
            None,
            "the report names a failing service and no healthy one (0.25 / failing services each)",
        ),
        Milestone("solved", 0.5, "the report names exactly the failing services"),
    )

    def __init__(
        self,
        horizon: int | list = 12,
        max_turns: int = 0,
        backend: str = "bwrap",
        timeout_s: float = 10.0,
        **sandbox_options,
    ):
        horizons = list(horizon) if isinstance(horizon, (list, tuple)) else [horizon]
        super().__init__(max_turns or max(horizons) + SLACK, backend, timeout_s, **sandbox_options)
        self.horizons, self.fixed_turns = horizons, max_turns

    @classmethod
    def kwargs_problem(cls, kwargs: dict) -> str | None:
        h = kwargs.get("horizon", 12)
        hs = h if isinstance(h, list) else [h]
        if not hs or not all(
            isinstance(x, int) and not isinstance(x, bool) and 2 <= x <= len(SERVICES) for x in hs
        ):
            return f"horizon must be an integer (or a list of them) from 2 to {len(SERVICES)}, not {h!r}"
        turns = kwargs.get("max_turns", 0)
        if not (isinstance(turns, int) and not isinstance(turns, bool) and turns >= 0):
            return f"max_turns must be an integer >= 0 (0: the episode's horizon + {SLACK}), not {turns!r}"
        return super().kwargs_problem({**kwargs, "max_turns": turns or 1})

    def _reset_task(self) -> str:
        rng = self.np_random
        self.horizon = self.horizons[int(rng.integers(len(self.horizons)))]
        # a few turns of slack on the solution's
        self.max_turns = self.fixed_turns or self.horizon + SLACK
        self.services = [
            SERVICES[i] for i in rng.choice(len(SERVICES), size=self.horizon, replace=False)
        ]
        # failing: one in each quarter of the chain at least, so the report needs early findings too
        quarters = [range(q * self.horizon // 4, (q + 1) * self.horizon // 4) for q in range(4)]
        picks = {int(rng.choice(list(q))) for q in quarters if len(q)}
        extra = int(rng.integers(0, max(1, self.horizon // 8) + 1))
        picks |= {
            int(i) for i in rng.choice(self.horizon, size=min(extra, self.horizon), replace=False)
        }
        # one healthy service at least
        picks = picks if len(picks) < self.horizon else set(sorted(picks)[:-1])
        self.failing = [self.services[i] for i in sorted(picks)]
        self.new_sandbox()
        for i, name in enumerate(self.services):
            self.sandbox.workspace.write_text(
                f"logs/{name}.log", self._log(rng, name in self.failing)
            )
            self.sandbox.workspace.write_text(
                f"routes/{name}", (self.services[i + 1] if i + 1 < self.horizon else "") + "\n"
            )
        return (
            f"Incident: requests fail somewhere along a chain of {self.horizon} services that starts at "
            f"{self.services[0]}. Check every service, following the chain downstream, then report every "
            f"failing service."
        )

    def _log(self, rng, failing: bool) -> str:
        """A service's log: INFO and WARN lines, and for a failing service one error repeated from
        some line on (at least once)."""
        lines, t = [], int(rng.integers(3600, 5 * 3600))
        error = _ERRORS[int(rng.integers(len(_ERRORS)))] if failing else None
        fail_at = int(rng.integers(8, 20))
        n = int(rng.integers(20, 32))
        for i in range(n):
            t += int(rng.integers(1, 90))
            if error and i >= fail_at and (rng.random() < 0.6 or i == n - 1):
                lines.append(f"{_clock(t)} ERROR {error}")
            elif rng.random() < 0.2:
                warn = _WARN[int(rng.integers(len(_WARN)))]
                lines.append(
                    f"{_clock(t)} WARN "
                    + warn.format(n=int(rng.integers(100, 9000)), k=int(rng.integers(2, 5)))
                )
            else:
                info = _INFO[int(rng.integers(len(_INFO)))]
                lines.append(f"{_clock(t)} INFO " + info.format(n=int(rng.integers(1, 999))))
        return "\n".join(lines) + "\n"

    def tool_functions(self):
        return {"check": self._check, "report": self._report}

    def _check(self, service) -> str:
        name = str(service).strip()
        if name not in self.services:
            raise ToolFailure(f"no service {name!r} in this chain")
        # the service name is an argument of the script, never part of it
        script = 'grep -c " ERROR " "logs/$1.log"; grep -m1 " ERROR " "logs/$1.log"; echo "next: $(cat "routes/$1")"; exit 0'
        result = self.sandbox.run(["/bin/sh", "-c", script, "sh", name])
        self.record_sandbox(result)
        if result.exit_code != 0 or result.resource:
            raise ToolFailure(result.observation(400))
        lines = result.stdout.strip().splitlines()
        count = int(lines[0]) if lines and lines[0].isdigit() else 0
        nxt = (
            lines[-1].removeprefix("next:").strip()
            if lines and lines[-1].startswith("next:")
            else ""
        )
        downstream = f" Next: {nxt}." if nxt else " End of the chain."
        if not count:
            return f"ok {name}: no ERROR lines.{downstream}"
        if name in self.failing:
            self.reach(f"found:{name}", 0.25 / len(self.failing))
        error = lines[1].split(" ERROR ", 1)[-1] if len(lines) > 2 else "?"
        return f"FAILING {name}: {count} ERROR lines ({error}).{downstream}"

    def _report(self, failing) -> str:
        self.finish()
        named = [s.strip() for s in str(failing).replace(";", ",").split(",") if s.strip()]
        wrong = [s for s in named if s not in self.failing]
        if not wrong:
            for s in dict.fromkeys(named):
                self.reach(f"named:{s}", 0.25 / len(self.failing))
        if set(named) == set(self.failing):
            self.reach("solved", 0.5)
            return "correct: those are the failing services"
        missed = len(set(self.failing) - set(named))
        return f"incorrect: {missed} failing service(s) missing, {len(set(wrong))} named that are not failing"

    # --- the scripted expert ---
    def expert_turns(self) -> list[str]:
        return [call("check", service=s) for s in self.services] + [
            call("report", failing=", ".join(self.failing))
        ]

    def expert_summary(self, done: int) -> str:
        done = min(done, self.horizon)
        found = [s for s in self.services[:done] if s in self.failing]
        nxt = f"Next: check {self.services[done]}." if done < self.horizon else "Next: report."
        return f"Failing so far: {', '.join(found) or 'none'}. {nxt}"

    def judge_reference(self) -> str:
        return "Failing services: " + ", ".join(self.failing)

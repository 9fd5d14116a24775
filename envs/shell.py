"""`tools/shell-v0`: file-system work in a sandboxed workspace, checked from the workspace's state.

The workspace holds `logs/` with a few log files of INFO/WARN/ERROR lines (contents, counts and the
level asked for vary with the seed). The task: put every line of the asked level into
`report/matches.txt` (sorted, byte for byte) and their number into `report/count.txt`, then submit.
Tools: `bash(command)` runs in the sandbox (default backend `bwrap`), `submit()` ends the episode.

Milestones (sparse: the only rewards), checked after every command:
- `matches` (0.5): `report/matches.txt` holds exactly the sorted matching lines;
- `count` (0.25): `report/count.txt` holds their number;
- `solved` (0.25): submitted with both right.

Every episode gets a fresh workspace, removed at the next reset or at `close()`. A command that hits
a limit is reported in the observation and in `info["sandbox_events"]`; a sandbox that cannot start
ends the episode as an infrastructure error.
"""

from __future__ import annotations

from envs.base import SandboxedEnv, ToolSpec
from envs.tool_calls import format_tool_call as call
from rewards.milestones import Milestone

_WORDS = [
    "disk",
    "cache",
    "worker",
    "request",
    "token",
    "shard",
    "socket",
    "queue",
    "lease",
    "batch",
    "retry",
    "node",
]
_VERBS = [
    "started",
    "failed",
    "timed out",
    "recovered",
    "stalled",
    "flushed",
    "rejected",
    "completed",
]


class ShellEnv(SandboxedEnv):
    tools = [
        ToolSpec(
            "bash",
            "Run a shell command in the workspace (a sandbox without network); returns exit code and output.",
            {
                "type": "object",
                "properties": {"command": {"type": "string"}},
                "required": ["command"],
            },
        ),
        ToolSpec(
            "submit",
            "Declare the task done; ends the episode.",
            {"type": "object", "properties": {}},
        ),
    ]

    milestones = (
        Milestone("matches", 0.5, "report/matches.txt holds exactly the sorted matching lines"),
        Milestone("count", 0.25, "report/count.txt holds their number"),
        Milestone("solved", 0.25, "submitted with both files right"),
    )

    def __init__(
        self, max_turns: int = 8, backend: str = "bwrap", timeout_s: float = 10.0, **sandbox_options
    ):
        super().__init__(max_turns, backend, timeout_s, **sandbox_options)

    def _reset_task(self) -> str:
        rng = self.np_random
        self.level = ["ERROR", "WARN"][int(rng.integers(2))]
        self.new_sandbox()
        lines_all = []
        for f in range(int(rng.integers(3, 6))):
            lines = []
            for i in range(int(rng.integers(15, 40))):
                lvl = ["INFO", "INFO", "WARN", "ERROR"][int(rng.integers(4))]
                msg = f"{_WORDS[int(rng.integers(len(_WORDS)))]} {int(rng.integers(1, 99))} {_VERBS[int(rng.integers(len(_VERBS)))]}"
                lines.append(f"2026-01-{f + 1:02d} {i:02d}:00 {lvl} {msg}")
            self.sandbox.workspace.write_text(f"logs/service-{f}.log", "\n".join(lines) + "\n")
            lines_all += lines
        self.expected = sorted(line for line in lines_all if f" {self.level} " in line)
        return (
            f"The directory logs/ holds service logs. Write every line with level {self.level} from all of "
            f"them, sorted, to report/matches.txt, and the number of such lines to report/count.txt. "
            f"Then call submit."
        )

    def tool_functions(self):
        return {"bash": self._bash, "submit": self._submit}

    def _read(self, relpath: str) -> str | None:
        try:
            return self.sandbox.workspace.read_text(relpath)
        except (OSError, ValueError):
            return None

    def _progress(self) -> tuple[bool, bool]:
        matches = self._read("report/matches.txt")
        count = self._read("report/count.txt")
        ok_matches = matches is not None and matches.rstrip("\n").split("\n") == self.expected
        ok_count = count is not None and count.strip() == str(len(self.expected))
        if ok_matches:
            self.reach("matches", 0.5, self._events)
        if ok_count:
            self.reach("count", 0.25, self._events)
        return ok_matches, ok_count

    def _bash(self, command: str) -> str:
        if not isinstance(command, str):
            raise TypeError("command must be a string")
        result = self.sandbox.run(command)
        self.record_sandbox(result)
        self._progress()
        return result.observation()

    def _submit(self) -> str:
        self.finish()
        ok_matches, ok_count = self._progress()
        if ok_matches and ok_count:
            self.reach("solved", 0.25, self._events)
            return "accepted"
        return "rejected: " + ", ".join(
            n
            for n, ok in (("report/matches.txt", ok_matches), ("report/count.txt", ok_count))
            if not ok
        )

    def expert_turns(self) -> list[str]:
        return [
            call("bash", command="ls logs && mkdir -p report"),
            call(
                "bash",
                command=f"grep -h ' {self.level} ' logs/*.log | LC_ALL=C sort > report/matches.txt",
            ),
            call(
                "bash",
                command="wc -l < report/matches.txt | tr -d ' ' > report/count.txt && cat report/count.txt",
            ),
            call("submit"),
        ]

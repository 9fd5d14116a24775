"""One memory limit for a whole sandbox: a cgroup of its own, where the machine lets us make one.

RLIMIT_AS bounds each process's address space, so seven processes under a 512 MiB limit held
1,075 MiB together: a fork-heavy command walked past it. A cgroup counts every process of the
sandbox together. `SandboxCgroup.make(limit_mb)` creates one below the cgroup this process is in:
cgroup v2 (`memory.max`) where the unified hierarchy is mounted and writable, else v1's memory
controller (`memory.limit_in_bytes`, nested under the current cgroup: what works on this project's
machines), else None, and the per-process RLIMIT_AS stays the only bound (`scope()` says which).
`enter()` (in a child before exec) puts the calling process in it, so everything it starts is
counted; `oom_kills()` counts the kernel's kills for the limit, which the backend reports as the
`memory` limit; `close()` removes it once its processes are gone.

Not covered: swap (the machines this was built on have none; v1's memsw limit is set when present).
"""

from __future__ import annotations

import itertools
import os
import re
import time
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")
_names = itertools.count()


def _own(line_re: str) -> str | None:
    """This process's cgroup path for the hierarchy whose /proc/self/cgroup line matches."""
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            m = re.match(line_re, line)
            if m:
                return m.group(1)
    except OSError:
        pass
    return None


class SandboxCgroup:
    def __init__(self, path: Path, version: int, limit_mb: int):
        self.path, self.version, self.limit_mb = path, version, limit_mb

    @classmethod
    def make(cls, limit_mb: int) -> SandboxCgroup | None:
        """A new cgroup limited to `limit_mb` MiB, or None where none can be made here."""
        name = f"longhorizon-sandbox-{os.getpid()}-{next(_names)}"
        limit = str(limit_mb << 20)
        v2 = _own(r"0::(/.*)$")
        if v2 is not None and (ROOT / "cgroup.controllers").exists():
            made = cls._try(
                ROOT / v2.lstrip("/") / name,
                {"memory.max": limit, "memory.swap.max": "0"},
                2,
                limit_mb,
            )
            if made:
                return made
        v1 = _own(r"\d+:memory:(/.*)$")
        if v1 is not None and (ROOT / "memory").is_dir():
            return cls._try(
                ROOT / "memory" / v1.lstrip("/") / name,
                {"memory.limit_in_bytes": limit, "memory.memsw.limit_in_bytes": limit},
                1,
                limit_mb,
            )
        return None

    @classmethod
    def _try(cls, path: Path, settings: dict, version: int, limit_mb: int) -> SandboxCgroup | None:
        try:
            path.mkdir()
        except OSError:
            return None
        try:
            for key, value in settings.items():
                if key.endswith(("swap.max", "memsw.limit_in_bytes")) and not (path / key).exists():
                    continue
                (path / key).write_text(value)
            limit_file = "memory.max" if version == 2 else "memory.limit_in_bytes"
            if (path / limit_file).read_text().strip() in ("max", ""):
                raise OSError("the limit did not take")
        except OSError:
            try:
                path.rmdir()
            except OSError:
                pass
            return None
        return cls(path, version, limit_mb)

    @property
    def scope(self) -> str:
        return f"the whole sandbox (cgroup v{self.version})"

    def set_limit(self, limit_mb: int) -> None:
        """Change the limit (a call with limits of its own); a no-op when it is already that."""
        if limit_mb == self.limit_mb:
            return
        value = str(limit_mb << 20)
        keys = (
            ("memory.max",)
            if self.version == 2
            else ("memory.memsw.limit_in_bytes", "memory.limit_in_bytes")
        )
        # v1: memsw must stay >= the memory limit
        if limit_mb > self.limit_mb and self.version == 1:
            keys = tuple(reversed(keys))
        for key in keys:
            try:
                (self.path / key).write_text(value)
            except OSError:
                pass
        self.limit_mb = limit_mb

    def enter(self) -> None:
        """Put the calling process (and so all it starts) in the cgroup; for a child before exec."""
        with open(self.path / "cgroup.procs", "w") as fh:
            fh.write(str(os.getpid()))

    def oom_kills(self) -> int:
        """How many processes the kernel has killed for this cgroup's limit so far."""
        events = "memory.events" if self.version == 2 else "memory.oom_control"
        try:
            text = (self.path / events).read_text()
        except OSError:
            return 0
        m = re.search(r"^oom_kill (\d+)", text, re.M)
        return int(m.group(1)) if m else 0

    def close(self, wait_s: float = 5.0) -> None:
        """Remove the cgroup once its processes have gone (a killed sandbox's last ones take a moment)."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                if time.monotonic() > deadline:
                    return  # left for the system; it holds no process
                time.sleep(0.05)


def scope(limit_mb: int = 64) -> str:
    """Where a sandbox's memory limit applies on this machine (for `sandbox run --help`)."""
    cg = SandboxCgroup.make(limit_mb)
    if cg is None:
        return "each process (RLIMIT_AS; no cgroup can be made here)"
    cg.close()
    return cg.scope

"""The `none` backend: a plain subprocess in the workspace, with rlimits. NOT a sandbox.

It applies the wall-time, CPU, memory, file-size and output limits, runs the command in its own
session and kills that session's process group at the end. It is here for trusted tools (and for
measuring what isolation costs), and is never chosen by default.

Does NOT protect against anything a hostile program would do: it reads and writes every file the
host user can, uses the network, sees and signals the host's processes (`kill -9 -1` as root takes
the machine's processes down), and a double-forked child that leaves the session survives the
call. The process limit is not applied (RLIMIT_NPROC counts all of the host user's processes, and
root is exempt from it).
"""

from __future__ import annotations

import os
import time

from envs.sandbox._process import rlimit_setter, run_process
from envs.sandbox.base import Limits, SandboxBase, SandboxResult, Workspace, classify


class UnsafeSandbox(SandboxBase):
    backend = "none"

    def __init__(self, workspace=None, limits: Limits | None = None, *, env: dict | None = None):
        self.limits = limits or Limits()
        self.workspace = Workspace(workspace)
        self.env = {**os.environ, "HOME": str(self.workspace.path), **(env or {})}

    def run(
        self, argv: list[str] | str, *, stdin: str | None = None, limits: Limits | None = None
    ) -> SandboxResult:
        limits = limits or self.limits
        if isinstance(argv, str):
            argv = ["/bin/sh", "-c", argv]
        started = time.time()
        result = run_process(
            argv,
            limits=limits,
            backend=self.backend,
            cwd=str(self.path),
            env=self.env,
            stdin=stdin,
            preexec=rlimit_setter(limits, processes=0),
        )
        classify(result)
        return self._check_disk(result, limits, started)

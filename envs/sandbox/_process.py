"""Run one process tree under a wall-clock limit with bounded output capture (bwrap and none backends).

Output is read on two threads and only the first `output_bytes` of each stream are kept; a command
that keeps printing far past that (16x) is killed rather than left to burn CPU until the timeout.
The process starts in its own session, and the whole session's process group is killed at the end.
"""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import threading
import time
from collections.abc import Callable

from envs.sandbox._helper import FLOOD as _FLOOD_FACTOR
from envs.sandbox._helper import Capture
from envs.sandbox.base import Limits, SandboxResult


def rlimit_setter(limits: Limits, *, processes: int | None = None) -> Callable[[], None]:
    """A preexec function applying the per-process limits (runs in the child before exec)."""
    mem = limits.memory_mb << 20
    fsize = limits.file_mb << 20
    cpu = int(limits.cpu_s)
    nproc = processes if processes is not None else limits.processes

    def apply():
        # Soft CPU limit sends SIGXCPU; the hard one, a second later, SIGKILL for a process that ignores it.
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
        resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if nproc:
            resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))

    return apply


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_process(
    argv: list[str],
    *,
    limits: Limits,
    backend: str,
    cwd: str | None = None,
    env: dict | None = None,
    stdin: str | None = None,
    preexec: Callable[[], None] | None = None,
    pass_fds=(),
) -> SandboxResult:
    """Run `argv`; return its result (limits known here filled in; the rest is `classify`'s)."""
    t0 = time.monotonic()
    proc = subprocess.Popen(
        argv,
        cwd=cwd,
        env=env,
        stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
        preexec_fn=preexec,
        pass_fds=pass_fds,
    )
    flooded = threading.Event()

    def on_flood():
        flooded.set()
        _kill_group(proc.pid)

    out = Capture(proc.stdout.fileno(), limits.output_bytes, on_flood)
    err = Capture(proc.stderr.fileno(), limits.output_bytes, on_flood)
    out.start()
    err.start()
    if stdin is not None:

        def feed():
            try:
                proc.stdin.write(stdin.encode())
                proc.stdin.close()
            except (BrokenPipeError, OSError):
                pass

        threading.Thread(target=feed, daemon=True).start()
    timed_out = False
    try:
        proc.wait(timeout=limits.timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        _kill_group(proc.pid)
        proc.wait()
    _kill_group(proc.pid)  # stragglers left in the session (the none backend has no pid namespace)
    out.join(timeout=2)
    err.join(timeout=2)
    code = proc.returncode
    result = SandboxResult(
        exit_code=128 - code if code < 0 else code,
        stdout=out.text(),
        stderr=err.text(),
        truncated=out.total > out.kept or err.total > err.kept,
        timed_out=timed_out,
        killed=timed_out or flooded.is_set() or code < 0,
        duration_s=time.monotonic() - t0,
        backend=backend,
    )
    if timed_out:
        result.resource = "wall_time"
        result.events.append(f"killed at the wall-time limit ({limits.timeout_s:g}s)")
    elif flooded.is_set():
        result.resource = "output"
        result.events.append(
            f"killed for output flooding (> {_FLOOD_FACTOR}x {limits.output_bytes} bytes)"
        )
    return result

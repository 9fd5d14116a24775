"""The helper that lives inside an episode's bwrap sandbox (envs/sandbox/bwrap.py, `per_episode`):
it runs each call's command as the sandbox user under the call's limits, and after the call kills
every process of that user and empties /tmp, so a call starts from what a fresh sandbox would give
(only the workspace carries over, as it does between fresh sandboxes).

It runs as root without capabilities but CAP_SETUID and CAP_SETGID (bwrap drops the rest), so the
commands, which run as the sandbox user, can neither signal it nor trace it (`kill -9 -1` in a
command stops at the helper). Stdlib only: the host passes this file's text to the interpreter
with -c (the project is not mounted in the sandbox).

Protocol: a JSON object per line on stdin, {"argv", "stdin", "limits"}; a JSON object per line on
stdout, the call's result (the fields of `SandboxResult` that the sandbox knows). End of input ends
the helper, and with it the sandbox.
"""

import json
import os
import resource
import signal
import sys
import threading
import time

UID = -1  # the sandbox user, from the command line (main)
# what /tmp held when the sandbox started (bwrap's mount points: never swept)
TMP_AT_START: set = set()
FLOOD = (
    16  # output past this many times the kept bytes: the call is killed rather than left printing
)


def as_user() -> None:
    os.setgroups([])
    os.setresgid(UID, UID, UID)
    os.setresuid(UID, UID, UID)


def sweep() -> None:
    """Kill every process of the sandbox user and empty /tmp, from a child that becomes that user
    (kill(-1) then reaches exactly the user's processes in this pid namespace, not the helper)."""
    if not living() and not left_in_tmp():  # the common case: nothing left, no fork needed
        return
    pid = os.fork()
    if pid == 0:
        try:
            as_user()
            deadline = time.monotonic() + 2.0
            # a fork in flight when the first signal lands: send again
            while time.monotonic() < deadline:
                try:
                    os.kill(-1, signal.SIGKILL)
                except ProcessLookupError:
                    break
                if not living():
                    break
                time.sleep(0.002)
            for name in left_in_tmp():
                remove_tree(os.path.join("/tmp", name), os.lstat("/tmp").st_dev)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)


def left_in_tmp() -> list[str]:
    """What the calls put in /tmp (not what the sandbox started with: bwrap's mount points for a
    toolchain that lives under the host's /tmp)."""
    return sorted(set(os.listdir("/tmp")) - TMP_AT_START)


def remove_tree(path: str, dev: int) -> None:
    """`path` and everything under it on /tmp's own file system (never into a mount)."""
    try:
        st = os.lstat(path)
    except OSError:
        return
    if st.st_dev != dev:
        return
    if os.path.isdir(path) and not os.path.islink(path):
        for name in os.listdir(path):
            remove_tree(os.path.join(path, name), dev)
        try:
            os.rmdir(path)
        except OSError:
            pass
    else:
        try:
            os.unlink(path)
        except OSError:
            pass


def living() -> list[int]:
    """The sandbox user's processes other than this one that are not yet dead (zombies excluded)."""
    me, out = os.getpid(), []
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) != me:
            try:
                with open(f"/proc/{name}/status") as fh:
                    fields = dict(line.split(":", 1) for line in fh if ":" in line)
            except OSError:
                continue
            if int(fields.get("Uid", "-1").split()[0]) == UID and not fields.get(
                "State", ""
            ).strip().startswith("Z"):
                out.append(int(name))
    return out


class Capture(threading.Thread):
    """Reads a pipe to its end, keeping its first `keep` bytes; `on_flood` once it has passed FLOOD
    times that (envs/sandbox/_process.py reads its pipes with it too)."""

    def __init__(self, fd: int, keep: int, on_flood):
        super().__init__(daemon=True)
        self.fd, self.keep, self.on_flood = fd, keep, on_flood
        self.chunks, self.kept, self.total = [], 0, 0

    def run(self) -> None:
        flooded = False
        while True:
            try:
                data = os.read(self.fd, 65536)
            except OSError:
                break
            if not data:
                break
            self.total += len(data)
            if self.kept < self.keep:
                piece = data[: self.keep - self.kept]
                self.chunks.append(piece)
                self.kept += len(piece)
            if not flooded and self.total > FLOOD * self.keep:
                flooded = True
                self.on_flood()

    def text(self) -> str:
        return b"".join(self.chunks).decode("utf-8", errors="replace")


def child(argv, lim, fds) -> None:
    """In the forked child: become the sandbox user with the call's limits and exec the command."""
    try:
        os.setsid()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        os.closerange(3, 4096)
        as_user()
        cpu, mem, fsize = int(lim["cpu_s"]), lim["memory_mb"] << 20, lim["file_mb"] << 20
        # SIGXCPU, then SIGKILL a second later
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
        resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        resource.setrlimit(resource.RLIMIT_NPROC, (lim["processes"], lim["processes"]))
        os.chdir("/workspace")
        for sig in (signal.SIGPIPE, signal.SIGXFSZ):
            signal.signal(sig, signal.SIG_DFL)
        try:  # at the sandbox's memory limit the kernel kills the command first, never this helper
            with open("/proc/self/oom_score_adj", "w") as fh:
                fh.write("1000")
        except OSError:
            pass
        os.execvp(argv[0], argv)
    except BaseException as exc:  # noqa: BLE001  (reported as the command's own failure)
        try:
            os.write(2, f"sandbox: cannot run {argv[0]}: {exc}\n".encode())
        finally:
            os._exit(127)


def run(req: dict) -> dict:
    argv, lim = req["argv"], req["limits"]
    t0 = time.monotonic()
    in_r, in_w = os.pipe()
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        child(argv, lim, (in_r, out_w, err_w))
    for fd in (in_r, out_w, err_w):
        os.close(fd)
    flooded = threading.Event()

    def on_flood():
        flooded.set()
        sweep()

    out = Capture(out_r, lim["output_bytes"], on_flood)
    err = Capture(err_r, lim["output_bytes"], on_flood)
    out.start()
    err.start()

    def feed():
        try:
            if req.get("stdin"):
                os.write(in_w, req["stdin"].encode())
        except OSError:
            pass
        finally:
            os.close(in_w)

    threading.Thread(target=feed, daemon=True).start()
    status, done = [0], threading.Event()

    def wait():
        status[0] = os.waitpid(pid, 0)[1]
        done.set()

    threading.Thread(target=wait, daemon=True).start()
    timed_out = not done.wait(lim["timeout_s"])
    sweep()  # at the wall-time limit, or the call's stragglers once it ended
    done.wait()
    out.join(2)
    err.join(2)
    for fd in (out_r, err_r):
        os.close(fd)
    code = os.waitstatus_to_exitcode(status[0])
    result = {
        "exit_code": 128 - code if code < 0 else code,
        "stdout": out.text(),
        "stderr": err.text(),
        "truncated": out.total > out.kept or err.total > err.kept,
        "timed_out": timed_out,
        "killed": timed_out or flooded.is_set() or code < 0,
        "resource": None,
        "events": [],
        "duration_s": time.monotonic() - t0,
    }
    if timed_out:
        result["resource"] = "wall_time"
        result["events"].append(f"killed at the wall-time limit ({lim['timeout_s']:g}s)")
    elif flooded.is_set():
        result["resource"] = "output"
        result["events"].append(
            f"killed for output flooding (> {FLOOD}x {lim['output_bytes']} bytes)"
        )
    return result


def main() -> None:
    global UID, TMP_AT_START
    UID = int(sys.argv[1])
    TMP_AT_START = set(os.listdir("/tmp"))
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    for line in sys.stdin:
        if line.strip():
            sys.stdout.write(json.dumps(run(json.loads(line))) + "\n")
            sys.stdout.flush()


if __name__ == "__main__":
    main()

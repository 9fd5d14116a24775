"""A local Ray goes with the driver that started it, however that driver ends.

`ray.init()` starts Ray's processes (GCS, raylet, dashboard, log monitor; the raylet's agents and
workers under it) as children of the driver. A driver that exits cleanly stops them; one killed
with SIGKILL (or by the OOM killer) left them running for minutes, holding ports, memory and the
session directory. `watch(pids)` starts this module as a process of its own, in a session of its
own, holding the read end of a pipe whose write end only the driver has: when the driver is gone,
for whatever reason, the pipe reads end-of-file, and the reaper stops every Ray process it ever saw
in those trees (read once a second while the driver lives) that still runs: SIGTERM, then SIGKILL
after a grace period.

Only processes whose command line shows Ray's and whose start time is the one seen are signalled,
so a pid reused after a clean exit is left alone. Not covered: a cluster the driver joined (`ray.address`): that is the operator's.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time


def watch(pids: list[int]) -> None:
    """Start the reaper for the process trees of `pids` (this process's children); it outlives us."""
    read, write = os.pipe()
    subprocess.Popen(
        [sys.executable, "-m", "rl.ray_reaper", str(read), *map(str, pids)],
        pass_fds=(read,),
        start_new_session=True,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    os.close(read)
    # only this process holds it: our children must not keep it open
    os.set_inheritable(write, False)
    watch.fd = write  # kept open (and referenced) for this process's lifetime


def _tree(roots: list[int]) -> list[int]:
    """`roots` and every process below them, from /proc (parents first)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], list(roots)
    while todo:
        pid = todo.pop(0)
        if pid not in out:
            out.append(pid)
            todo += children.get(pid, [])
    return out


def _start_time(pid: int) -> int | None:
    """The process's start time (clock ticks since boot): with the pid, names a process uniquely."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return int(fh.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _is_ray(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return b"ray" in fh.read()
    except OSError:
        return False


def _ray_tree(roots: list[int]) -> dict[int, int | None]:
    return {p: _start_time(p) for p in _tree(roots) if _is_ray(p)}


def main(fd: int, roots: list[int], grace_s: float = 5.0, every_s: float = 1.0) -> None:
    # The trees are read while the driver lives, again and again, and every Ray process ever seen in
    # them is kept: once the driver is gone, processes started with Ray's fate-sharing die with it,
    # and the workers and agents of a raylet that died are handed to init, no longer below any root.
    known: dict[int, int | None] = {}
    while True:
        known.update(_ray_tree(roots))
        ready, _, _ = select.select([fd], [], [], every_s)
        if ready and not os.read(fd, 1024):  # end-of-file: the driver is gone
            break
    known.update(_ray_tree(roots))

    def alive(
        pid: int,
    ) -> bool:  # the same process as seen (not a pid reused since) and still Ray's
        return _start_time(pid) == known[pid] and _is_ray(pid)

    for sig in (signal.SIGTERM, signal.SIGKILL):
        targets = [p for p in known if alive(p)]
        for pid in targets:
            try:
                os.kill(pid, sig)
            except OSError:
                pass
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(alive(p) for p in targets):
            time.sleep(0.1)


if __name__ == "__main__":
    main(int(sys.argv[1]), [int(p) for p in sys.argv[2:]])

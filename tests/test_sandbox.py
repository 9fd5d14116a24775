"""The hostile-code suite, run against every isolating backend (bwrap, per episode and per call, and
docker on a real engine).

Each attack is contained, the result says what happened, and the same sandbox serves the next call.
Nothing here sends a packet off this machine: "outside" is checked as the absence of any interface
or route but loopback inside the sandbox.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from envs.sandbox import Limits, SandboxResult, backend_status, open_sandbox

LIMITS = Limits(
    timeout_s=6, cpu_s=2, memory_mb=256, processes=32, output_bytes=4096, file_mb=4, disk_mb=8
)


@pytest.fixture(params=["bwrap", "bwrap-per-call", "docker", "gvisor"])
def sandbox(request, tmp_path):
    backend, options = request.param, {}
    if backend == "bwrap-per-call":  # a fresh bwrap for every call instead of one per episode
        backend, options = "bwrap", {"per_episode": False}
    if backend == "docker":
        options["docker_host"] = request.getfixturevalue("docker_host")
    elif backend == "gvisor":  # the docker backend on gVisor's runsc runtime
        backend, options = (
            "docker",
            {"docker_host": request.getfixturevalue("gvisor_host"), "runtime": "runsc"},
        )
    elif backend_status("bwrap"):
        pytest.fail(f"bwrap must work here: {backend_status('bwrap')}")
    sb = open_sandbox(backend, limits=LIMITS, **options)
    yield sb
    # The sandbox still serves a call after the attack, and no process of its user is left.
    after = sb.run("echo still-serving")
    assert after.exit_code == 0 and after.stdout == "still-serving\n", after
    if sb.uid is not None and sb.uid != os.getuid():
        time.sleep(0.2)
        assert _pids_of(sb.uid) == [], "processes of the sandbox user outlived the call"
    sb.close()
    assert not sb.path.exists()


def _pids_of(uid: int) -> list[int]:
    pids = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if entry.stat().st_uid == uid:
                    pids.append(int(entry.name))
            except OSError:
                pass
    return pids


def py(code: str) -> list[str]:
    return ["python3", "-c", code]


def test_ordinary_commands_work(sandbox):
    (sandbox.path / "data.txt").write_text("b\na\nc\n")
    r = sandbox.run(
        "sort data.txt | head -n 2 && echo made > out.txt && python -c 'import pytest; print(pytest.__name__)'"
    )
    assert r.exit_code == 0 and r.stdout == "a\nb\npytest\n" and r.resource is None, r
    # the workspace is shared with the host
    assert sandbox.workspace.read_text("out.txt") == "made\n"
    assert sandbox.run(["cat"], stdin="piped in").stdout == "piped in"
    assert sandbox.run("exit 3").exit_code == 3


def test_network_loopback_and_outside_unreachable(sandbox):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    accepted = []
    threading.Thread(target=lambda: accepted.append(server.accept()), daemon=True).start()
    try:
        code = (
            f"import socket; s = socket.socket(); s.settimeout(2); print(s.connect_ex(('127.0.0.1', {port})));"
            "print(sorted(n for _, n in socket.if_nameindex()));"
            "print(open('/proc/net/route').read().count(chr(10)))"
        )
        r = sandbox.run(py(code))
    finally:
        server.close()
    refused, interfaces, route_lines = r.stdout.split("\n")[:3]
    assert r.exit_code == 0, r
    assert int(refused) != 0 and not accepted  # the host's loopback server never saw a connection
    assert interfaces == "['lo']"  # no interface leads anywhere else
    assert route_lines == "1"  # the routing table's header, no route


def test_host_files_outside_workspace_unreadable(sandbox, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("host secret")
    r = sandbox.run(
        f"cat {secret}; cat /etc/shadow; ls /root/.ssh /home; cat /proc/1/environ | tr '\\0' ' '"
    )
    assert "host secret" not in r.stdout
    assert "root:" not in r.stdout
    # a link planted in the workspace does not lead the host's helpers out of it
    sandbox.run("ln -s /etc/shadow stolen.txt")
    with pytest.raises(ValueError, match="symbolic link"):
        sandbox.workspace.read_text("stolen.txt")
    with pytest.raises(ValueError, match="inside the workspace"):
        sandbox.workspace.read_text("../secret.txt")


def test_writes_outside_workspace_fail(sandbox):
    marker = f"lh-escape-{os.getpid()}"
    r = sandbox.run(
        f"echo x > /usr/{marker}; echo x > /etc/{marker}; echo x > /{marker}; touch /tmp/{marker} && echo tmp-ok"
    )
    assert "tmp-ok" in r.stdout  # a private /tmp is writable ...
    for d in ("/usr", "/etc", "/", "/tmp"):
        assert not Path(d, marker).exists()  # ... and nothing reached the host's


def test_fork_bomb_is_contained(sandbox):
    r = sandbox.run(py("import os\nwhile True:\n    os.fork()"))
    # on a loaded machine the wall clock may come first; the process limit is still what stopped the forks
    assert r.resource == "processes" or (
        r.timed_out and "processes limit reached too" in r.events
    ), r
    assert "processes limit reached" in r.observation()


def test_memory_bomb_is_contained(sandbox):
    r = sandbox.run(py("x = bytearray(1 << 30); print('allocated')"))
    assert r.resource == "memory" and "allocated" not in r.stdout, r


def test_infinite_loop_hits_cpu_limit_and_sleeper_hits_wall_time(sandbox):
    r = sandbox.run(py("while True: pass"))
    # gVisor (this release) does not enforce RLIMIT_CPU
    if getattr(sandbox, "runtime", None) == "runsc":
        assert r.resource == "wall_time" and r.killed, r
    else:
        assert r.resource == "cpu_time" and r.killed, r
    r = sandbox.run("sleep 600")
    assert r.timed_out and r.killed and r.resource == "wall_time", r
    assert "timed out" in r.observation()


def test_huge_output_is_truncated(sandbox):
    r = sandbox.run("yes lots-of-output")
    assert r.truncated and r.resource == "output" and len(r.stdout) <= LIMITS.output_bytes, r
    assert r.observation().endswith("(output truncated)")


def test_disk_fill_is_bounded(sandbox):
    r = sandbox.run("head -c 100000000 /dev/zero > big.bin")
    assert r.resource == "file_size", r
    assert (sandbox.path / "big.bin").stat().st_size <= LIMITS.file_mb << 20
    r = sandbox.run("for i in 1 2 3; do head -c 4000000 /dev/zero > part$i.bin; done")
    assert r.resource == "disk" and any("over the 8 MiB limit" in e for e in r.events), r
    sandbox.run("rm -f *.bin")


def test_kill_all_and_background_processes_stay_inside(sandbox):
    sentinel = subprocess.Popen(["sleep", "60"])
    try:
        r = sandbox.run("sleep 300 & kill -9 -1; echo after")
        assert sentinel.poll() is None  # the host's process survived
        # the call did not wait for the killed sleeper
        assert not r.timed_out and r.stdout == "after\n", r
    finally:
        sentinel.kill()
        sentinel.wait()


def test_nothing_of_a_call_outlives_it(sandbox):
    """A call starts from what a fresh sandbox gives but for the workspace: a process left in the
    background (even in a session of its own) is gone when the call returns, what it put in /tmp
    too, and no command can stop what runs the calls (the per-episode sandbox's helper)."""
    r = sandbox.run(
        "(sleep 1; echo late > late.txt) >/dev/null 2>&1 & setsid sh -c 'sleep 1; echo daemon > d.txt' "
        ">/dev/null 2>&1 & echo x > /tmp/kept; echo started"
    )
    assert r.stdout == "started\n" and r.duration_s < 1, r
    time.sleep(1.5)
    # the per-episode bwrap's helper, when there is one
    session = getattr(sandbox, "_session", None)
    r = sandbox.run("ls /tmp/kept 2>/dev/null; ls; echo done")
    assert r.stdout == "done\n", r  # /tmp's file gone, nothing written late
    assert not (sandbox.path / "late.txt").exists() and not (sandbox.path / "d.txt").exists()
    if session is not None:  # bwrap's init (1) and the helper (2) are out of a command's reach
        r = sandbox.run("kill -9 1 2 2>/dev/null; echo done")
        assert r.stdout == "done\n" and sandbox.run("true").exit_code == 0, r
        assert sandbox._session is session and session.alive()  # the same helper serves on


def test_proc_shows_only_the_sandbox(sandbox):
    sentinel = subprocess.Popen(["sleep", "60"])
    try:
        r = sandbox.run(
            f"ls /proc | grep -E '^[0-9]+$' | wc -l; cat /proc/{sentinel.pid}/cmdline || echo hidden"
        )
        count, last = r.stdout.split("\n")[:2]
        assert int(count) < 10, r  # a handful of the sandbox's own processes, not the host's
        assert last == "hidden" and "sleep" not in r.stdout
    finally:
        sentinel.kill()
        sentinel.wait()


def test_limits_and_backends_reject_bad_values():
    with pytest.raises(ValueError, match="timeout_s must be a positive number"):
        Limits(timeout_s=0)
    with pytest.raises(ValueError, match="unknown sandbox backend 'vm'"):
        open_sandbox("vm")
    # an engine that is not there is named, on any host (one with a Docker socket too)
    from envs.sandbox.docker_engine import unavailable_reason

    assert "no Docker engine reachable" in unavailable_reason("unix:///nonexistent/docker.sock")


def test_none_backend_limits_time_and_output_but_is_not_isolated(tmp_path):
    # Only benign commands here: the none backend runs them on the host as this user.
    with open_sandbox("none", workspace=tmp_path / "ws", limits=LIMITS) as sb:
        r = sb.run("echo $HOME; pwd")
        assert r.stdout.split() == [str(sb.path)] * 2
        assert sb.run("sleep 30").resource == "wall_time"
        assert sb.run([sys.executable, "-c", "print('x' * 100000)"]).truncated
        marker = tmp_path / "outside.txt"
        sb.run(f"echo reached > {marker}")
        assert marker.read_text() == "reached\n"  # documented: no isolation at all
    assert (tmp_path / "ws").exists()  # a workspace the caller gave is left in place


def test_result_observation_names_the_limit():
    r = SandboxResult(exit_code=1, stderr="MemoryError", resource="memory", backend="bwrap")
    assert r.observation().startswith("exit code 1; stopped: memory limit reached")


def test_a_sandbox_answers_when_the_worker_holds_more_than_1024_descriptors():
    """A rollout worker playing a 200-episode evaluation holds hundreds of sandboxes' pipes, so a new
    sandbox's descriptors lie past select()'s FD_SETSIZE (1024). Its calls must still be answered
    (they were refused with "filedescriptor out of range in select()", which the environment
    counted as the policy's tool error), and a plumbing failure is the sandbox's, not the policy's."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 2048:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(4096, hard), hard))
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        with open_sandbox("bwrap", limits=LIMITS) as sb:
            r = sb.run("echo past-1024")
            assert r.exit_code == 0 and r.stdout == "past-1024\n", r
            session = sb._session  # the per-episode helper (as root): its pipe is where it bit
            if session is not None:
                assert session.proc.stdout.fileno() > 1024
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

"""The `docker` backend: one fresh container per call, through the `docker` SDK.

The engine is found through `docker_host` (or `DOCKER_HOST`, or the default socket). The image is
local: `longhorizon/sandbox:0`, made on first use by `docker import` of a skeleton root filesystem
(nothing is pulled), into which the host's `/usr` (with the `/bin`, `/lib*` links), the Python
installations the tools need (`extra_ro`) and `/etc/alternatives` are bound read-only. The
workspace is bound read-write at `/workspace`; `/tmp` is a size-limited tmpfs.

Each container runs with: no network (`network_mode=none`), a read-only root, all capabilities
dropped and `no-new-privileges`, a sandbox uid (not root), the memory limit as the container's
memory and swap, a pids limit, one CPU's quota, RLIMIT_CPU and RLIMIT_FSIZE, and is force-removed
at the end of the call, taking every process in it along. Pass `runtime="runsc"` to run under
gVisor (an engine configured with that runtime), which also puts a user-space kernel between the
code and the host's.

Under `runsc` (tested with Debian's gVisor release): the guest's processes are limited by
RLIMIT_NPROC, since the pids cgroup also counts gVisor's own threads; RLIMIT_CPU is not enforced,
so a busy loop ends at the wall clock (with one CPU's quota); each call costs ~1 s.

Does NOT protect against: kernel exploits under the default `runc` runtime (use `runsc`); anyone
who can reach the engine's socket (that is root on the host); filling the workspace faster than the
check after the call (bounded by file size × wall time). About 0.3–0.5 s a call: for tools called
thousands of times per iteration, `bwrap` is the cheaper backend.
"""

from __future__ import annotations

import io
import os
import shutil
import tarfile
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from envs.sandbox.base import (
    HostView,
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

IMAGE = "longhorizon/sandbox:0"


def _client(docker_host: str | None = None):
    import docker

    try:
        client = docker.DockerClient(base_url=docker_host) if docker_host else docker.from_env()
        client.ping()
        return client
    except Exception as exc:  # DockerException, connection refused, missing socket
        raise SandboxError(
            f"no Docker engine reachable at {docker_host or os.environ.get('DOCKER_HOST') or 'the default socket'}: {exc}"
        ) from None


def unavailable_reason(docker_host: str | None = None) -> str | None:
    try:
        _client(docker_host).close()
    except SandboxError as exc:
        return str(exc)
    return None


def _skeleton_tar(host: HostView) -> bytes:
    """A root filesystem of empty mount points and the host's /bin, /lib* links."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:

        def add_dir(name, mode=0o755):
            info = tarfile.TarInfo(name)
            info.type, info.mode = tarfile.DIRTYPE, mode
            tar.addfile(info)

        for d in ("usr", "etc", "proc", "dev", "sys", "workspace", "root", "home"):
            add_dir(d)
        add_dir("tmp", 0o1777)
        for top, target in host.links.items():
            info = tarfile.TarInfo(top)
            info.type, info.linkname = tarfile.SYMTYPE, target
            tar.addfile(info)
        for d in host.dirs:
            if d != "/usr":
                add_dir(d.lstrip("/"))
        passwd = b"root:x:0:0::/root:/bin/sh\nsandbox:x:1000:1000::/workspace:/bin/sh\n"
        info = tarfile.TarInfo("etc/passwd")
        info.size = len(passwd)
        tar.addfile(info, io.BytesIO(passwd))
    return buf.getvalue()


def ensure_image(client, host: HostView) -> str:
    import docker

    try:
        client.images.get(IMAGE)
    except docker.errors.ImageNotFound:
        repo, tag = IMAGE.split(":")
        client.api.import_image_from_data(_skeleton_tar(host), repository=repo, tag=tag)
    return IMAGE


class DockerSandbox(SandboxBase):
    backend = "docker"

    def __init__(
        self,
        workspace=None,
        limits: Limits | None = None,
        *,
        docker_host: str | None = None,
        runtime: str | None = None,
        extra_ro: list[str] | None = None,
        env: dict | None = None,
    ):
        self.client = _client(docker_host)
        self.host = host_view(extra_ro)
        self.image = ensure_image(self.client, self.host)
        self.limits = limits or Limits()
        self.runtime = runtime
        as_root = os.geteuid() == 0
        self.uid = sandbox_uid() if as_root else os.getuid()
        self.workspace = Workspace(workspace, owner=self.uid if as_root else None)
        self.env = sandbox_env(env)

    def _volumes(self, io_dir: str) -> dict:
        vols = {
            p: {"bind": p, "mode": "ro"}
            for p in self.host.dirs + self.host.etc_files + self.host.extra
        }
        vols[str(self.path)] = {"bind": "/workspace", "mode": "rw"}
        vols[io_dir] = {"bind": "/.io", "mode": "rw"}
        return vols

    def run(
        self, argv: list[str] | str, *, stdin: str | None = None, limits: Limits | None = None
    ) -> SandboxResult:
        import docker
        import requests

        limits = limits or self.limits
        if isinstance(argv, str):
            argv = ["/bin/sh", "-c", argv]
        # Output goes to files in a per-call directory (RLIMIT_FSIZE bounds them) rather than through
        # the engine: streaming a flood through dockerd stalled it for minutes here. The command must
        # not be PID 1, which ignores signals it has no handler for (SIGXCPU, SIGXFSZ): a shell stays
        # PID 1 and passes the command's status on.
        io_dir = Path(tempfile.mkdtemp(prefix="lh-io-"))
        (io_dir / "in").write_text(stdin or "")
        for name in ("in", "out", "err"):
            (io_dir / name).touch()
            if os.geteuid() == 0:
                os.chown(io_dir / name, self.uid, self.uid)
        os.chmod(io_dir, 0o755)
        argv = ["/bin/sh", "-c", '"$@" < /.io/in > /.io/out 2> /.io/err; exit $?', "sh", *argv]
        # Under gVisor the pids cgroup also counts the sandbox kernel's own threads (a limit of 32
        # keeps it from starting): the guest's processes are then limited by RLIMIT_NPROC alone.
        pids_limit = limits.processes if self.runtime != "runsc" else limits.processes + 512
        self.workspace.chown()
        t0, started = time.monotonic(), time.time()
        container = None
        timed_out = False
        try:
            container = self.client.containers.create(
                self.image,
                argv,
                detach=True,
                user=f"{self.uid}:{self.uid}",
                working_dir="/workspace",
                environment=self.env,
                volumes=self._volumes(str(io_dir)),
                network_mode="none",
                read_only=True,
                tmpfs={"/tmp": f"size={limits.disk_mb}m,mode=1777"},
                mem_limit=f"{limits.memory_mb}m",
                memswap_limit=f"{limits.memory_mb}m",
                pids_limit=pids_limit,
                nano_cpus=10**9,
                ulimits=[
                    docker.types.Ulimit(
                        name="cpu", soft=int(limits.cpu_s), hard=int(limits.cpu_s) + 1
                    ),
                    docker.types.Ulimit(
                        name="fsize", soft=limits.file_mb << 20, hard=limits.file_mb << 20
                    ),
                    docker.types.Ulimit(name="core", soft=0, hard=0),
                    docker.types.Ulimit(name="nproc", soft=limits.processes, hard=limits.processes),
                ],
                cap_drop=["ALL"],
                security_opt=["no-new-privileges"],
                runtime=self.runtime,
                log_config=docker.types.LogConfig(type="none"),
            )
            container.start()
            try:
                code = container.wait(timeout=limits.timeout_s)["StatusCode"]
            except (requests.exceptions.ReadTimeout, requests.exceptions.ConnectionError):
                timed_out = True
                container.kill()
                code = container.wait(timeout=30)["StatusCode"]
            container.reload()
            oom = bool(container.attrs.get("State", {}).get("OOMKilled"))
        except docker.errors.APIError as exc:
            raise SandboxError(f"docker sandbox failed: {exc}") from None
        finally:
            if container is not None:
                try:
                    container.remove(force=True)
                except docker.errors.APIError:
                    pass
        keep = limits.output_bytes
        sizes = [os.path.getsize(io_dir / "out"), os.path.getsize(io_dir / "err")]
        texts = []
        for name in ("out", "err"):
            with open(io_dir / name, "rb") as fh:
                texts.append(fh.read(keep).decode("utf-8", "replace"))
        shutil.rmtree(io_dir, ignore_errors=True)
        flooded = max(sizes) > 16 * keep
        result = SandboxResult(
            exit_code=code,
            stdout=texts[0],
            stderr=texts[1],
            truncated=max(sizes) > keep,
            timed_out=timed_out,
            killed=timed_out,
            duration_s=time.monotonic() - t0,
            backend=self.backend,
        )
        if timed_out:
            result.resource = "wall_time"
            result.events.append(f"killed at the wall-time limit ({limits.timeout_s:g}s)")
        elif flooded:
            result.resource = "output"
            result.events.append(
                f"output flood: {max(sizes)} bytes written, stopped by the file-size limit"
            )
        classify(result, oom=oom)
        return self._check_disk(result, limits, started)

    def close(self) -> None:
        super().close()
        self.client.close()


def dockerd_binary() -> str | None:
    return shutil.which("dockerd") or next(
        (p for p in ("/usr/sbin/dockerd", "/usr/bin/dockerd") if os.path.exists(p)), None
    )


def private_dockerd_unavailable() -> str | None:
    """Why `private_dockerd` cannot start an engine here, or None."""
    if os.geteuid() != 0:
        return "no Docker engine reachable, and starting one needs root"
    if dockerd_binary() is None:
        return "no Docker engine reachable, and no dockerd to start (apt-get install docker.io)"
    return None


@contextmanager
def private_dockerd(root: str | Path | None = None, timeout_s: float = 60.0) -> Iterator[str]:
    """A Docker engine of our own for tests and benchmarks on machines where none runs: Debian's
    `dockerd` on a private socket under `root`, with no bridge and no iptables changes, gVisor's
    `runsc` added as a runtime when installed; yields its DOCKER_HOST and stops it by PID (mounts it
    left behind are detached, its directory removed). Needs root (`private_dockerd_unavailable`)."""
    import json
    import signal
    import subprocess

    reason = private_dockerd_unavailable()
    if reason:
        raise RuntimeError(reason)
    # short: unix socket paths are limited to 108 bytes
    d = Path(root or f"/tmp/lh-dockerd-{os.getpid()}")
    d.mkdir(parents=True, exist_ok=True)
    sock = f"unix://{d}/docker.sock"
    runsc = shutil.which("runsc") or (
        "/usr/bin/runsc" if os.path.exists("/usr/bin/runsc") else None
    )
    runtimes = (
        {"runtimes": {"runsc": {"path": runsc, "runtimeArgs": ["--network=none"]}}} if runsc else {}
    )
    (d / "daemon.json").write_text(json.dumps(runtimes))
    log = open(d / "dockerd.log", "w")
    proc = subprocess.Popen(
        [
            dockerd_binary(),
            f"--config-file={d}/daemon.json",
            f"--host={sock}",
            f"--data-root={d}/data",
            f"--exec-root={d}/exec",
            f"--pidfile={d}/dockerd.pid",
            "--bridge=none",
            "--iptables=false",
            "--ip6tables=false",
            "--ip-masq=false",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + timeout_s
        while unavailable_reason(sock) is not None:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"dockerd did not start; its log: {(d / 'dockerd.log').read_text()[-2000:]}"
                )
            time.sleep(0.3)
        yield sock
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        # a dockerd stopped with containers still mounted leaves mounts under its root: detach them first
        with open("/proc/mounts") as fh:
            stale = sorted(
                {line.split()[1] for line in fh if line.split()[1].startswith(str(d))}, reverse=True
            )
        for mount in stale:
            subprocess.run(["umount", "-l", mount], capture_output=True)
        shutil.rmtree(d, ignore_errors=True)

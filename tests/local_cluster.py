"""A real multi-node Ray cluster on this machine's loopback, for the tests that need nodes to die.

`ray start` makes the head and each worker node (separate raylets, object stores and temp dirs,
as on separate machines); `kill_node` kills one node's whole process tree by PID the way a lost
machine would vanish, and `stop` removes everything it started by PID, never with `ray stop`
(which would kill every Ray on the machine, the test session's own included).

Loopback only. Ray refuses to add a worker node while `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0` (the
setting that keeps a local Ray on 127.0.0.1), and with it on rewrites 127.0.0.1 to the machine's
address and listens on every interface. Worker nodes are therefore started through a small shim
(`_RAY_START`) that lets `ray start` join while leaving 127.0.0.1 as it is; the processes it
starts inherit the variable at 0 and bind to loopback, like the head's.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil

_RAY_START = """
import sys
from ray._private import ray_constants, services
ray_constants.ENABLE_RAY_CLUSTER = True             # allow `ray start --address` ...
services.resolve_ip_for_localhost = lambda host: host  # ... without rewriting 127.0.0.1
from ray.scripts.scripts import main
sys.argv = ["ray", *sys.argv[1:]]
main()
"""

# Ray notices a dead node after ~15 s by default; these make it ~2 s (read by the GCS at start).
FAST_HEALTH_CHECKS = {
    "RAY_health_check_period_ms": "500",
    "RAY_health_check_timeout_ms": "1000",
    "RAY_health_check_failure_threshold": "3",
    "RAY_health_check_initial_delay_ms": "0",
}


SMALL_JOB = [
    "iterations=1",
    "rollout.num_workers=1",
    "rollout.groups_per_iteration=2",
    "rollout.group_size=2",
    "rollout.max_new_tokens=16",
    "rollout.cpus_per_worker=0.5",
]
"""Overrides that make configs/quickstart.yaml a one-iteration job small enough for a test cluster
(tests/test_jobs.py, tests/test_cluster.py)."""


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def pids_with(marker: str) -> list[int]:
    """PIDs of the processes whose command line contains `marker` (not this one)."""
    pids = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if marker in Path(entry.path, "cmdline").read_bytes().decode(errors="replace"):
                    pids.append(int(entry.name))
            except OSError:
                pass
    return pids


def _kill(procs: list[psutil.Process]) -> None:
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=10)


class LocalCluster:
    """Head (`head_resources`, `head_cpus`) plus one worker node per entry of `nodes` (its custom
    resources; each also gets `node<k>: 1`), all on 127.0.0.1."""

    def __init__(
        self,
        nodes: list[dict],
        *,
        head_resources: dict,
        head_cpus: int = 1,
        node_cpus: int = 2,
        object_store_mb: int = 200,
    ):
        self.temp = f"/tmp/lhc-{os.getpid()}-{int(time.time()) % 100000}"  # short: unix sockets live under it
        self.env = {
            **os.environ,
            "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
            "RAY_AUTH_MODE": "disabled",
            "RAY_USAGE_STATS_ENABLED": "0",
            **FAST_HEALTH_CHECKS,
        }
        self.node_ports: list[int] = []  # each worker node's node-manager port: finds its raylet
        self.raylets: list[psutil.Process] = []
        self.started: list[psutil.Process] = []
        store = str(object_store_mb << 20)
        try:
            gcs, nm, *rest = free_ports(7)
            self._start(
                [
                    str(Path(sys.executable).parent / "ray"),
                    "start",
                    "--head",
                    f"--port={gcs}",
                    f"--node-manager-port={nm}",
                    "--include-dashboard=false",
                    *self._ports(rest),
                    f"--num-cpus={head_cpus}",
                    f"--resources={json.dumps(head_resources)}",
                    f"--temp-dir={self.temp}",
                    f"--object-store-memory={store}",
                ],
                nm,
            )
            self.head_port = nm
            self.address = f"127.0.0.1:{gcs}"
            for k, resources in enumerate(nodes):
                nm, om, *rest = free_ports(7)
                self._start(
                    [
                        sys.executable,
                        "-c",
                        _RAY_START,
                        "start",
                        f"--address={self.address}",
                        f"--node-manager-port={nm}",
                        f"--object-manager-port={om}",
                        *self._ports(rest[:4]),
                        f"--num-cpus={node_cpus}",
                        f"--resources={json.dumps({**resources, f'node{k}': 1})}",
                        f"--temp-dir={self.temp}-n{k}",
                        f"--object-store-memory={store}",
                    ],
                    nm,
                )
                self.node_ports.append(nm)
        except BaseException:
            self.stop()
            raise

    @staticmethod
    def _ports(ports: list[int]) -> list[str]:
        flags = [
            "--dashboard-agent-listen-port",
            "--dashboard-agent-grpc-port",
            "--metrics-export-port",
            "--runtime-env-agent-port",
            "--ray-client-server-port",
        ]
        return [f"{f}={p}" for f, p in zip(flags, ports)] + [
            "--node-ip-address=127.0.0.1",
            "--disable-usage-stats",
        ]

    def _start(self, cmd: list[str], node_port: int) -> None:
        r = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=120)
        if r.returncode != 0:
            raise RuntimeError(
                f"{' '.join(cmd[:3])} failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}"
            )
        self.raylets.append(self.raylet(node_port))

    @staticmethod
    def raylet(node_port: int) -> psutil.Process:
        for p in psutil.process_iter(["cmdline"]):
            if f"--node_manager_port={node_port}" in (p.info["cmdline"] or []):
                return p
        raise LookupError(f"no raylet with node manager port {node_port}")

    def actor_pids(self, class_name: str, node: int | None = None) -> list[int]:
        """PIDs of the actor processes of `class_name` (on worker node `node`, or the head when -1;
        anywhere in this cluster when None)."""
        raylets = self.raylets if node is None else [self.raylets[0 if node == -1 else node + 1]]
        out = []
        for raylet in raylets:
            try:
                children = raylet.children(recursive=True)
            except psutil.NoSuchProcess:
                continue
            for p in children:
                try:
                    if p.cmdline() and p.cmdline()[0].startswith(f"ray::{class_name}"):
                        out.append(p.pid)
                except psutil.NoSuchProcess:
                    pass
        return out

    def node_of(self, pid: int) -> int:
        """Which worker node (index) runs the process `pid`; -1 for the head."""
        for k, raylet in enumerate(self.raylets):
            try:
                if pid in {p.pid for p in raylet.children(recursive=True)}:
                    return k - 1
            except psutil.NoSuchProcess:
                continue
        raise LookupError(f"process {pid} is on no node of this cluster")

    def kill_node(self, k: int) -> None:
        """Worker node `k` vanishes: its raylet and every process under it, at once (SIGKILL)."""
        raylet = self.raylets[k + 1]
        _kill(
            [raylet, *raylet.children(recursive=True)]
            + [psutil.Process(p) for p in pids_with(f"{self.temp}-n{k}/")]
        )

    def stop(self) -> None:
        procs = []
        for raylet in self.raylets:
            try:
                procs += [raylet, *raylet.children(recursive=True)]
            except psutil.NoSuchProcess:
                pass
        for pid in pids_with(self.temp):
            try:
                procs.append(psutil.Process(pid))
            except psutil.NoSuchProcess:
                pass
        _kill(procs)
        for d in Path(self.temp).parent.glob(Path(self.temp).name + "*"):
            shutil.rmtree(d, ignore_errors=True)

    def leftovers(self) -> list[int]:
        return pids_with(self.temp)


def kill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)

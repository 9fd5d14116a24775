"""Starting or joining Ray, and waiting on a learner group's answer (`result`).

Ray rewrites 127.0.0.1 to the machine's own address and listens on every interface unless told
otherwise. A local Ray here binds to loopback only: `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0` plus an
explicit node address of 127.0.0.1 (see the machine notes), and it goes with the driver that
started it, even one killed with SIGKILL (rl/ray_reaper.py). A real cluster is joined with
`ray.address`; its security (token auth, firewalling) is the cluster operator's.
"""

from __future__ import annotations

import logging
import os

import ray

from rl.config import RayConfig


def init_ray(cfg: RayConfig) -> bool:
    """Start a local Ray (or join `cfg.address`); returns True if this call started it."""
    if ray.is_initialized():
        return False
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # Ray reads this variable once, when `ray` is first imported, which has usually happened by
    # now: set it for the processes Ray starts, and set the constant it was read into for this one
    # (else 127.0.0.1 is rewritten to the machine's address and servers listen beyond loopback).
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    from ray._private import ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = False
    if cfg.address:
        ray.init(address=cfg.address, log_to_driver=cfg.log_to_driver)
    else:
        # Ray 2.60 turns token authentication on for a new local cluster and says so at every start;
        # the run keeps that default (docs/scaling.md) without printing it each time
        logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(
            logging.ERROR
        )
        ray.init(
            num_cpus=cfg.num_cpus,
            include_dashboard=False,
            object_store_memory=cfg.object_store_mb << 20,
            _node_ip_address="127.0.0.1",
            log_to_driver=cfg.log_to_driver,
            resources=dict(cfg.local_resources) or None,
        )
        from rl.ray_reaper import watch

        node = ray._private.worker._global_node  # the processes this ray.init started
        watch(
            [
                p.process.pid
                for procs in node.all_processes.values()
                for p in procs
                if p.process is not None
            ]
        )
    return True


def result(refs):
    """The answer of a learner call: rank 0's, once every rank has finished. The first rank to
    fail raises at once (the others may be waiting for it in a collective). Takes one ref too."""
    if not isinstance(refs, list):
        return ray.get(refs)
    pending, out = list(refs), {}
    while pending:
        ready, pending = ray.wait(pending, num_returns=1)
        out[ready[0]] = ray.get(ready[0])  # raises the rank's error
    return out[refs[0]]

"""The learner process's memory allocator: tcmalloc where it is installed, glibc's malloc otherwise.

Why: a CPU learner step allocates and frees activations, expert buffers and logits chunks of tens
to hundreds of MiB, hundreds of times a step. Under glibc's malloc the same step of the real policy
(SmolLM2-135M upcycled to 4 experts, 24 calculator episodes) took 24 s, then 35 and 38 s in the
following steps (fp32; bf16: 21, 37, 30 s); under tcmalloc it took 23, 21.5, 21 s (bf16: 16, 17,
16 s), every step alike. (jemalloc: 27-28 s.) vLLM's CPU engines preallocate and gained nothing.

How: an allocator replaces malloc only if it is loaded before the process starts, so the learner's
Ray actors are started with `LD_PRELOAD` naming the library (Ray's `runtime_env` env_vars start a
worker process of their own for them). The name is a soname, not a path: each node's dynamic
loader finds its own copy, and a node without one prints a line and runs with glibc's malloc,
which `in_use()` then reports. Debian/Ubuntu: `apt-get install libtcmalloc-minimal4` (`make install`
does it where it can).

Not covered: in-process learners (tests, notebooks) keep whatever allocator their process started
with; the rollout workers and environments keep the default.
"""

from __future__ import annotations

import ctypes.util
import os
from pathlib import Path

TCMALLOC = "libtcmalloc_minimal.so.4"


def tcmalloc_installed() -> bool:
    """Whether this machine's dynamic loader can find tcmalloc."""
    return ctypes.util.find_library("tcmalloc_minimal") is not None


def actor_env(choice: str) -> dict:
    """The environment variables that give a learner actor the `learner.allocator` asked for: auto
    takes tcmalloc when this machine has it (the driver's view; a node without it falls back, see
    above), system takes nothing. An `LD_PRELOAD` already set is kept after ours."""
    if choice == "system" or (choice == "auto" and not tcmalloc_installed()):
        return {}
    rest = os.environ.get("LD_PRELOAD", "")
    return {"LD_PRELOAD": f"{TCMALLOC} {rest}".strip()}


def in_use() -> str:
    """The malloc this process runs with: tcmalloc, jemalloc (both only when loaded first), or glibc."""
    maps = Path("/proc/self/maps")
    text = maps.read_text() if maps.exists() else ""
    for name in ("tcmalloc", "jemalloc"):
        if f"lib{name}" in text:
            return name
    return "glibc"

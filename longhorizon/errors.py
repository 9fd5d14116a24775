"""How the command-line tools word an error the user can fix: one line, no traceback; and the
checks that find one before anything starts."""

from __future__ import annotations

import sys
from pathlib import Path

from longhorizon.terminal import visible


def message(exc: Exception) -> str:
    """One line for `exc`: an OS error names its file (its args[0] is the bare errno, and
    str(OSError) starts "[Errno 2]"), a KeyError its message without repr quotes. Control characters
    (a message may quote model text or a file name) are made visible (longhorizon/terminal.py)."""
    if isinstance(exc, OSError) and exc.strerror:
        return visible(f"{exc.filename}: {exc.strerror}" if exc.filename else exc.strerror)
    return visible(exc.args[0] if exc.args else exc)


def unwritable(directory: Path) -> str | None:
    """Why `directory` (made if missing) cannot hold a run's files, or None: found before anything
    starts, not as a PermissionError traceback from the first file a run writes."""
    import tempfile

    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".write-check-"):
            pass
    except OSError as exc:
        return f"{directory} cannot be written ({exc.strerror or type(exc).__name__})"
    return None


def report_skipped(store) -> None:
    """A warning line naming the trajectory shards `--skip-corrupt` left out."""
    if store.corrupt:  # --skip-corrupt: say what was left out
        print(
            visible(
                f"warning: skipped {len(store.corrupt)} corrupt trajectory shard(s): "
                f"{', '.join(Path(s).name for s in store.corrupt)}"
            ),
            file=sys.stderr,
        )

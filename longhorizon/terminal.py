"""What the command-line tools print of run data: control characters shown, never obeyed.

Model output, tool output, task texts, file names and error messages can hold terminal escape
sequences (`\\x1b[2J` clears the screen, `\\x1b[1A\\x1b[2K` rewrites the line above, OSC sequences
retitle the terminal or plant hyperlinks), carriage returns that overwrite a line, or bidirectional
overrides that reorder what is read. `visible(text)` writes each such character as a `\\xNN` (or
`\\uNNNN`) escape instead; `SafeConsole` is a rich Console that does it to every piece of text it
prints, whatever renderable carries it (panels, tables, logs), while its own styling still colours.
"""

from __future__ import annotations

import re

from rich.console import Console
from rich.segment import Segment

# C0 controls but tab and newline, DEL, C1 controls; bidirectional embeddings, overrides and isolates
_HIDDEN = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def _escape(m: re.Match) -> str:
    c = ord(m.group())
    return f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}"


def visible(text) -> str:
    """`text` with every control character written as a visible escape."""
    return _HIDDEN.sub(_escape, str(text))


class SafeConsole(Console):
    """A rich Console whose printed text never carries a control character of the data's own (its
    control segments, the cursor moves rich makes itself, are kept)."""

    def _render_buffer(self, buffer) -> str:
        return super()._render_buffer(
            Segment(visible(text) if not control else text, style, control)
            for text, style, control in buffer
        )

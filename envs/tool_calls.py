"""The tool-call format: OpenAI-style `{"name": ..., "arguments": {...}}` inside `<tool_call>` tags
(the Hermes/Qwen convention), parsed tolerantly.

Tolerant means: a missing closing tag at the end of the turn, code fences, single-quoted
Python-style dicts and `arguments` given as a JSON string are all accepted. Anything else becomes a
`ToolCallError` with a message the model can read; parsing never raises.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass, field

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|$)", re.DOTALL)


@dataclass
class ToolCall:
    name: str
    arguments: dict = field(default_factory=dict)


@dataclass
class ToolCallError:
    raw: str
    message: str


def _load_obj(text: str):
    text = text.strip()
    if text.startswith("```"):
        text = text.strip("`")
        text = text[text.find("\n") + 1 :] if "\n" in text else text
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        pass
    try:  # single quotes, True/False/None: a Python literal is still an unambiguous call
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, RecursionError, MemoryError, TypeError):
        return None


def format_tool_call(name: str, **arguments) -> str:
    """One tool call as a model writes it (scripted experts, demonstrations, tests)."""
    return OPEN + "\n" + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False) + "\n" + CLOSE


def parse_tool_calls(text: str) -> tuple[list[ToolCall], list[ToolCallError]]:
    """Every `<tool_call>` block in `text`, in order, as calls or as errors."""
    calls: list[ToolCall] = []
    errors: list[ToolCallError] = []
    for match in _BLOCK.finditer(text):
        raw = match.group(1)
        obj = _load_obj(raw)
        if not isinstance(obj, dict):
            errors.append(ToolCallError(raw, "tool call is not a JSON object"))
            continue
        name = obj.get("name")
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            args = _load_obj(args) if args.strip() else {}
        if not isinstance(name, str) or not name:
            errors.append(ToolCallError(raw, 'tool call has no "name" string'))
        elif not isinstance(args, dict):
            errors.append(ToolCallError(raw, f'"arguments" of {name!r} is not an object'))
        else:
            calls.append(ToolCall(name, args))
    return calls, errors

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
    return (
        OPEN
        + "\n"
        + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
        + "\n"
        + CLOSE
    )


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


_TYPES = {
    "string": "string",
    "integer": "integer",
    "number": "number",
    "boolean": "true or false",
    "array": "list",
    "object": "object",
    "null": "null",
}


def _is(value, kind: str) -> bool:
    """Whether `value` is of JSON schema type `kind`, numbers leniently: a model often writes 57 as
    "57", and an integral 3.0 is the integer 3 (pydantic's lax mode does the same)."""
    if kind == "string":
        return isinstance(value, str)
    if kind in ("integer", "number"):
        if isinstance(value, str):
            try:
                value = float(value.strip())
            except ValueError:
                return False
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value == value
        return ok and (kind == "number" or float(value).is_integer())
    return {
        "boolean": lambda v: isinstance(v, bool),
        "array": lambda v: isinstance(v, list),
        "object": lambda v: isinstance(v, dict),
        "null": lambda v: v is None,
    }.get(kind, lambda v: True)(value)


def signature(name: str, parameters: dict) -> str:
    """A tool's arguments as a model reads them: `bash(command: string)`, optional ones marked `?`."""
    props, required = parameters.get("properties") or {}, set(parameters.get("required") or [])
    args = []
    for arg, spec in props.items():
        kind = spec.get("type", "any") if isinstance(spec, dict) else "any"
        kind = (
            " or ".join(_TYPES.get(k, str(k)) for k in kind)
            if isinstance(kind, list)
            else _TYPES.get(kind, str(kind))
        )
        if isinstance(spec, dict) and spec.get("enum"):
            kind = " | ".join(json.dumps(v) for v in spec["enum"])
        args.append(f"{arg}{'' if arg in required else '?'}: {kind}")
    return f"{name}({', '.join(args)})"


def argument_problem(name: str, parameters: dict, arguments: dict) -> str | None:
    """What is wrong with a call's `arguments` against the tool's JSON schema `parameters` (missing,
    unknown or mistyped ones), said with what the tool takes; None when nothing is."""
    props, required = parameters.get("properties") or {}, parameters.get("required") or []
    problems = [f"missing {a}" for a in required if a not in arguments]
    if parameters.get("additionalProperties", False) is False:
        problems += [f"unknown argument {json.dumps(a)}" for a in arguments if a not in props]
    for arg, value in arguments.items():
        spec = props.get(arg)
        if not isinstance(spec, dict):
            continue
        kinds = spec.get("type")
        kinds = kinds if isinstance(kinds, list) else [kinds] if kinds else []
        if kinds and not any(_is(value, k) for k in kinds):
            problems.append(f"{arg} must be {' or '.join(_TYPES.get(k, str(k)) for k in kinds)}")
        elif spec.get("enum") and value not in spec["enum"]:
            problems.append(
                f"{arg} must be one of {', '.join(json.dumps(v) for v in spec['enum'])}"
            )
    if not problems:
        return None
    return f"{'; '.join(problems)}. Call it as {signature(name, parameters)}"

"""YAML into typed dataclasses: the one loader every package's config uses.

A config is a plain dataclass with a docstring under each field (`field_docs` reads them back for
`--help`-style listings). `build_dataclass` coerces a mapping into it — nested dataclasses,
`Literal` choices, ints where floats are wanted — and `load_dataclass` reads a YAML file first.
An unknown key (with the nearest known one suggested), a wrong type or a value outside a
`Literal` raises `ConfigError` naming the key and where it came from (a file, a command-line
override, a checkpoint's config.json). A numeric field declares its bounds beside it
(`bounded(default, ge=1)`; `bound_problems` checks a whole config against them); checks that tie
fields together stay with each dataclass (`require`).

This module imports nothing of the project's: rewards/, policy/, envs/, rollout/ and rl/ all use it.

YAML is read by `load_yaml` (also what other readers of user YAML use): plain `yaml.safe_load`
rules, but an alias (`*name`) is refused (a few lines of nested aliases expand to gigabytes: a
"billion laughs") and so is a key given twice in one mapping (YAML keeps the last silently); an
error quotes at most `QUOTE` characters of a bad value.

Why not pydantic or OmegaConf: the configs stay plain stdlib dataclasses (picklable into Ray
actors, `dataclasses.replace`-able, free of a base class), the coercion is this one page, and every
error is already the one line the command line prints (pydantic's `ValidationError` is a
multi-line report to reformat; OmegaConf's structured configs lose `Literal` checks).
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import typing
from functools import cache
from pathlib import Path
from typing import Any, Literal

import yaml


class ConfigError(ValueError):
    pass


QUOTE = 80
"""The most characters of a bad value an error line quotes."""


def short(value) -> str:
    """`repr(value)`, cut to `QUOTE` characters."""
    text = repr(value)
    return text if len(text) <= QUOTE else text[: QUOTE - 1] + "…"


class _Loader(yaml.SafeLoader):
    """safe_load's rules, without aliases and without a key given twice."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise ConfigError(
                f"line {event.start_mark.line + 1}: YAML aliases (*{event.anchor}) are not accepted "
                "in a config: write the value out"
            )
        return super().compose_node(parent, index)

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, (str, int, float, bool)) and key in seen:
                raise ConfigError(
                    f"line {key_node.start_mark.line + 1}: key {short(key)} is given twice"
                )
            seen.add(key) if isinstance(key, (str, int, float, bool)) else None
        return super().construct_mapping(node, deep=deep)


def load_yaml(text: str):
    """Parse YAML text as `yaml.safe_load` does, refusing aliases and repeated keys (`ConfigError`);
    a syntax error is `yaml.YAMLError`."""
    return yaml.load(text, Loader=_Loader)


@dataclasses.dataclass(frozen=True)
class Bounds:
    """A numeric field's allowed values: within every given bound, or exactly 0 where `zero_off`
    (0 switches the feature off). `note` says what a special value means, in the error line."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    zero_off: bool = False
    note: str = ""

    def holds(self, value) -> bool:
        if self.zero_off and value == 0:
            return True
        return (
            (self.ge is None or value >= self.ge)
            and (self.gt is None or value > self.gt)
            and (self.le is None or value <= self.le)
            and (self.lt is None or value < self.lt)
        )

    def text(self) -> str:
        """`>= 1`, `in (0, 1]`, `0 or > 1`: the rule, as the error line and the docs say it."""
        low = ("[", ">=", self.ge) if self.ge is not None else ("(", ">", self.gt)
        high = ("]", "<=", self.le) if self.le is not None else (")", "<", self.lt)
        if low[2] is not None and high[2] is not None:
            rule = f"in {low[0]}{low[2]:g}, {high[2]:g}{high[0]}"
        elif low[2] is not None:
            rule = f"{low[1]} {low[2]:g}"
        else:
            rule = f"{high[1]} {high[2]:g}"
        return f"0 or {rule}" if self.zero_off else rule

    def describe(self) -> str:
        """The rule with what its special value means (`0 or > 1 (0: off)`): the error line's and
        the config reference's wording."""
        note = self.note or ("0: off" if self.zero_off else "")
        return f"{self.text()} ({note})" if note else self.text()


def bounded(
    default,
    *,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    zero_off: bool = False,
    note: str = "",
):
    """A dataclass field with a default and its bounds, declared together:
    `lr: float = bounded(1e-3, gt=0)`. The docstring under it stays the field's documentation."""
    rule = Bounds(ge, gt, le, lt, zero_off, note)
    if not rule.holds(default):
        raise ValueError(f"default {default!r} is outside its own bounds ({rule.text()})")
    return dataclasses.field(default=default, metadata={"bounds": rule})


def bounds_of(f: dataclasses.Field) -> Bounds | None:
    return f.metadata.get("bounds")


def bound_problems(obj, prefix: str = "") -> list[tuple[str, bool, str]]:
    """(key, ok, why) for every bounded field of the dataclass `obj` and of the dataclasses nested
    in it, in declaration order: the checks `require` takes."""
    checks = []
    for f in dataclasses.fields(obj):
        value, key = getattr(obj, f.name), f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            checks += bound_problems(value, key + ".")
        elif (rule := bounds_of(f)) is not None:
            checks.append((key, rule.holds(value), f"must be {rule.describe()}"))
    return checks


def require(checks: list[tuple[str, bool, str]], source: str) -> None:
    """Raise `ConfigError` for the first (key, ok, why) whose check failed, naming key and source."""
    for key, ok, why in checks:
        if not ok:
            raise ConfigError(f"{source}: {key} {why}")


@cache
def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each dataclass field (attribute docstrings, read from the source)."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if isinstance(nxt, ast.Expr) and isinstance(getattr(nxt, "value", None), ast.Constant):
                docs[node.target.id] = str(nxt.value.value)
    return docs


def _type_name(tp) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp, key: str, source: str):
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{source}: {key} must be a mapping, got {type(value).__name__}")
        return build_dataclass(tp, value, key, source)
    if origin is Literal:
        if value not in typing.get_args(tp):
            allowed = ", ".join(repr(a) for a in typing.get_args(tp))
            raise ConfigError(f"{source}: {key} must be one of {allowed}, got {short(value)}")
        return value
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str):  # YAML 1.1 reads 3e-4 (no dot) as a string
        try:
            return float(value)
        except ValueError:
            pass
    base = origin or tp
    if base is dict and isinstance(value, dict):
        return dict(value)
    if base is list and isinstance(value, list):
        return list(value)
    if base in (int, float, str, bool) and type(value) is base:
        return value
    raise ConfigError(
        f"{source}: {key} must be {_type_name(tp)}, got {type(value).__name__} {short(value)}"
    )


def build_dataclass(cls, raw: dict, prefix: str, source: str):
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in raw.items():
        full = f"{prefix}.{key}" if prefix else str(key)
        if key not in names:
            moved = getattr(cls, "MOVED", {}).get(key)
            if moved:
                raise ConfigError(f"{source}: {short(full)} is now {moved}")
            near = difflib.get_close_matches(str(key), names, n=1)
            hint = f"; did you mean {near[0]!r}?" if near else f"; known keys: {', '.join(names)}"
            raise ConfigError(f"{source}: unknown key {short(full)}{hint}")
        kwargs[key] = _coerce(value, hints[key], full, source)
    return cls(**kwargs)


def _one_line(exc: Exception) -> str:
    """yaml's multi-line parser message, as one line (the command line prints one)."""
    return " ".join(str(exc).split())


def apply_override(raw: dict, override: str) -> None:
    key, eq, text = override.partition("=")
    if not eq or not key:
        raise ConfigError(
            f"command-line override {short(override)} must look like section.key=value"
        )
    node = raw
    parts = key.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(
                f"command-line override {short(override)}: {short(part)} is not a section"
            )
    try:
        node[parts[-1]] = load_yaml(text) if text.strip() else ""
    except ConfigError as exc:
        raise ConfigError(f"command-line override {short(override)}: {exc}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(
            f"command-line override {short(override)}: the value is not valid YAML "
            f"({_one_line(exc)})"
        ) from None


def load_dataclass(cls, path: str | Path):
    """Build any config dataclass from a YAML mapping, with the same checks and messages."""
    source = str(path)
    try:
        raw = load_yaml(Path(path).read_text()) or {}
    except FileNotFoundError:
        raise ConfigError(f"config file {source} does not exist") from None
    except IsADirectoryError:
        raise ConfigError(f"config file {source} is a directory, not a YAML file") from None
    except PermissionError:
        raise ConfigError(f"config file {source} cannot be read (permission denied)") from None
    except UnicodeDecodeError:
        raise ConfigError(
            f"config file {source} is not text (not UTF-8): is it the right file?"
        ) from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: not valid YAML ({_one_line(exc)})") from None
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: top level must be a mapping")
    return build_dataclass(cls, raw, "", source)

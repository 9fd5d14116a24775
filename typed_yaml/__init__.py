"""YAML into typed dataclasses: the one loader every package's config uses.

A config is a plain dataclass with a docstring under each field (`field_docs` reads them back for
`--help`-style listings). `build_dataclass` coerces a mapping into it — nested dataclasses,
`Literal` choices, ints where floats are wanted — and `load_dataclass` reads a YAML file first.
An unknown key (with the nearest known one suggested), a wrong type or a value outside a
`Literal` raises `ConfigError` naming the key and where it came from (a file, a command-line
override, a checkpoint's config.json). Range checks stay with each dataclass (`require`).

This module imports nothing of the project's: rewards/, policy/, envs/, rollout/ and rl/ all use it.

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
            raise ConfigError(f"{source}: {key} must be one of {allowed}, got {value!r}")
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
    raise ConfigError(f"{source}: {key} must be {_type_name(tp)}, got {type(value).__name__} {value!r}")


def build_dataclass(cls, raw: dict, prefix: str, source: str):
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in raw.items():
        full = f"{prefix}.{key}" if prefix else str(key)
        if key not in names:
            near = difflib.get_close_matches(str(key), names, n=1)
            hint = f"; did you mean {near[0]!r}?" if near else f"; known keys: {', '.join(names)}"
            raise ConfigError(f"{source}: unknown key {full!r}{hint}")
        kwargs[key] = _coerce(value, hints[key], full, source)
    return cls(**kwargs)


def _one_line(exc: Exception) -> str:
    """yaml's multi-line parser message, as one line (the command line prints one)."""
    return " ".join(str(exc).split())


def apply_override(raw: dict, override: str) -> None:
    key, eq, text = override.partition("=")
    if not eq or not key:
        raise ConfigError(f"command-line override {override!r} must look like section.key=value")
    node = raw
    parts = key.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"command-line override {override!r}: {part!r} is not a section")
    try:
        node[parts[-1]] = yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"command-line override {override!r}: the value is not valid YAML "
                          f"({_one_line(exc)})") from None


def load_dataclass(cls, path: str | Path):
    """Build any config dataclass from a YAML mapping, with the same checks and messages."""
    source = str(path)
    try:
        raw = yaml.safe_load(Path(path).read_text()) or {}
    except FileNotFoundError:
        raise ConfigError(f"config file {source} does not exist") from None
    except IsADirectoryError:
        raise ConfigError(f"config file {source} is a directory, not a YAML file") from None
    except PermissionError:
        raise ConfigError(f"config file {source} cannot be read (permission denied)") from None
    except UnicodeDecodeError:
        raise ConfigError(f"config file {source} is not text (not UTF-8): is it the right file?") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: not valid YAML ({_one_line(exc)})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: top level must be a mapping")
    return build_dataclass(cls, raw, "", source)

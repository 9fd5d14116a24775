"""What the docs site takes from the code at build time, so that it cannot drift from it:

- `configuration.md`'s `<!-- config-reference -->` marker becomes a table per config section, every
  field with its type, default, bounds and docstring, read from the dataclasses themselves (`rl/config.py`,
  `rollout/config.py`, `envs/config.py`; `typed_yaml.field_docs`);
- `bench/results.md` and its plots are pages of the site as they are in the repository.

Named in mkdocs.yml (`hooks:`); `make docs` builds the site with `--strict`.
"""

from __future__ import annotations

import dataclasses
import sys
import typing
from pathlib import Path

from mkdocs.structure.files import File

REPO = Path(__file__).resolve().parents[2]
MARKER = "<!-- config-reference -->"


def on_files(files, config):
    for path in [REPO / "bench" / "results.md", *sorted((REPO / "bench" / "plots").glob("*.png"))]:
        files.append(File.generated(config, str(path.relative_to(REPO)), abs_src_path=str(path)))
    return files


def on_page_markdown(markdown, page, config, files):
    if MARKER not in markdown:
        return markdown
    return markdown.replace(MARKER, config_reference())


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _type(tp) -> str:
    if typing.get_origin(tp) is typing.Literal:
        return " \\| ".join(f"`{a!r}`" for a in typing.get_args(tp))
    return f"`{_cell(getattr(tp, '__name__', None) or str(tp).replace('typing.', ''))}`"


def _default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f"`{f.default!r}`"
    if f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
        return "" if dataclasses.is_dataclass(value) else f"`{value!r}`"
    return "required"


def config_reference() -> str:
    """A markdown table per section of `RunConfig` (the run's top-level fields first)."""
    sys.path.insert(0, str(REPO))
    from rl.config import RunConfig
    from typed_yaml import bounds_of, field_docs

    def bounds(f) -> str:
        rule = bounds_of(f)
        return rule.describe() if rule is not None else ""

    def table(cls) -> list[str]:
        hints, docs = typing.get_type_hints(cls), field_docs(cls)
        rows = [
            "| key | type | default | bounds | what it is |",
            "| --- | --- | --- | --- | --- |",
        ]
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(hints[f.name]):
                continue
            rows.append(
                f"| `{f.name}` | {_type(hints[f.name])} | {_cell(_default(f))} "
                f"| {_cell(bounds(f))} | {_cell(docs.get(f.name, ''))} |"
            )
        return rows

    out = ["The run's own keys:", "", *table(RunConfig)]
    hints = typing.get_type_hints(RunConfig)
    for f in dataclasses.fields(RunConfig):
        section = hints[f.name]
        if not dataclasses.is_dataclass(section):
            continue
        out += [
            "",
            f"### `{f.name}`",
            "",
            _cell((section.__doc__ or "").split("\n\n")[0]),
            "",
            *table(section),
        ]
        # a section's own sub-sections (policy.upcycle, rollout.context, ...)
        for g in dataclasses.fields(section):
            sub = typing.get_type_hints(section)[g.name]
            if dataclasses.is_dataclass(sub):
                out += ["", f"#### `{f.name}.{g.name}`", "", *table(sub)]
    return "\n".join(out)

"""The import structure stays the architecture (issue 20): imports run one way, bottom to top, and
no module imports itself back through others.

    typed_yaml                     YAML into typed dataclasses; imports nothing of ours
    rewards, policy                milestone rewards; the model (neither imports the other)
    envs                           environments, sandboxes (may use rewards)
    rollout                        agent loop, engines, rollout workers, the trajectory record
    rl                             one folder per idea, themselves in layers (RL_FOLDERS):
      rl.learner, rl.start           the learner; starting policies and the warm start
      rl.weight_sync                 when and how the learner's weights reach the engines
      rl.loop                        the RL loop and its parts
    longhorizon                    the command-line tools

Every import counts, including those inside functions (a lazy import that runs back up is still a
cycle when it runs). Read from the source with `ast`, so the check needs no import to succeed.
"""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import REPO

LAYERS = {
    "typed_yaml": 0,
    "rewards": 1,
    "policy": 1,
    "envs": 2,
    "rollout": 3,
    "rl": 4,
    "longhorizon": 5,
}


# rl's folders; the modules at rl/'s top (config, store, faults, ray_utils) any folder may use
RL_FOLDERS = {"rl.learner": 1, "rl.start": 1, "rl.weight_sync": 2, "rl.loop": 3}


def _module(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Module -> the project's modules it imports (a package import counts as its __init__)."""
    files = {_module(p): p for pkg in LAYERS for p in (REPO / pkg).rglob("*.py")}
    graph = {}
    for mod, path in files.items():
        out = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # relative: resolve against this module's package
                    base = mod.split(".")[
                        : len(mod.split(".")) - node.level + (path.name == "__init__.py")
                    ]
                    names = [".".join(base + ([node.module] if node.module else []))]
                else:
                    names = [node.module]
                # `from pkg import submodule` imports the submodule too
                names += [
                    f"{names[0]}.{a.name}" for a in node.names if f"{names[0]}.{a.name}" in files
                ]
            else:
                continue
            for name in names:
                while name and name not in files:  # a name inside a module: the module
                    name = name.rpartition(".")[0]
                if name and name != mod:
                    out.add(name)
        graph[mod] = out
    return graph


def test_imports_never_run_up_the_layers():
    upward = []
    for mod, deps in import_graph().items():
        pkg = mod.split(".")[0]
        for dep in deps:
            other = dep.split(".")[0]
            if other != pkg and LAYERS[other] >= LAYERS[pkg]:
                upward.append(f"{mod} -> {dep}")
    assert not upward, "imports into the same or a higher layer:\n" + "\n".join(sorted(upward))


def test_rl_s_folders_import_only_down():
    """The learner knows nothing of the loop or the sync's schedule; the sync nothing of the loop."""

    def folder(mod: str) -> str | None:
        return next((f for f in RL_FOLDERS if mod == f or mod.startswith(f + ".")), None)

    upward = []
    for mod, deps in import_graph().items():
        here = folder(mod)
        for dep in deps:
            there = folder(dep)
            if here and there and there != here and RL_FOLDERS[there] >= RL_FOLDERS[here]:
                upward.append(f"{mod} -> {dep}")
    assert not upward, "rl/ folders importing sideways or up:\n" + "\n".join(sorted(upward))
    assert set(RL_FOLDERS) == {_module(p.parent) for p in (REPO / "rl").glob("*/__init__.py")}


def test_no_import_cycles():
    graph, cycles = import_graph(), []
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(mod: str, path: list[str]) -> None:
        state[mod] = 1
        for dep in sorted(graph[mod]):
            if state.get(dep) == 1:
                cycles.append(" -> ".join(path[path.index(dep) :] + [dep]))
            elif dep not in state:
                visit(dep, path + [dep])
        state[mod] = 2

    for mod in sorted(graph):
        if mod not in state:
            visit(mod, [mod])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_the_check_sees_an_upward_import(tmp_path):
    """The graph is read right: a known downward import is there (so an upward one would be too)."""
    graph = import_graph()
    assert "rollout.trajectory" in graph["rollout.agent_loop"]
    assert "typed_yaml" in graph["policy.args"]
    assert any(d.startswith("rl.") for d in graph["longhorizon.commands.train"])


def test_every_layer_ships_and_installs():
    """A package added to the layers is also shipped with a submitted job and installed by pip."""
    from longhorizon.jobs import PACKAGES

    assert set(LAYERS) <= set(PACKAGES)
    pyproject = (REPO / "pyproject.toml").read_text()
    assert all(f'"{pkg}*"' in pyproject for pkg in LAYERS)

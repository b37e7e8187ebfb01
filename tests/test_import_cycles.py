"""No import cycles among a package's modules: each module can be read after the ones it imports (issue 38).

Every import counts, wherever it stands: at module level, inside a function (a deferred import still ties the two
modules together), under `if TYPE_CHECKING:`; absolute (`from training.configs import X`), relative (`from .configs
import X`, `from . import configs`) and of a package's `__init__`. Imports of other packages are left to
tests/test_layering.py (server → streaming → model, never back); the union graph below catches a cycle through
several packages all the same.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("model", "streaming", "server", "training")


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path, packages: tuple[str, ...]) -> dict[str, set[str]]:
    """Module → the modules of `packages` it imports (anywhere in its source)."""
    paths = {module_name(p, root): p for pkg in packages for p in sorted((root / pkg).rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        is_package = path.name == "__init__.py"
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets.update(_known(alias.name, paths) for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = _absolute(node, name, is_package)
                for alias in node.names:  # `from pkg import module` imports the module itself
                    sub = f"{base}.{alias.name}" if base else alias.name
                    targets.add(sub if sub in paths else _known(base, paths))
        graph[name] = targets - {"", name}
    return graph


def _absolute(node: ast.ImportFrom, importer: str, is_package: bool) -> str:
    if node.level == 0:
        return node.module or ""
    parts = importer.split(".") if is_package else importer.split(".")[:-1]
    parts = parts[: len(parts) - (node.level - 1)]
    return ".".join([*parts, node.module] if node.module else parts)


def _known(name: str, paths: dict[str, Path]) -> str:
    """The module of ours that importing `name` loads (`model.dual_ar.X` → `model.dual_ar`); "" if none."""
    while name and name not in paths:
        name = name.rpartition(".")[0]
    return name


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (first module repeated at the end) per strongly connected component of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan; the graphs are a few dozen modules deep at most
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(_cycle_through(v, component, graph))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _cycle_through(start: str, component: set[str], graph: dict[str, set[str]]) -> list[str]:
    """The shortest path from `start` back to itself inside its component (breadth first)."""
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & component):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if w not in came_from:
                    came_from[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle through {start}")  # a component of several modules always has one


def _report(found: list[list[str]]) -> str:
    return "import cycles:\n" + "\n".join("  " + " → ".join(c) for c in found)


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_cycle_within_the_package(package: str) -> None:
    found = cycles(import_graph(ROOT, (package,)))
    assert not found, _report(found)


def test_no_import_cycle_across_the_packages() -> None:
    found = cycles(import_graph(ROOT, PACKAGES))
    assert not found, _report(found)


def test_a_cycle_through_a_deferred_relative_import_is_found(tmp_path: Path) -> None:
    """The checker itself: training's old cycle, codec_train → configs → dual_ar_train → codec_train, with the
    middle edge inside a function and every form of import the packages use."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "codec_train.py").write_text("from .configs import CODEC\n")
    (pkg / "configs.py").write_text("CODEC = 1\n\ndef measure():\n    from . import dual_ar_train\n")
    (pkg / "dual_ar_train.py").write_text("import pkg.codec_train\nfrom pkg.run_log import log\n")
    (pkg / "run_log.py").write_text("import json\n\ndef log():\n    pass\n")
    graph = import_graph(tmp_path, ("pkg",))
    assert graph["pkg.configs"] == {"pkg.dual_ar_train"}
    assert graph["pkg.dual_ar_train"] == {"pkg.codec_train", "pkg.run_log"}
    assert cycles(graph) == [["pkg.codec_train", "pkg.configs", "pkg.dual_ar_train", "pkg.codec_train"]]
    (pkg / "configs.py").write_text("CODEC = 1\n")
    assert cycles(import_graph(tmp_path, ("pkg",))) == []

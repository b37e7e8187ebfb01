"""Test markers are used as pyproject.toml declares them (issue 38). `--strict-markers` already refuses an undeclared
one; here: every declared marker is used, and `gpu` ("needs a CUDA device, skipped without one") always comes with
its skip, and that skip with it, on the same test or module (`pytestmark`)."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TESTS = sorted((ROOT / "tests").rglob("*.py"))


def declared_markers() -> set[str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    return {m.split(":", 1)[0].strip() for m in config["tool"]["pytest"]["ini_options"]["markers"]}


def mark_name(node: ast.expr) -> str | None:
    """`pytest.mark.NAME` or `pytest.mark.NAME(...)` → NAME."""
    if isinstance(node, ast.Call):
        node = node.func
    if isinstance(node, ast.Attribute) and ast.unparse(node.value) == "pytest.mark":
        return node.attr
    return None


def skips_without_cuda(node: ast.expr) -> bool:
    return mark_name(node) == "skipif" and "cuda.is_available()" in ast.unparse(node)


def mark_groups(tree: ast.Module) -> list[tuple[int, list[ast.expr]]]:
    """The marks applied together: each test's (or class's) decorators, and a module's `pytestmark`."""
    groups: list[tuple[int, list[ast.expr]]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            groups.append((node.lineno, node.decorator_list))
        elif isinstance(node, ast.Assign) and any(ast.unparse(t) == "pytestmark" for t in node.targets):
            value = node.value
            groups.append((node.lineno, list(value.elts) if isinstance(value, ast.List | ast.Tuple) else [value]))
    return groups


def test_every_declared_marker_is_used() -> None:
    used = {
        name
        for path in TESTS
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.Attribute) and (name := mark_name(node)) is not None
    }
    assert declared_markers() <= used, f"declared in pyproject.toml but never used: {declared_markers() - used}"


@pytest.mark.parametrize("path", TESTS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_gpu_tests_are_marked_gpu_and_skipped_without_cuda(path: Path) -> None:
    for line, marks in mark_groups(ast.parse(path.read_text(encoding="utf-8"))):
        gpu = any(mark_name(m) == "gpu" for m in marks)
        skip = any(skips_without_cuda(m) for m in marks)
        assert gpu == skip, f"line {line}: pytest.mark.gpu and a skipif(not torch.cuda.is_available()) go together"

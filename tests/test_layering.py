"""Arrows go server → streaming → model, never back (STYLE.md): checked on the import statements of every module."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# The CLI entry may call model/'s checkpoint conversion (`fishgate convert`); nothing else in server/ may.
SERVER_MODEL_IMPORTS = {"server/cli.py": {"model.convert", "model.weights"}}
STREAMING_MODEL_DOOR = "streaming/backend.py"


def imports_of(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def top(name: str) -> str:
    return name.split(".", maxsplit=1)[0]


def modules(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


@pytest.mark.parametrize("path", modules("model"), ids=lambda p: p.name)
def test_model_imports_nothing_above_it(path: Path) -> None:
    assert not {top(n) for n in imports_of(path)} & {"streaming", "server", "asyncio", "starlette", "uvicorn"}


@pytest.mark.parametrize("path", modules("streaming"), ids=lambda p: p.name)
def test_streaming_reaches_model_only_through_its_backend(path: Path) -> None:
    names = imports_of(path)
    assert "server" not in {top(n) for n in names}
    if path.relative_to(ROOT).as_posix() != STREAMING_MODEL_DOOR:
        assert not [n for n in names if top(n) == "model"], "only streaming/backend.py may import model/"


@pytest.mark.parametrize("path", modules("server"), ids=lambda p: p.name)
def test_server_never_imports_torch_or_model(path: Path) -> None:
    names = imports_of(path)
    allowed = SERVER_MODEL_IMPORTS.get(path.relative_to(ROOT).as_posix(), set())
    assert "torch" not in {top(n) for n in names}
    assert {n for n in names if top(n) == "model"} <= allowed

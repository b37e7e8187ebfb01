"""Discovery of upstream parity fixture sets (see ../shared/fixtures/fish15/README.md).

A set is recognised from the files present, never from its folder name, so any other folder in the same format
(pointed to by the environment variable FISH15_FIXTURES) runs unchanged.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_ROOT = REPO_ROOT.parent / "shared" / "fixtures" / "fish15"


def fixtures_root() -> Path:
    return Path(os.environ.get("FISH15_FIXTURES", str(DEFAULT_ROOT))).resolve()


@dataclass(frozen=True)
class FixtureSet:
    path: Path

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def config(self) -> dict:
        return json.loads((self.path / "config.json").read_text())

    @property
    def meta(self) -> dict:
        p = self.path / "fixtures_meta.json"
        return json.loads(p.read_text()) if p.exists() else {}

    def tensors(self, file: str = "fixtures.safetensors") -> dict[str, torch.Tensor]:
        return _load(self.path / file)

    def has(self, file: str) -> bool:
        return (self.path / file).exists()


@cache
def _load(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path))


def _is_dual_ar(p: Path) -> bool:
    if not (p / "config.json").exists() or not (p / "tokenizer.tiktoken").exists():
        return False
    if not ((p / "model.pth").exists() or (p / "model.safetensors").exists()):
        return False
    return json.loads((p / "config.json").read_text()).get("model_type") == "dual_ar"


def _is_firefly(p: Path) -> bool:
    if not ((p / "generator.pth").exists() or (p / "generator.safetensors").exists()):
        return False
    if (p / "codec_config.json").exists():
        return True
    return (p / "config.json").exists() and "model_type" not in json.loads((p / "config.json").read_text())


def _sets(pred) -> list[FixtureSet]:
    root = fixtures_root()
    if not root.is_dir():
        return []
    return [FixtureSet(p) for p in sorted(root.iterdir()) if p.is_dir() and pred(p)]


def dual_ar_sets() -> list[FixtureSet]:
    return [s for s in _sets(_is_dual_ar) if s.has("fixtures.safetensors")]


def firefly_sets() -> list[FixtureSet]:
    return [s for s in _sets(_is_firefly) if s.has("fixtures.safetensors")]


def manifests_dir() -> Path | None:
    p = fixtures_root() / "manifests"
    return p if p.is_dir() else None


def params(sets: list[FixtureSet]):
    """pytest parameters for a list of sets; an empty list yields one skipped case that says why."""
    if not sets:
        return [
            pytest.param(None, marks=pytest.mark.skip(reason=f"no fixture sets of this kind under {fixtures_root()}"))
        ]
    return [pytest.param(s, id=s.name) for s in sets]

"""A stand-in engine for host-side benchmarks (bench.ray_cost): the real Engine, worker, scheduler and gateway run
unchanged on bench.standin_backend.StandInBackend, whose decode step and vocoder do no model work but sleep for what a
GPU would take (DeviceModel here) and hand back codes and PCM of the right size at once.

`install()` makes every Engine built afterwards in this process use it (it changes the default `backend_factory` of
streaming.engine.EngineConfig), so production code needs no hook: a benchmark calls it before `server.cli.main`, and
Ray runs it in every worker process as `runtime_env={"worker_process_setup_hook": "bench.standin.install"}`. This
module imports no torch: Ray processes that never build an engine (Serve's controller and proxy) stay light. The
device model comes from the BENCH_STANDIN_DEVICE environment variable (DeviceModel.to_env), else its defaults.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys
from dataclasses import asdict, dataclass, fields
from types import ModuleType
from typing import Any

DEVICE_ENV = "BENCH_STANDIN_DEVICE"  # a DeviceModel as JSON (DeviceModel.to_env); unset: the defaults
ENGINE_MODULE = "streaming.engine"


@dataclass(frozen=True, slots=True)
class DeviceModel:
    """GPU milliseconds the stand-in sleeps for. Defaults: full-size Fish 1.5 (bf16, compiled, graph-captured) on one
    H100/H200: the decode step 1.45 ms at one row and 9.3 ms at 384 rows (docs/ARCHITECTURE.md), so 1.45 ms + 0.0205 ms
    a row; the vocoder 29.5 ms for 64 rows × 24 frames (0.019 ms a frame) and ~1.35 ms for one row of 8 frames; a
    prefill pass of 8 prompts of 64 tokens 4.66 ms."""

    step_ms: float = 1.45
    step_ms_per_row: float = 0.0205
    vocode_ms_per_call: float = 0.5
    vocode_ms_per_frame: float = 0.019
    prefill_ms_per_call: float = 0.5
    prefill_ms_per_token: float = 0.008

    def step_s(self, rows: int) -> float:
        return (self.step_ms + self.step_ms_per_row * rows) / 1e3

    def vocode_s(self, calls: int, frames: int) -> float:
        return (self.vocode_ms_per_call * calls + self.vocode_ms_per_frame * frames) / 1e3

    def prefill_s(self, tokens: int) -> float:
        return (self.prefill_ms_per_call + self.prefill_ms_per_token * tokens) / 1e3

    def to_env(self) -> str:
        return json.dumps(asdict(self))

    @staticmethod
    def from_env() -> DeviceModel:
        raw = os.environ.get(DEVICE_ENV)
        if not raw:
            return DeviceModel()
        given = json.loads(raw)
        known = {f.name for f in fields(DeviceModel)}
        if not isinstance(given, dict) or set(given) - known:
            raise ValueError(f"{DEVICE_ENV} must be a JSON object with keys among {sorted(known)}, not {raw!r}")
        return DeviceModel(**{k: float(v) for k, v in given.items()})


def patch_engine_module(module: ModuleType) -> None:
    """Make `module.EngineConfig` (streaming.engine's) build the stand-in backend unless told otherwise."""
    real = module.EngineConfig
    if getattr(real, "standin", False):
        return
    from bench.standin_backend import StandInBackend

    def config(*args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("backend_factory", StandInBackend)
        return real(*args, **kwargs)

    config.standin = True  # type: ignore[attr-defined]
    setattr(module, "EngineConfig", config)  # noqa: B010 - a module's attribute, replaced


class _PatchOnImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Patches streaming.engine right after this process imports it (the server imports it when it builds its
    engine: `from streaming.engine import Engine, EngineConfig` inside server.app.build_local_engine)."""

    def __init__(self) -> None:
        self._loader: importlib.abc.Loader | None = None

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != ENGINE_MODULE:
            return None
        sys.meta_path.remove(self)  # once: find the real module's spec, then stand in as its loader
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        self._loader = spec.loader
        spec.loader = self
        return spec

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        assert self._loader is not None
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        assert self._loader is not None
        self._loader.exec_module(module)
        patch_engine_module(module)


def install() -> None:
    """Every Engine this process builds from now on runs on the stand-in backend (patched now, or when
    streaming.engine is first imported)."""
    module = sys.modules.get(ENGINE_MODULE)
    if module is not None:
        patch_engine_module(module)
    elif not any(isinstance(f, _PatchOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport())

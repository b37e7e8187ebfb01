"""Shared helpers for engine tests: build engines on real checkpoint folders and collect utterances."""

from __future__ import annotations

import asyncio
import importlib
import json
import shutil
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from streaming.backend import Backend
from streaming.config import BackendConfig, WorkerLimits
from streaming.engine import Engine, EngineConfig
from streaming.session import (
    AudioChunk,
    Cancelled,
    SegmentDone,
    Session,
    SessionError,
    SynthesisSettings,
    UtteranceDone,
    Voice,
)
from tests.model.fixture_sets import fixtures_root

EVENT_TIMEOUT_S = 60.0


class NeverEnding(Backend):
    """The real backend whose frames never carry the end token, so every random-model segment runs to its full
    length (its code 0 already says 0 for such a frame, as for the first semantic token put in its place)."""

    def _no_end(self, frames: np.ndarray) -> np.ndarray:
        main = frames[..., 0]
        main[main == self.im_end_id] = self.model.semantic_begin_id
        return frames

    def start_segments(
        self, rows: Sequence[int], logits: torch.Tensor, hidden: torch.Tensor, next_positions: Sequence[int]
    ) -> np.ndarray:
        return self._no_end(super().start_segments(rows, logits, hidden, next_positions))

    def step(self, rows: int, commit: Sequence[bool], max_pos: int, while_running=None) -> np.ndarray:
        return self._no_end(super().step(rows, commit, max_pos, while_running))


# The embedded default before issue 6's voice shipped: random weights, dim 64, 2 layers, ~0.7 M parameters. Tests
# whose timing assumes decode steps far faster than real time on a loaded 2-core CPU run on it (the trained default
# is ~6x larger).
RANDOM_TINY_MODEL = Path(__file__).resolve().parents[1] / "assets" / "random_tiny_model"


@contextmanager
def running_engine(
    checkpoint: Path | None = None,
    max_sessions: int = 4,
    *,
    backend_factory: Callable[[BackendConfig], Backend] = Backend,
    batch_invariant: bool | None = None,
    warm_up: bool = True,
    ready_timeout_s: float = 120,
    **limits,
):
    engine = Engine(
        EngineConfig(
            BackendConfig(checkpoint=checkpoint, max_sessions=max_sessions, batch_invariant=batch_invariant),
            WorkerLimits(**limits),
            warm_up=warm_up,
            backend_factory=backend_factory,
        )
    )
    engine.start()
    try:
        assert engine.wait_ready(ready_timeout_s), engine.fault or f"not ready within {ready_timeout_s} s"
        yield engine
    finally:
        engine.stop()


@dataclass
class Utterance:
    pcm: np.ndarray
    segments: list[SegmentDone] = field(default_factory=list)
    done: UtteranceDone | None = None
    cancelled: Cancelled | None = None
    errors: list[SessionError] = field(default_factory=list)
    chunk_samples: list[int] = field(default_factory=list)

    @property
    def chunks(self) -> int:
        return len(self.chunk_samples)

    @property
    def codes(self) -> np.ndarray:
        return np.concatenate([s.codes for s in self.segments], axis=1)


async def collect(session: Session, until=(UtteranceDone, Cancelled)) -> Utterance:
    """Read events until one of `until` (or a fatal error) arrives."""
    pcm, out = [], Utterance(np.zeros(0, np.float32))
    while True:
        ev = await asyncio.wait_for(session.next_event(), EVENT_TIMEOUT_S)
        if isinstance(ev, AudioChunk):
            pcm.append(ev.pcm)
            out.chunk_samples.append(len(ev.pcm))
        elif isinstance(ev, SegmentDone):
            out.segments.append(ev)
        elif isinstance(ev, SessionError):
            out.errors.append(ev)
            if ev.fatal:
                break
        elif isinstance(ev, UtteranceDone):
            out.done = ev
        elif isinstance(ev, Cancelled):
            out.cancelled = ev
        if isinstance(ev, until):
            break
    out.pcm = np.concatenate(pcm) if pcm else np.zeros(0, np.float32)
    return out


async def speak(session: Session, *texts: str) -> Utterance:
    for t in texts:
        session.speak(t)
    session.end_utterance()
    return await collect(session)


def fixture_checkpoint(tmp_path: Path, dual_ar: str = "dual_ar_tiny_samefast", codec: str = "firefly_tiny") -> Path:
    """A complete checkpoint folder from the upstream fixtures: tiny DualAR (ends with <|im_end|>) + tiny codec."""
    root = fixtures_root()
    out = tmp_path / "ckpt"
    out.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.tiktoken"):
        shutil.copy(root / dual_ar / name, out / name)
    shutil.copy(root / codec / "generator.safetensors", out / "generator.safetensors")
    shutil.copy(root / codec / "config.json", out / "codec_config.json")
    (out / "fishgate.json").write_text(json.dumps({"name": "fixture-tiny"}))
    return out


async def speak_together(engine: Engine, settings: list[SynthesisSettings], texts: list[str]) -> list[Utterance]:
    """Open one session per text and queue all of them while the worker is held, so they arrive in one turn."""
    gate = threading.Event()
    held = asyncio.ensure_future(engine.run_job(lambda worker: gate.wait(10)))  # the worker waits: commands pile up
    await asyncio.sleep(0.05)
    sessions = [engine.open_session(Voice(), s) for s in settings]
    pending = [asyncio.ensure_future(speak(s, t)) for s, t in zip(sessions, texts, strict=True)]
    await asyncio.sleep(0.05)
    gate.set()
    await held
    return await asyncio.gather(*pending)


# Every module whose clock readings the worker's decisions rest on: client buffers and the playback clock
# (stream_state), refills, held growth, prefill holds, pacing and turn times (worker), the turn average that held
# growth reads (realtime_admission). Each reads `time.monotonic()` / `time.perf_counter()` through its `time` import.
CLOCKED_MODULES = ("streaming.worker", "streaming.stream_state", "streaming.realtime_admission")


class VirtualClock:
    """The clock as the worker sees it under `virtual_clock()`: `monotonic()` and `perf_counter()` move only when
    something calls `advance` (a test backend's decode step, a test standing for a pause), so the worker's timing
    decisions do not depend on how fast or loaded the machine is. Thread-safe."""

    def __init__(self, start_s: float = 1000.0) -> None:
        self._now = start_s
        self._lock = threading.Lock()

    def monotonic(self) -> float:
        with self._lock:
            return self._now

    perf_counter = monotonic

    def advance(self, seconds: float) -> None:
        assert seconds >= 0, seconds
        with self._lock:
            self._now += seconds


class _ClockedTime:
    """The `time` module, but for the virtual clock's monotonic() and perf_counter() (sleep and the rest are real)."""

    def __init__(self, clock: VirtualClock) -> None:
        self.monotonic = clock.monotonic
        self.perf_counter = clock.perf_counter

    def __getattr__(self, name: str):
        return getattr(time, name)


@contextmanager
def virtual_clock(start_s: float = 1000.0) -> Iterator[VirtualClock]:
    """Patch the clock of CLOCKED_MODULES with a VirtualClock for the block (enter it before `running_engine`, so
    the engine has stopped before the real clock is back)."""
    clock = VirtualClock(start_s)
    with ExitStack() as stack:
        for name in CLOCKED_MODULES:
            module = importlib.import_module(name)
            assert module.time is time, f"{name} no longer reads the clock through `time`"
            stack.callback(setattr, module, "time", time)
            module.time = _ClockedTime(clock)
        yield clock

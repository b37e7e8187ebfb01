"""Idle-time graph capture waits until the worker has had no work for `idle_capture_after_s`: a capture blocks the
worker, and a request arriving during one waits for it (on the H200, captures at every gap between
back-to-back requests cost each request 40-70 ms of first audio). On CPU nothing is captured, so a recording
backend stands in for the GPU's `capture_idle_graph` and notes when the worker would have captured."""

from __future__ import annotations

import asyncio
import itertools
import time

from streaming.backend import Backend
from streaming.config import BackendConfig, WorkerLimits
from streaming.session import SynthesisSettings, Voice
from tests.streaming.engine_helpers import running_engine, speak

AFTER_S = 1.5  # far above the gaps between back-to-back requests, even on a loaded machine


async def first_call(backend, since: float, timeout_s: float = 30.0) -> float:
    """The first capture the worker tried at or after `since` (waiting for it)."""
    deadline = time.monotonic() + timeout_s
    while not (calls := [t for t in backend.capture_calls if t >= since]):
        assert time.monotonic() < deadline, "the worker never tried an idle capture"
        await asyncio.sleep(0.01)
    return calls[0]


class RecordingBackend(Backend):
    def __init__(self, config: BackendConfig) -> None:
        super().__init__(config)
        self.capture_calls: list[float] = []

    def capture_idle_graph(self, row_positions) -> bool:
        self.capture_calls.append(time.monotonic())
        return False  # nothing left to capture: the worker naps as before


def test_idle_capture_waits_for_a_pause_not_a_gap_between_requests() -> None:
    async def run(engine) -> tuple[list[float], float, float]:
        backend = engine._worker.b
        backend.capture_calls.clear()
        for n in range(3):  # back to back, as a benchmark client or a chatty user sends them
            session = engine.open_session(Voice(), SynthesisSettings(seed=n))
            await speak(session, f"Utterance number {n}.")
            closing = time.monotonic()  # the worker takes the close after this: its idle clock starts later
            session.close()
            await asyncio.sleep(0.1)  # a gap well under AFTER_S
        during = list(backend.capture_calls)
        return during, closing, await first_call(backend, closing)  # a real pause

    with running_engine(max_sessions=2, backend_factory=RecordingBackend, idle_capture_after_s=AFTER_S) as engine:
        during, closing, first = asyncio.run(run(engine))
    assert during == [], "the worker tried to capture between back-to-back requests"
    assert first - closing >= AFTER_S, (first - closing, AFTER_S)  # a whole pause after the last command


def test_zero_keeps_capturing_at_once_when_idle() -> None:
    async def one(engine) -> None:
        await speak(engine.open_session(Voice(), SynthesisSettings(seed=1)), "Hello there.")

    with running_engine(max_sessions=2, backend_factory=RecordingBackend, idle_capture_after_s=0.0) as engine:
        asyncio.run(one(engine))
        end = time.monotonic()
        first = asyncio.run(first_call(engine._worker.b, end))
    # at once: long before the default pause would have let it (a generous bound; a capture is tried every nap)
    assert first - end < WorkerLimits().idle_capture_after_s, first - end


def test_idle_capture_takes_the_batched_vocoder_graphs_after_the_decode_graphs() -> None:
    """Warm-up captures only one-row vocoder graphs; the batched ones would otherwise be captured on first use, in the
    middle of a loaded turn. Once no decode or prefill graph is missing, each idle call captures one of them (small
    buckets first), then reports nothing left. The GPU test (test_engine_gpu.py) checks the real graphs; here, on
    CPU, where nothing is graph-captured, a recorder takes GraphedVocoder's place."""
    from streaming.chunking import all_chunk_sizes

    class VocoderGraphsRecorder:
        def __init__(self) -> None:
            self.captured: list[tuple[int, int]] = []

        def missing(self, frame_sizes):
            return [(b, f) for b in (2, 4) for f in frame_sizes if (b, f) not in self.captured]

        def capture(self, bucket: int, frames: int) -> None:
            self.captured.append((bucket, frames))

    backend = Backend(BackendConfig(max_sessions=2))
    assert backend.vocoder_graphs is None and not backend.capture_idle_graph([0, 0, 0])  # CPU: nothing to capture
    recorder = VocoderGraphsRecorder()
    backend.vocoder_graphs = recorder  # type: ignore[assignment]
    sizes = all_chunk_sizes()
    assert backend.count_missing_graphs() == 2 * len(sizes)
    calls, left = 0, []
    while backend.capture_idle_graph([0, 0, 0]):
        calls += 1
        left.append(backend.graphs_missing)  # the gauge /metrics shows, counted down by each capture
    assert calls == 2 * len(sizes) and recorder.captured == [(b, f) for b in (2, 4) for f in sizes]
    assert left == list(range(2 * len(sizes) - 1, -1, -1)) and backend.graphs_missing == 0


class ObjectBuildingCaptures(Backend):
    """Stands in for captures that build long-lived objects (compiled code, caches): three idle captures."""

    def __init__(self, config: BackendConfig) -> None:
        super().__init__(config)
        self.kept: list[list[dict]] = []
        self.freeze_counts: list[int] = []  # gc.get_freeze_count() when each capture began

    def capture_idle_graph(self, row_positions) -> bool:
        import gc

        if len(self.kept) == 3:
            return False
        self.freeze_counts.append(gc.get_freeze_count())
        built = [{"node": i} for i in range(20_000)]
        for a, b in itertools.pairwise(built):  # cycles, as compiled graphs hold them
            a["next"], b["prev"] = b, a
        self.kept.append(built)
        self.graphs_missing = 3 - len(self.kept)
        return True


def test_what_each_idle_capture_builds_is_frozen_out_of_later_collections() -> None:
    """A full collection walks every object not frozen, and each capture adds hundreds of thousands (H200:
    pauses of 78 → 785 ms while idle captures ran after ready): each capture's objects are frozen right after it."""
    import gc

    with running_engine(max_sessions=2, backend_factory=ObjectBuildingCaptures, idle_capture_after_s=0.0) as engine:
        backend = engine._worker.b
        deadline = time.monotonic() + 30
        while len(backend.kept) < 3 or backend.graphs_missing:
            assert time.monotonic() < deadline, "the idle captures never ran"
            time.sleep(0.05)
        while gc.get_freeze_count() < backend.freeze_counts[-1] + 19_000:  # the last capture's freeze
            assert time.monotonic() < deadline, "the last capture was never frozen"
            time.sleep(0.01)
        counts = [*backend.freeze_counts, gc.get_freeze_count()]
        unfrozen = {id(o) for o in gc.get_objects()}
        assert all(id(d) not in unfrozen for built in backend.kept for d in built[::1000])
    assert all(later - earlier >= 19_000 for earlier, later in itertools.pairwise(counts)), counts


class CapturesOnFirstUse(Backend):
    """Stands in for a decode graph captured on first use inside a turn: the first step builds long-lived objects."""

    def __init__(self, config: BackendConfig) -> None:
        super().__init__(config)
        self.built: list[dict] = []
        self.freeze_count_before = -1

    def graphs_captured(self) -> int:
        return int(bool(self.built))

    def step(self, rows, commit, max_pos, while_running=None):
        import gc

        if not self.built:
            self.freeze_count_before = gc.get_freeze_count()
            self.built = [{"node": i} for i in range(20_000)]
            for a, b in zip(self.built, self.built[1:], strict=False):  # cycles: tracked by the collector
                a["next"], b["prev"] = b, a
        return super().step(rows, commit, max_pos, while_running)


def test_what_a_first_use_capture_builds_is_frozen_after_its_turn() -> None:
    import gc

    async def one(engine) -> None:
        await speak(engine.open_session(Voice(), SynthesisSettings(seed=1)), "Hello there.")

    with running_engine(max_sessions=2, backend_factory=CapturesOnFirstUse, warm_up=False) as engine:
        asyncio.run(one(engine))
        backend = engine._worker.b
        assert backend.built and gc.get_freeze_count() - backend.freeze_count_before >= 19_000
        unfrozen = {id(o) for o in gc.get_objects()}
        assert all(id(d) not in unfrozen for d in backend.built[::1000])


class StartupCapturesBuildObjects(Backend):
    """Start-up captures on CPU: the stepper's recorder stands in for CUDA graph capture (as in tests/model/
    test_stepper.py) and each capture builds long-lived cyclic objects, as compiling and capturing a region does."""

    def __init__(self, config: BackendConfig) -> None:
        super().__init__(config)
        self.kept: list[list[dict]] = []
        self.freeze_counts: list[int] = []  # gc.get_freeze_count() when each capture began

    def capture_graphs(self) -> int:
        import gc
        import types

        def record(run):
            self.freeze_counts.append(gc.get_freeze_count())
            built = [{"node": i} for i in range(20_000)]
            for a, b in itertools.pairwise(built):
                a["next"], b["prev"] = b, a
            self.kept.append(built)
            run()
            return types.SimpleNamespace(replay=run)

        self.stepper.use_cuda_graphs = True
        self.stepper._record = record  # type: ignore[method-assign]
        try:
            return super().capture_graphs()
        finally:
            self.stepper.use_cuda_graphs = False  # the rest of the engine runs eagerly, as on CPU


def test_each_start_up_capture_is_frozen_before_the_next_one() -> None:
    """Before ready, each capture's objects are frozen right after it, so a full collection during start-up walks only
    the capture under way (H200, unfrozen: start-up collections grew from 85 to 784 ms, ~2 s of a warm start)."""
    import gc

    with running_engine(max_sessions=2, backend_factory=StartupCapturesBuildObjects) as engine:
        backend = engine._worker.b
        assert len(backend.kept) >= 2, "the stand-in captures did not run"
        assert all(later - earlier >= 19_000 for earlier, later in itertools.pairwise(backend.freeze_counts))
        unfrozen = {id(o) for o in gc.get_objects()}
        assert all(id(d) not in unfrozen for built in backend.kept for d in built[::1000])

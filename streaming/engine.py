"""The engine's public face: start the worker thread, admit sessions, run jobs on the worker, drain and stop.

Lifecycle: STARTING (worker loads weights, captures graphs, warms up; each phase timed and logged) → READY →
DRAINING (no new sessions; running ones finish) → STOPPED; FAULTED if the device fails (the server then exits
non-zero so a supervisor restarts it). The command queue is bounded; when it is full, callers get Overloaded.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from .admission_queue import AdmissionQueue
from .backend import Backend
from .config import ADMISSION_WAIT_S, MAX_QUEUED_CHARS, BackendConfig, WorkerLimits
from .engine_api import EngineState, ModelInfo
from .errors import AdmissionDeferred, NotReady, Overloaded
from .gc_pauses import GcPauses, freeze_startup_objects
from .session import Close, Session, Speak, SynthesisSettings, Voice
from .worker import Worker, run_forever

log = logging.getLogger(__name__)
DEVICE_PARTS = ("prefill", "step", "vocode")  # Backend.device_times spans on /metrics

# Commands in flight from all sessions together; a full queue refuses new work instead of growing. A session's one
# Close is never refused (a refused Close would leave the worker holding its slot while the engine counted it free),
# and each Close follows an admitted open: the queue never holds more than twice this.
COMMAND_QUEUE_SIZE = 4096
WARM_UP_TEXT = "Hello world."
# Reference encodes waiting for the engine's one encoder thread; more are refused (Overloaded) instead of queueing.
MAX_PENDING_ENCODES = 16

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    backend: BackendConfig = field(default_factory=BackendConfig)
    limits: WorkerLimits = field(default_factory=WorkerLimits)
    warm_up: bool = True
    max_queued_chars: int = MAX_QUEUED_CHARS  # per session: text sent but not yet spoken (Session.speak refuses more)
    # Engine.admit: how long a new session waits while the real-time admission defers it (a burst comes in as the
    # capacity estimate grows, turn by turn) before it is refused; 0 refuses at once. At most max_sessions wait.
    admission_wait_s: float = ADMISSION_WAIT_S
    # what builds the backend on the worker thread (tests swap in stand-ins)
    backend_factory: Callable[[BackendConfig], Backend] = Backend


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.state = EngineState.STARTING
        self.info: ModelInfo | None = None
        self.timings_s: dict[str, float] = {}
        # how start-up's compiles used the on-disk caches (model.compiled_regions.cache_counts), taken at ready
        self.startup_compile: dict[str, int] = {}
        self.fault: str | None = None
        # start-up refused by its configuration (a missing or malformed checkpoint, no such device): its message,
        # for the operator; restarting cannot help
        self.config_error: str | None = None
        self._commands: queue.Queue[object] = queue.Queue()  # bounded by _send (COMMAND_QUEUE_SIZE)
        # encodes run one at a time on their own thread: waiting ones hold no thread of the default pool, which
        # the server's audio encoding uses (six waiting uploads used to hold all of a 2-core machine's pool)
        self._encoder = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="fishgate-encode")
        self._pending_encodes = 0
        self._sessions: dict[int, Session] = {}
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, name="fishgate-worker", daemon=True)
        self._worker: Worker | None = None
        self.gc_pauses = GcPauses()
        self._admission = AdmissionQueue(max_waiting=config.backend.max_sessions)

    # ---- lifecycle ---------------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the worker thread (loading, capture, warm-up); a second call does nothing."""
        if self._thread.ident is None:
            self._thread.start()

    def wait_ready(self, timeout: float | None = None) -> bool:
        self._ready.wait(timeout)
        return self.state is EngineState.READY

    @property
    def ready(self) -> bool:
        return self.state is EngineState.READY

    def _main(self) -> None:
        started = time.perf_counter()
        self.gc_pauses.install()
        try:
            backend = self.config.backend_factory(self.config.backend)
            self.timings_s.update(backend.timings_s)
            self.info = backend.info
            graphs = backend.capture_graphs()
            self.timings_s.update(backend.timings_s)
            worker = Worker(backend, self._commands, self.config.limits)
            worker.after_turn = self._admission.notify  # each turn updates the admission's estimate
            worker.gc_pauses = self.gc_pauses
            self._worker = worker
            if self.config.warm_up:
                t0 = time.perf_counter()
                _warm_up(worker, self.timings_s)
                self.timings_s["warm_up"] = time.perf_counter() - t0
            backend.graphs_missing = backend.count_missing_graphs()
            t0 = time.perf_counter()
            frozen = freeze_startup_objects()  # later collections skip what start-up built (streaming.gc_pauses)
            self.timings_s["gc_freeze"] = time.perf_counter() - t0
            self.timings_s["total"] = time.perf_counter() - started
            self.startup_compile = backend.compile_cache_counts()
            log.info(
                "engine ready in %.2f s (%s; %d decode graphs; %d start-up objects frozen; compile caches: %s)",
                self.timings_s["total"], ", ".join(f"{k} {v:.2f} s" for k, v in self.timings_s.items()), graphs,
                frozen, ", ".join(f"{k} {v}" for k, v in self.startup_compile.items()),
            )  # fmt: skip
            self.state = EngineState.READY
        except Exception as e:
            if isinstance(e, ValueError | FileNotFoundError):  # CheckpointError is a ValueError
                self.config_error = str(e)
            self._set_fault("start-up failed", e)
            return
        finally:
            self._ready.set()
        try:
            run_forever(worker, self._stop.is_set)
        except Exception as e:  # the loop itself failed (device fault): nothing can be trusted any more
            self._set_fault("worker loop failed", e)
        else:
            if self.state is not EngineState.FAULTED:
                self.state = EngineState.STOPPED

    def _set_fault(self, what: str, err: Exception) -> None:
        log.critical("engine %s: %s", what, type(err).__name__, exc_info=err)
        self.fault = f"{what}: {type(err).__name__}"
        self.state = EngineState.FAULTED

    def drain(self) -> None:
        """Stop admitting sessions; running ones continue until closed."""
        if self.state is EngineState.READY:
            self.state = EngineState.DRAINING

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        self._encoder.shutdown(wait=False, cancel_futures=True)
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        self.gc_pauses.uninstall()
        if self.state is not EngineState.FAULTED:
            self.state = EngineState.STOPPED

    # ---- sessions ----------------------------------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return self.config.backend.max_sessions

    @property
    def open_sessions(self) -> int:
        return len(self._sessions)

    def open_session(
        self, voice: Voice, settings: SynthesisSettings, loop: asyncio.AbstractEventLoop | None = None
    ) -> Session:
        if self.state is not EngineState.READY:
            raise NotReady(f"the engine is {self.state.value}; retry when /readyz says ready")
        loop = loop or asyncio.get_running_loop()
        worker = self._worker
        assert worker is not None
        with self._lock:
            if len(self._sessions) >= self.capacity:
                raise Overloaded(
                    f"all {self.capacity} sessions are in use; retry later (--max-sessions sets the limit)"
                )
            behind = worker.admission.refusal(working=len(self._sessions) - worker.idle_streams)
            if behind is not None:
                raise AdmissionDeferred(behind)
            session = Session(voice, settings, self._send, loop, max_queued_chars=self.config.max_queued_chars)
            self._sessions[session.id] = session
        try:
            self._send(lambda: worker.add(session))
        except Overloaded:
            with self._lock:  # nobody holds this session: its place is free again
                self._sessions.pop(session.id, None)
            raise
        return session

    async def admit(self, voice: Voice, settings: SynthesisSettings, wait_s: float | None = None) -> Session:
        """open_session, waiting up to `wait_s` (default: the config's admission_wait_s) in a first-come queue while
        the real-time admission defers new sessions (streaming.admission_queue); then its refusal stands, with how
        long it waited. Other refusals (not ready, every session slot taken) are immediate."""
        wait_s = self.config.admission_wait_s if wait_s is None else wait_s
        return await self._admission.admit(lambda: self.open_session(voice, settings), wait_s)

    @property
    def admission_waiting(self) -> int:
        """Sessions waiting in admit() now."""
        return len(self._admission)

    def headroom(self) -> int:
        """How many more sessions this engine would take now, by its own admission's judgement (any thread; a few
        reads): its free session slots, less those waiting in admit(); with the real-time admission on and measured,
        at most the streams its capacity estimate allows beyond those with work (0 while it is behind real time).
        0 unless ready. A pool of engines routes new sessions by it (streaming.engine_link.pool)."""
        worker = self._worker
        if self.state is not EngineState.READY or worker is None:
            return 0
        sessions = len(self._sessions)
        room = self.capacity - sessions - self.admission_waiting
        admission = worker.admission
        if admission.capacity_limit_s is not None and admission.turn_avg_s > 0:  # an estimate exists
            if admission.behind_now():
                return 0
            allowed = int(admission.capacity() or 0) - (sessions - worker.idle_streams)
            room = min(room, allowed - self.admission_waiting)
        return max(0, room)

    def _send(self, cmd: object) -> None:
        if isinstance(cmd, Speak):
            cmd = self._prepare(cmd)
        if isinstance(cmd, Close):
            with self._lock:
                self._sessions.pop(cmd.session, None)
            self._admission.notify()  # its place may let a waiting session in
        elif self._commands.qsize() >= COMMAND_QUEUE_SIZE:
            raise Overloaded("the engine's command queue is full; retry later")
        self._commands.put_nowait(cmd)

    def check_text(self, text: str) -> None:
        """UnsupportedLanguage if the served model cannot read `text` (streaming.text_support); a no-op before the
        model is loaded. Read-only, any thread; the worker checks each segment again as it prepares it."""
        worker = self._worker
        if worker is not None:
            worker.b.check_text(text)

    async def check_texts(self, texts: Sequence[str]) -> None:
        """check_text for each of `texts` (the gateway's interface, streaming.engine_api: a remote engine answers it
        in one round trip)."""
        for text in texts:
            self.check_text(text)

    def _prepare(self, cmd: Speak) -> Speak:
        """Normalise and tokenise a segment's text here, on the caller's thread, instead of in the worker's turn
        (~0.4 ms a segment on a 2-core CPU; on the H200, 58–72 segments starting in one turn took 32–35 ms).
        Text that fails here is left to the worker, which reports the error to its session as before."""
        worker = self._worker
        if worker is None or cmd.prepared is not None:
            return cmd
        try:
            prepared = worker.b.prepare_segment(cmd.text)
        except Exception:
            return cmd
        return dataclasses.replace(cmd, prepared=prepared)

    async def run_job(self, fn: Callable[[Worker], T]) -> T:
        """Run fn(worker) on the worker thread (between steps) and await its result."""
        if self.state not in (EngineState.READY, EngineState.DRAINING):
            raise NotReady(f"the engine is {self.state.value}")
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        worker = self._worker
        assert worker is not None

        def job() -> None:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(worker))
                except Exception as e:
                    future.set_exception(e)

        self._send(job)
        return await asyncio.wrap_future(future)

    async def encode_reference(self, audio: np.ndarray, sample_rate_hz: int) -> np.ndarray:
        """Encode reference audio on a helper thread, off the decode loop's critical path (its own encoder)."""
        if self.state not in (EngineState.READY, EngineState.DRAINING):
            raise NotReady(f"the engine is {self.state.value}")
        worker = self._worker
        assert worker is not None
        if self._pending_encodes >= MAX_PENDING_ENCODES:
            raise Overloaded(f"{MAX_PENDING_ENCODES} reference encodes are already waiting; retry later")
        self._pending_encodes += 1
        try:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._encoder, worker.b.encode_reference, audio, sample_rate_hz)
        finally:
            self._pending_encodes -= 1

    def gpu_memory_bytes(self) -> int:
        w = self._worker
        return w.b.gpu_memory_bytes() if w is not None else 0

    def stats(self) -> dict[str, Any]:
        w = self._worker
        if w is None:
            return {"state": self.state.value}
        s = w.stats
        return {
            "state": self.state.value,
            "sessions": len(self._sessions),
            "decoding": w.rows.active,
            # the last decode step's batch bucket and attention-length bucket (every row's keys are read up to it)
            "step_batch_bucket": w.b.stepper.last_bucket[0],
            "step_length_bucket": w.b.stepper.last_bucket[1],
            "prefill_queue": len(w.prefill_queue),
            "command_queue": self._commands.qsize(),
            "steps": s.steps,
            "frames": s.frames,
            "prefill_tokens": s.prefill_tokens,
            "vocoded_frames": s.vocoded_frames,
            "errors": s.errors,
            "prefill_holds": s.prefill_holds,
            "refills": s.refills,
            # decoding turns in which streams far ahead of their clients sat out (--pace-lead-s), and the frames not
            # made in them (one per stream and turn)
            "paced_turns": s.paced_turns,
            "paced_rows": s.paced_rows,
            "tails_deferred": s.tails_deferred,  # segment tails left for a later turn, once for each turn they wait
            # turns longer than two frames of audio (each set every stream back; logged with their phases)
            "slow_turns": s.slow_turns,
            "turn_max_seconds": round(s.turn_max_s, 4),
            **self.gc_pauses.stats(),
            "turns": s.turns,
            "turn_seconds": round(s.turn_s, 3),
            "prefill_seconds": round(s.prefill_s, 3),
            "step_seconds": round(s.step_s, 3),
            "vocode_seconds": round(s.vocode_s, 3),
            # an utterance's way to its first audio on the worker, summed (÷ first_audio_utterances: the mean): its
            # first segment waiting to start, its prompt to the first frame, decoding and vocoding the first chunk
            "first_audio_utterances": s.first_audio_utterances,
            "first_audio_wait_seconds": round(s.first_audio_wait_s, 3),
            "first_audio_prefill_seconds": round(s.first_audio_prefill_s, 3),
            "first_audio_decode_seconds": round(s.first_audio_decode_s, 3),
            "vocode_calls": w.b.vocode_calls,
            "vocode_frames_run": w.b.vocode_frames_run,  # ≥ vocoded_frames: the difference is graph padding
            # the GPU's time on the turns' prompt passes and first frames, steps and vocoder calls (the vocoder's beside
            # the step when it runs there; streaming.device_times), and the vocoder's graphs' time alone at capture
            **{f"{part}_device_seconds": round(w.b.device_times.seconds[part], 4) for part in DEVICE_PARTS},
            "vocode_graph_seconds": round(w.b.vocode_graph_ms / 1e3, 4),
            # vocoder calls run on another batch bucket's graph than their own: that one replayed slower (GPU)
            "vocode_rerouted_calls": w.b.vocoder_graphs.rerouted_calls if w.b.vocoder_graphs is not None else 0,
            # decode steps run in a larger batch bucket than their own: that one replayed faster at capture (GPU)
            "decode_routed_steps": w.b.stepper.routed_steps,
            # graphs captured so far (start-up, idle time, first use: a level that grows it paid captures in turns)
            # and prompt passes that fit no static prefill bucket and ran eagerly (GPU: ~0.1 s each)
            "graphs_captured": w.b.graphs_captured(),
            "prefill_eager_calls": w.b.stepper.eager_prefills,
            # running average of decoding turns (streaming.realtime_admission) and whether new sessions wait on it
            "turn_avg_seconds": round(w.admission.turn_avg_s, 4),
            "behind_real_time": int(w.admission.behind_now()),
            # streams with work that --admission-turn-fraction's limit allows, estimated from the last turns (0: none)
            "admission_capacity": round(w.admission.capacity() or 0.0, 1),
            "admission_waiting": self.admission_waiting,  # sessions waiting in admit() for the capacity to grow
            "headroom": self.headroom(),  # sessions it would take now (what a pool of engines routes by)
            # graphs still to be captured in idle time; until 0, a burst may pay captures inside its turns
            "graphs_missing": w.b.graphs_missing,
            # start-up by phase (load_weights, capture_graphs — decode graphs and their compiles, split into
            # capture_decode_static/_symbolic/_eager and capture_first_frames on a GPU —, warm_up — the one-row
            # vocoder and prefill graphs —, gc_freeze, total): the "engine ready" log line's figures, here too
            # because benchmarks run the server at --log-level warning
            **{f"startup_{phase}_seconds": round(sec, 3) for phase, sec in self.timings_s.items()},
            # start-up's compiles: inductor graphs loaded from the on-disk cache, generated, uncacheable, and launch
            # configurations benchmarked by coordinate-descent tuning (0 on a warm start that found its results)
            **{f"startup_compile_{name}": n for name, n in self.startup_compile.items()},
        }


def _warm_up(worker: Worker, timings_s: dict[str, float]) -> None:
    """Push one short utterance through prefill, decode and every vocoder chunk size on the worker thread; its parts'
    seconds go to `timings_s` as warm_up_prompt, warm_up_steps and warm_up_vocoder (each synchronised on a GPU)."""
    from .backend import RowSampling
    from .chunking import all_chunk_sizes

    b = worker.b
    tokens = b.segment_tokens(b.model_text(WARM_UP_TEXT))
    # free session rows (nothing is admitted before READY): two where there are and their graphs were captured up
    # front, so that the batched prefill and first-frame paths run too. The lowest rows, so that the step runs their
    # small bucket: the top rows made it run the largest one, whose graph --graphs-up-front leaves to idle time (H200:
    # a warm-up of 8.9 s, capturing it, in a 23.6 s warm start)
    rows = list(range(min(2, b.config.max_sessions, b.config.graphs_up_front or 2)))
    for row in rows:
        b.set_sampling(row, RowSampling(0.7, 0.7, 1.2, seed=0))
    t0 = time.perf_counter()
    logits, hidden = b.prefill_many(rows, [tokens] * len(rows), [0] * len(rows))
    b.start_segments(rows, logits, hidden, [tokens.shape[1]] * len(rows))
    t0 = _part_done(b, timings_s, "warm_up_prompt", t0)
    commit = [r in rows for r in range(max(rows) + 1)]
    for _ in range(4):
        b.step(len(commit), commit, tokens.shape[1] + 4)
    t0 = _part_done(b, timings_s, "warm_up_steps", t0)
    nc = b.info.num_codebooks
    for size in all_chunk_sizes():  # one row at every chunk size: each has its own graph
        b.vocode([0], [np.zeros((nc, size), dtype=np.int64)])
    b.reset_vocoder(0)
    _part_done(b, timings_s, "warm_up_vocoder", t0)
    for row in rows:
        b.set_row_position(row, 0)


def _part_done(b: Backend, timings_s: dict[str, float], part: str, t0: float) -> float:
    """Record `part`'s seconds since `t0` once the device has finished its work; returns the time now."""
    b.synchronize()
    now = time.perf_counter()
    timings_s[part] = now - t0
    return now

"""The worker loop: the one thread that touches the model. Continuous batching of every session's segments.

Each turn: apply commands (new text, end, cancel, close), write at most one prefill chunk (so running streams
never wait more than one chunk), advance every decoding row by one frame in one batched step (one graph replay on
GPU, one small device→host copy), then vocode every stream whose queue reached its next chunk size, batched.
Backpressure: a stream whose client has more than `max_undelivered_s` of audio unread stops advancing (its row
computes and discards); after `stall_timeout_s` it is closed. Pacing: while another stream needs audio soon, a stream
more than `pace_lead_s` ahead of its client's playback sits out turns the same way. One stream's failure never stops
the others.
"""

from __future__ import annotations

import collections
import hashlib
import heapq
import logging
import queue
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from .backend import Backend, RowSampling, history_is_append
from .chunking import MIN_REFILL_FRAMES, ChunkSchedule, Latency, refill_size, split_tail
from .errors import EngineFault, FishgateError, IncompatibleVoice, Overloaded, PromptTooLong
from .gc_pauses import GcPauses, freeze_new_objects, freeze_startup_objects
from .realtime_admission import RealtimeAdmission
from .rows import RowTable
from .session import (
    AudioChunk,
    Cancel,
    Cancelled,
    Close,
    EndUtterance,
    Outbox,
    SegmentDone,
    Session,
    SessionError,
    Speak,
    UtteranceDone,
)
from .stream_state import FirstAudioMarks, Phase, PrefillJob, Segment, Stream

log = logging.getLogger(__name__)

# A turn longer than this many frames of audio set every running stream back by as much: it is counted, and logged
# with where its time went (a warning at most every SLOW_TURN_LOG_S, with the count of those not logged). Run 16 (H200,
# 384 streams) saw turns averaging 173 ms for a second with nothing in the phase totals to say why.
SLOW_TURN_FRAMES = 2.0
SLOW_TURN_LOG_S = 1.0
# A schedule's larger chunk is sent only if the client's buffer lasts this many times its decoding time (turn jitter).
GROWTH_MARGIN = 1.25
# Pacing (WorkerLimits.pace_lead_s) applies while a stream needs audio soon: its prompt is queued or being written,
# or it decodes with less than this much audio ahead of its client (0 before its first chunk).
PACE_NEEDY_S = 0.5


@dataclass(frozen=True, slots=True)
class WorkerLimits:
    # a prompt is written in chunks of this many tokens, one chunk per turn; 256 is also the largest chunk of the
    # graph-captured prefill (BackendConfig.graph_prefill): larger chunks would run eagerly
    prefill_chunk_tokens: int = 256
    # tokens written per turn, over all prompts (one batched call); None: one chunk where the backend prefills row
    # by row (batch-invariant, CPU), four where it runs prompts as one batch
    prefill_tokens_per_turn: int | None = None
    # While streams decode, a turn's prompt writing (prefill and first frames) may take about this share of the
    # decode step's time: the token budget above shrinks to what the measured seconds per prefilled token allow (at
    # least one prompt chunk a turn), so running streams are not stalled by more than a step's worth of prefill.
    # H200 run 17: 1,024-token turns took 49–92 ms against 10–27 ms steps. None (the default until measured on a
    # GPU; `--prefill-step-share`) = the token budget alone.
    prefill_step_share: float | None = None
    max_undelivered_s: float = 20.0  # unread audio per session before its stream stalls
    stall_timeout_s: float = 30.0  # a stalled stream is closed after this long
    idle_wait_s: float = 0.05  # how long an idle worker blocks on the command queue
    # a graph still missing is captured in idle time only once the worker has had no work for this long: a capture
    # blocks the worker for tens of ms, and a request that arrives during one waits for it. Run 9 (H200, graph
    # prefill): captures at every gap between back-to-back requests cost each one 40-70 ms of first audio
    idle_capture_after_s: float = 0.5
    # A stream whose client buffer (audio sent minus real time since its first chunk) fell below this gets the frames
    # it has queued (at least MIN_REFILL_FRAMES) at once, in a smaller chunk, instead of waiting for its scheduled
    # size: under load the schedule's growing chunks otherwise arrive after the client ran dry. None = off. Unseeded
    # streams only (chunk boundaries move the last bits of the audio; a seeded stream must not depend on timing).
    refill_below_s: float | None = 0.15
    # Refills per turn, driest streams first: an overloaded engine would otherwise cut every stream's audio into
    # tiny chunks (per-chunk host and vocoder-call costs) while still not keeping up.
    max_refills_per_turn: int = 8
    # While a decoding stream's client buffer is under this, new prompts wait (at most prefill_hold_max_s at a time):
    # running streams keep real time through a burst of arrivals, at the cost of later first audio. None = off.
    prefill_hold_below_s: float | None = 0.1
    prefill_hold_max_s: float = 0.25
    # Pacing: while some stream needs audio soon (PACE_NEEDY_S), decoding streams whose clients have more than this
    # many seconds of audio ahead sit out the turn (their rows compute and discard, as back-pressured ones do). Each
    # frame costs vocoder and host time in the turn it is made; frames for audio seconds ahead of playback lengthen
    # the turns that newcomers' first audio waits on. With nobody needy (a lone batch request) nothing is paced.
    # Codes, chunk boundaries and audio are unchanged: only when frames are made. None = off.
    pace_lead_s: float | None = 1.5
    # "all": any decoding stream under prefill_hold_below_s holds new prompts; "low": only streams of sessions that
    # asked for latency low (their 2-frame first chunk leaves the least audio queued). H200 runs 22-24 without holds:
    # 300 normal-latency streams' p95 first audio 148-187 ms (176-259 ms with them), low-latency streams underran.
    # Run 29 (pacing on): 300 streams p95 123 / 123 ms with "low" against 165 ms with "all" on one machine, 152 ms
    # with "low" on a slower one, no underruns; near capacity (384) "low" underran 2.7 % and 14.5 % (0 % with "all").
    prefill_hold_for: str = "low"
    # Hold a growth step of the chunk schedule (keep sending the previous size) while the client's buffer would not
    # last until the larger chunk is decoded at the current turn time (Worker._held_growth). Unseeded streams only.
    grow_chunks_with_buffer: bool = True
    # Segments whose leftover frames (the tail after the last full chunk) are vocoded per turn, driest clients first;
    # the rest wait a turn (their stream starts its next segment after that). H200 run 17: turns where dozens of
    # segments ended spent 20–133 ms vocoding their tails, stalling every stream. None = all in the turn they end.
    max_tails_per_turn: int | None = 16
    # refuse new sessions while decoding turns average more than this share of a frame's duration, i.e. while the
    # streams already running fall behind real time (streaming.realtime_admission). None = off.
    admission_turn_fraction: float | None = None
    # with the admission on: new sessions admitted between two decoding turns, at most (the rest wait for the next
    # turn in the admission queue), so a wave let in when room opens does not start together. None = no cap.
    admission_per_turn: int | None = None
    # with the admission on: the share of a frame the capacity estimate fits the streams with work into, when it
    # should be tighter than admission_turn_fraction (2/3: what streams whose chunks still grow need). None = the same.
    admission_capacity_fraction: float | None = None

    def __post_init__(self) -> None:
        if self.max_tails_per_turn is not None and self.max_tails_per_turn < 1:
            raise ValueError("max_tails_per_turn must be at least 1 (None: no limit)")
        if self.prefill_step_share is not None and self.prefill_step_share <= 0:
            raise ValueError("prefill_step_share must be positive (None: no time budget)")
        if self.pace_lead_s is not None and self.pace_lead_s <= PACE_NEEDY_S:
            raise ValueError(f"pace_lead_s must be above {PACE_NEEDY_S} s, the lead under which a stream is needy")


@dataclass
class WorkerStats:
    steps: int = 0
    frames: int = 0
    prefill_tokens: int = 0
    vocoded_frames: int = 0
    errors: int = 0
    prefill_holds: int = 0  # turns that held new prompts back for a nearly dry stream
    refills: int = 0  # chunks sent early to a nearly dry stream
    tails_deferred: int = 0  # segment tails left for a later turn (max_tails_per_turn), once for each turn they wait
    paced_turns: int = 0  # decoding turns in which streams far ahead of their clients sat out (pace_lead_s)
    paced_rows: int = 0  # frames not made for that reason, summed over those turns (one per stream and turn)
    # cumulative wall seconds by phase of the loop (where a turn's time goes; exported through /metrics)
    turns: int = 0
    prefill_s: float = 0.0
    step_s: float = 0.0  # inside the batched decode step (device work + its one sync)
    vocode_s: float = 0.0  # inside vocoder calls
    turn_s: float = 0.0  # whole turns (the rest is host bookkeeping)
    slow_turns: int = 0  # turns longer than SLOW_TURN_FRAMES frames of audio (each stream fell behind by that much)
    turn_max_s: float = 0.0  # the longest turn so far
    # where an utterance's first audio goes, summed over utterances (worker side, from its text being applied here):
    # waiting for its first segment to start (an earlier utterance's segments, the turn), its prompt (queue and
    # passes, to the first frame), then decoding and vocoding its first chunk until the audio is posted
    first_audio_utterances: int = 0
    first_audio_wait_s: float = 0.0
    first_audio_prefill_s: float = 0.0
    first_audio_decode_s: float = 0.0


PREFILL_SMOOTHING = 0.2  # weight of the newest call in the step and prefill running averages


def prefill_token_budget(tokens: int, seconds: float, seconds_per_token: float | None) -> int:
    """The prompt tokens a turn may write: `tokens`, or fewer where that would take more than `seconds` at the
    measured `seconds_per_token` (unknown before the first prefill: `tokens`). The caller always writes at least one
    prompt chunk, so a budget under a chunk still makes progress."""
    if seconds_per_token is None or seconds_per_token <= 0:
        return tokens
    return max(1, min(tokens, int(seconds / seconds_per_token)))


class Worker:
    def __init__(self, backend: Backend, commands: queue.Queue, limits: WorkerLimits) -> None:
        self.b = backend
        self.commands = commands
        self.limits = limits
        self.rows = RowTable(backend.session_rows)
        self.streams: dict[int, Stream] = {}
        self.free_slots = list(range(backend.config.max_sessions - 1, -1, -1))
        # host mirror of stepper.pos: each row's write position (= its count of valid KV positions)
        self.row_pos = [0] * backend.stepper.n_rows
        self.prefill_queue: list[int] = []  # session ids, FIFO
        # voice prefixes (system + references) already in a KV row: key → (row, length), least recently used first
        self.prefix_cache: collections.OrderedDict[bytes, tuple[int, int]] = collections.OrderedDict()
        self.free_prefix_rows = list(backend.prefix_rows)
        self.stats = WorkerStats()
        self.outbox = Outbox()  # events for the sessions, handed to their loops after each command and turn phase
        self.rate_hz = backend.info.sample_rate_hz
        self.idle_streams = 0  # set at the end of each turn while admission is on (see turn); read by other threads
        self.admission = RealtimeAdmission(
            backend.info.samples_per_frame / self.rate_hz,
            limits.admission_turn_fraction,
            limits.admission_per_turn,
            limits.admission_capacity_fraction,
        )
        self._prefill_held_since: float | None = None
        self._slow_logged_at = -float("inf")
        self._slow_unlogged = 0
        self._last_step_s = 0.0  # the backend's step call of the current turn (device work and its one sync)
        self._collect_s = 0.0  # of the current turn: waiting for and posting the vocoder's audio inside the step call
        self._step_avg_s = 0.0  # running average of the step calls (the prefill time budget, prefill_step_share)
        self._prefill_s_per_token: float | None = None  # running average of prompt-writing seconds per token
        self._pending_swaps: list[tuple[int, int]] | None = None  # see _apply_swaps
        self.after_turn: Callable[[], None] | None = None  # called at the end of every turn (the admission queue)
        # the collector's timing for the slow-turn log (the engine sets its own; this uninstalled one never counts)
        self.gc_pauses = GcPauses()
        # set by a turn in which no stream could advance (all back-pressured; pacing always leaves one): how long
        # run_forever may wait on the command queue before the next turn (a command ends the wait at once)
        self.nap_s = 0.0
        # segments that ended during the current turn: (stream, what to post once its tail is vocoded), by session
        self._ended: dict[int, tuple[Stream, Callable[[], None]]] = {}
        # vocoder calls launched this turn, in order: (their (stream, frames, advance) entries, what collects the
        # audio); then what to run once all of it is posted (ended segments' events). Never kept across turns.
        self._vocoding: list[tuple[list[tuple[Stream, int, bool]], Callable[[], list[np.ndarray]]]] = []
        self._after_audio: list[tuple[Stream, Callable[[], None]]] = []
        self._vocode_failures: list[tuple[Stream, Exception]] = []  # collected inside a step: failed after it
        # the turn's vocoder work runs beside its prefill and decode step (BackendConfig.vocoder_overlap)
        self.overlap_vocoder = backend.overlap_vocoder

    # ---- sessions ----------------------------------------------------------------------------------------------------
    def add(self, session: Session) -> None:
        if not self.free_slots:  # the engine admits no more sessions than slots; never let a miscount end the worker
            log.error("session %s: no free slot although the engine admitted it; closing it", session.id)
            self.stats.errors += 1
            refusal = SessionError(Overloaded.code, "the engine has no free session slot; retry later", None, True)
            self.outbox.post(session, refusal)
            return
        s = session.settings
        refs = session.voice.references
        try:
            prefix = self.b.prefix_tokens(refs) if refs else None
        except ValueError as e:
            # codes this model cannot read (a voice stored or sent for another codec): this session learns why and
            # closes; the worker, its slots and the other sessions are untouched
            self.stats.errors += 1
            self.outbox.post(session, SessionError(IncompatibleVoice.code, str(e), None, fatal=True))
            return
        stream = Stream(
            session=session,
            slot=self.free_slots.pop(),
            seed=s.seed if s.seed is not None else secrets.randbits(62),
            schedule=ChunkSchedule.for_latency(s.latency),
            prefix=prefix,
        )
        if stream.prefix is not None:
            stream.prefix_key = hashlib.sha256(stream.prefix.numpy().tobytes()).digest()
        row = self.rows.open(session.id)
        self.row_pos[row] = 0
        self.b.stepper.pos[row] = 0
        self.streams[session.id] = stream
        self.b.reset_vocoder(stream.slot)

    def _remove(self, sid: int) -> None:
        st = self.streams.pop(sid, None)
        if st is None:
            return
        if self._pending_swaps is not None:  # device writes by row follow: the rows must be where the table says
            self._flush_swaps()  # (the rest of this step's swaps then apply one by one)
        st.closed = True
        self._ended.pop(sid, None)
        self._apply_swaps(self.rows.deactivate(sid))
        row = self.rows.row[sid]
        self.row_pos[row] = 0
        self.b.stepper.pos[row] = 0  # keep the device position equal to its host mirror
        self.rows.close(sid)
        self.free_slots.append(st.slot)
        if sid in self.prefill_queue:
            self.prefill_queue.remove(sid)

    def _fail(self, st: Stream, err: Exception, *, fatal: bool = False) -> None:
        """Report an error to one stream and put it back to idle (or close it); the others keep running."""
        self.stats.errors += 1
        if isinstance(err, FishgateError) and not isinstance(err, EngineFault):
            code, message = err.code, str(err)
        else:
            code, message = EngineFault.code, "internal error"
            log.error("session %s: unexpected error", st.session.id, exc_info=err)
        utt = st.segment.utterance if st.segment else None
        self._abort_segment(st)
        st.failed_utterances.update(p[0] for p in st.pending)
        if utt is not None:
            st.failed_utterances.add(utt)
        st.pending.clear()
        st.first_audio_marks.clear()  # every utterance it had is failed
        self.outbox.post(st.session, SessionError(code, message, utt, fatal=fatal))
        if fatal:
            self._remove(st.session.id)
        else:
            self._maybe_finish_utterance(st)

    # ---- commands ----------------------------------------------------------------------------------------------------
    def apply(self, cmd: object) -> None:
        if isinstance(cmd, Speak):
            st = self.streams.get(cmd.session)
            if st is not None and cmd.text.strip():
                st.pending.append((cmd.utterance, cmd.text, cmd.prepared))
                if cmd.utterance != st.history_utterance or st.utterance_started_s is None:
                    st.first_audio_marks.setdefault(cmd.utterance, FirstAudioMarks(time.monotonic()))
        elif isinstance(cmd, EndUtterance):
            st = self.streams.get(cmd.session)
            if st is not None:
                st.ended_utterances.add(cmd.utterance)
                self._maybe_finish_utterance(st)
        elif isinstance(cmd, Cancel):
            st = self.streams.get(cmd.session)
            if st is not None:
                in_flight = st.segment.utterance if st.segment is not None else st.tail_utterance
                if in_flight is None or in_flight == cmd.utterance:
                    self._abort_segment(st)
                st.pending = collections.deque(p for p in st.pending if p[0] != cmd.utterance)
                st.ended_utterances.discard(cmd.utterance)
                st.first_audio_marks.pop(cmd.utterance, None)
                self.outbox.post(st.session, Cancelled(cmd.utterance))
        elif isinstance(cmd, Close):
            self._remove(cmd.session)
        elif callable(cmd):
            cmd()  # a job to run on this thread (reference encoding, warm-up)
        self.outbox.flush()

    def _abort_segment(self, st: Stream) -> None:
        """Stop the current segment now: leave the decode batch, forget queued codes, reset the vocoder."""
        sid = st.session.id
        if st.phase is Phase.DECODE:
            self._apply_swaps(self.rows.deactivate(sid))
        if sid in self.prefill_queue:
            self.prefill_queue.remove(sid)
        st.phase = Phase.IDLE
        st.segment, st.prefill = None, None
        self._ended.pop(sid, None)  # a tail not yet vocoded: dropped with the rest of the queued audio
        st.tail_utterance = None
        st.vocoder_queue.clear()
        st.history_utterance = -1  # the next utterance starts fresh (the KV row keeps only the prefix)
        if self.row_pos[self.rows.row[sid]] < st.prefix_len:
            st.prefix_cached = False  # idle-row writes at this row's position would land inside the prefix
        st.stalled_since = None
        self.b.reset_vocoder(st.slot)

    # ---- the loop turn -----------------------------------------------------------------------------------------------
    def has_work(self) -> bool:
        return bool(
            self.rows.active or self.prefill_queue or self._ended or any(s.pending for s in self.streams.values())
        )

    def turn(self) -> None:
        """One scheduling turn (commands are applied by the caller before).

        Serial (`overlap_vocoder` off): start segments, prefill, step, then vocode the chunks the step completed and
        the tails of segments that ended. Overlapped: start segments, queue the vocoder calls for the chunks the
        previous turn's step completed (and its ended segments' tails) on the vocoder's stream, then prefill and
        step on the default stream while they decode; their audio is posted as soon as the step is queued (before
        the host waits for it). A chunk thus goes out at the same point of the device's work, and the device runs the
        two side by side (H200 run 20 at ~297 streams: step + vocoder 25 → 20 ms a turn; they share the GPU). A stream
        whose segment ended starts its next one a turn later than serially (its tail's audio and events are posted
        within the turn after it ended)."""
        t0 = time.perf_counter()
        started = 0
        captured, eager = self.b.graphs_captured(), self.b.stepper.eager_prefills
        gc_s, graph_ms = self.gc_pauses.pause_s, self.b.vocode_graph_ms
        for st in list(self.streams.values()):
            if st.phase is Phase.IDLE and st.pending and st.tail_utterance is None:
                self._start_segment(st)
                started += 1
        calls = self.b.vocode_calls
        t1 = time.perf_counter()
        if self.overlap_vocoder:
            self._vocode_ready()
            self._flush_ended()
        launch_s = time.perf_counter() - t1
        self._collect_s = 0.0
        self._prefill_step()
        t2 = time.perf_counter()
        self.stats.prefill_s += t2 - t1 - launch_s
        rows = self.rows.active
        self._last_step_s = 0.0
        decoded = self._decode_step() if rows else False
        for st, err in self._vocode_failures:
            self._fail(st, err)
        self._vocode_failures.clear()
        t3 = time.perf_counter()
        self._collect_audio()  # overlapped: what no step collected (no rows decoding); serial: nothing
        if not self.overlap_vocoder:
            self._vocode_ready()
            self._collect_audio()  # the chunks go out now, not after the segment tails below
        t4 = time.perf_counter()
        if not self.overlap_vocoder:
            self._flush_ended()
            self._collect_audio()
        self.stats.turns += 1
        t5 = time.perf_counter()
        turn_s = t5 - t0
        self.stats.turn_s += turn_s
        self.stats.turn_max_s = max(self.stats.turn_max_s, turn_s)
        if turn_s > SLOW_TURN_FRAMES * self.admission.frame_s:
            vocode_s = launch_s + self._collect_s + t4 - t3  # overlapped: launching, and waiting for the audio
            phases = {
                "starts": t1 - t0, "prefill": t2 - t1 - launch_s, "step": self._last_step_s,
                "frames and segment ends": t3 - t2 - self._last_step_s - self._collect_s, "vocode": vocode_s,
                "tails": t5 - t4,
            }  # fmt: skip
            counts = {
                "segments started": started, "rows decoding": rows, "vocoder calls": self.b.vocode_calls - calls,
                "prompts queued": len(self.prefill_queue), "graphs captured": self.b.graphs_captured() - captured,
                "eager prompt passes": self.b.stepper.eager_prefills - eager,
                # what the vocoder's graphs took when timed alone at capture, against the vocode phase above
                "ms of vocoder graphs": round(self.b.vocode_graph_ms - graph_ms),
                "ms of GC pauses": round((self.gc_pauses.pause_s - gc_s) * 1e3),
            }  # fmt: skip
            self._note_slow_turn(turn_s, phases, counts)
        if self.b.graphs_captured() != captured:  # a graph captured on first use: keep collections short after it
            freeze_new_objects()
        if decoded:  # not a turn that only waited for back-pressured clients (nap_s)
            self.admission.record_turn(turn_s, rows)
        if self.admission.limit_s is not None:  # sessions with nothing to do: admission counts only the others
            self.idle_streams = sum(1 for st in self.streams.values() if st.phase is Phase.IDLE and not st.pending)
            if self.after_turn is not None:
                self.after_turn()

    def _note_slow_turn(self, turn_s: float, phases: dict[str, float], counts: dict[str, int]) -> None:
        self.stats.slow_turns += 1
        now = time.monotonic()
        if now - self._slow_logged_at < SLOW_TURN_LOG_S:
            self._slow_unlogged += 1
            return
        where = ", ".join(f"{name} {sec * 1e3:.1f}" for name, sec in phases.items())
        what = ", ".join(f"{n} {name}" for name, n in counts.items())
        log.warning(
            "slow turn: %.0f ms (%s ms; %s); %d more slow turns since the last report",
            turn_s * 1e3, where, what, self._slow_unlogged,
        )  # fmt: skip
        self._slow_logged_at, self._slow_unlogged = now, 0

    def _start_segment(self, st: Stream) -> None:
        utt, text, prepared = st.pending.popleft()
        st.start_utterance_history(utt)
        st.segment = Segment(utt, text, 0)  # so a failure below is attributed to this utterance
        s = st.session.settings
        try:
            # normalised and tokenised on the caller's thread (Engine._prepare: ~0.4 ms a segment), else here
            model_text, seg_tokens = prepared if prepared is not None else self.b.prepare_segment(text)
            tokens, start = self._segment_prompt(st, seg_tokens, s.condition_on_previous_chunks)
            prompt_end = start + tokens.shape[1]
            room = self.b.max_seq_len - prompt_end
            if room < 2:
                raise PromptTooLong(
                    f"the text and voice need {prompt_end} positions but the model's context is "
                    f"{self.b.max_seq_len}; send shorter text or a shorter reference"
                )
        except Exception as e:  # bad text or prompt: this stream only
            self._fail(st, e)
            return
        max_frames = min(st.frames_cap(model_text, s.max_new_tokens, self.b.info.max_frames_per_char), room)
        st.history.append(seg_tokens)
        st.segment = Segment(utt, text, max_frames)
        st.prefill = PrefillJob(tokens, start)
        st.prompt_end = prompt_end
        st.phase = Phase.PREFILL
        # The client's buffer ran dry (a pause in the text): start again with a small chunk. That decision reads the
        # clock, and chunk boundaries move the last bit of the audio, so seeded (reproducible) streams skip it.
        if s.seed is None and st.client_buffer_s(self.rate_hz) <= 0:
            st.chunk_index = 0
        self.prefill_queue.append(st.session.id)
        marks = st.first_audio_marks.get(utt)
        if marks is not None and marks.started_at is None:
            marks.started_at = time.monotonic()

    def _segment_prompt(self, st: Stream, seg_tokens: torch.Tensor, condition: bool) -> tuple[torch.Tensor, int]:
        """Tokens to write and where: append to the row when that equals upstream's prompt, else rebuild."""
        parts = [*st.history, seg_tokens]
        if condition and st.history and st.last_frame is not None:
            budget = self.b.builder.history_budget(st.prefix, self.b.history_max_length)
            if history_is_append([p.shape[1] for p in parts], budget):
                last = torch.from_numpy(st.last_frame).to(torch.int32).view(-1, 1)
                return torch.cat([last, seg_tokens], dim=1), st.cache_len
            prompt = self.b.builder.segment_prompt(st.prefix, parts, self.b.history_max_length)
        else:
            prompt = seg_tokens if st.prefix is None else torch.cat([st.prefix, seg_tokens], dim=1)
            if not condition:
                st.history = []  # each segment stands alone
        if st.prefix is not None and not st.prefix_cached:
            self._reuse_prefix(st)
        # reuse the cached prefix when the new prompt starts with it
        if st.prefix_cached and st.prefix is not None and st.cache_len >= st.prefix_len:
            return prompt[:, st.prefix_len :], st.prefix_len
        return prompt, 0

    def _prefill_step(self) -> None:
        """Write queued prompts in chunks of `prefill_chunk_tokens` (boundaries fixed relative to each prompt, so the
        KV values never depend on load), one chunk of each of several prompts per backend call, up to the turn's
        token budget (at least one chunk); prompts that are complete sample their first frame together."""
        if self.prefill_queue and self._hold_prefill():
            self.stats.prefill_holds += 1
            return
        chunk = self.limits.prefill_chunk_tokens
        budget = self.limits.prefill_tokens_per_turn or (chunk if self.b.batch_invariant else 4 * chunk)
        share = self.limits.prefill_step_share
        if share is not None and self.rows.active:
            budget = prefill_token_budget(budget, share * self._step_avg_s, self._prefill_s_per_token)
        batch: list[tuple[Stream, PrefillJob, int]] = []  # (stream, its job, tokens to write now)
        used = 0
        for sid in self.prefill_queue:
            st = self.streams[sid]
            assert st.prefill is not None
            take = min(chunk, st.prefill.remaining)
            if batch and used + take > budget:
                break
            batch.append((st, st.prefill, take))
            used += take
        if not batch:
            return
        rows = [self.rows.row[st.session.id] for st, _, _ in batch]
        t0 = time.perf_counter()
        try:
            logits, hidden = self.b.prefill_many(
                rows,
                [job.tokens[:, job.done : job.done + take] for _, job, take in batch],
                [j.next_pos for _, j, _ in batch],
            )
        except Exception as e:
            for st, _, _ in batch:
                self._fail(st, e)
            return
        finished: list[int] = []  # indices into batch
        for i, ((st, job, take), row) in enumerate(zip(batch, rows, strict=True)):
            job.done += take
            self.stats.prefill_tokens += take
            if st.prefix is not None and job.start_pos == 0 and job.done >= st.prefix_len and not st.prefix_cached:
                st.prefix_cached = True
                self._remember_prefix(st, row)
            self.b.stepper.pos[row] = job.next_pos  # idle decode writes land past the valid positions
            self.row_pos[row] = job.next_pos
            if not job.remaining:
                finished.append(i)
        if finished:
            self._begin_decoding([batch[i][0] for i in finished], logits[finished], hidden[finished])
        per_token = (time.perf_counter() - t0) / used
        self._prefill_s_per_token = (
            per_token
            if self._prefill_s_per_token is None
            else (self._prefill_s_per_token + PREFILL_SMOOTHING * (per_token - self._prefill_s_per_token))
        )

    def _hold_prefill(self) -> bool:
        """Hold new prompts back while a decoding stream's client is nearly dry (its frames come first), for at most
        `prefill_hold_max_s` at a time so that a burst of arrivals still gets in."""
        gate = self.limits.prefill_hold_below_s
        if gate is None or not self.rows.active:
            self._prefill_held_since = None
            return False
        now = time.monotonic()
        low_only = self.limits.prefill_hold_for == "low"
        dry = any(
            st.phase is Phase.DECODE
            and st.utterance_started_s is not None
            and (not low_only or st.session.settings.latency is Latency.LOW)
            and st.client_buffer_s(self.rate_hz, now) < gate
            for st in self.streams.values()
        )
        if not dry:
            self._prefill_held_since = None
            return False
        if self._prefill_held_since is None:
            self._prefill_held_since = now
        return now - self._prefill_held_since < self.limits.prefill_hold_max_s

    def _reuse_prefix(self, st: Stream) -> None:
        """Copy a cached voice prefix into this stream's row instead of prefilling it again."""
        hit = self.prefix_cache.get(st.prefix_key)
        if hit is None:
            return
        src, length = hit
        self.prefix_cache.move_to_end(st.prefix_key)
        row = self.rows.row[st.session.id]
        self.b.copy_prefix(src, row, length)
        self.row_pos[row] = length
        st.prefix_cached = True
        st.cache_len = length

    def _remember_prefix(self, st: Stream, row: int) -> None:
        """Keep a just-prefilled voice prefix in a prefix row (least recently used one evicted)."""
        if st.prefix_key in self.prefix_cache or not self.b.prefix_rows:
            return
        if self.free_prefix_rows:
            dst = self.free_prefix_rows.pop()
        else:
            _, (dst, _) = self.prefix_cache.popitem(last=False)
        self.b.copy_prefix(row, dst, st.prefix_len)
        self.row_pos[dst] = st.prefix_len
        self.prefix_cache[st.prefix_key] = (dst, st.prefix_len)

    def _begin_decoding(self, streams: list[Stream], logits: torch.Tensor, hidden: torch.Tensor) -> None:
        """Streams whose prompts are written: sample their first frames in one call, then join the decode batch."""
        rows = [self.rows.row[st.session.id] for st in streams]
        for st, row in zip(streams, rows, strict=True):
            s = st.session.settings
            self.b.set_sampling(row, RowSampling(s.temperature, s.top_p, s.repetition_penalty, st.seed))
            self.b.set_noise_step(row, st.noise_step)
        frames = self.b.start_segments(rows, logits, hidden, [st.prompt_end for st in streams])
        now = time.monotonic()
        for st, frame in zip(streams, frames, strict=True):
            marks = st.first_audio_marks.get(st.segment.utterance) if st.segment is not None else None
            if marks is not None and marks.started_at is not None and marks.decoding_at is None:
                marks.decoding_at = now
            self.prefill_queue.remove(st.session.id)
            st.prefill = None
            st.noise_step += 1
            st.phase = Phase.DECODE
            self.row_pos[self.rows.row[st.session.id]] = st.prompt_end  # its row may have moved in a swap above
            self._apply_swaps(self.rows.activate(st.session.id))
            self._accept_frame(st, frame)

    def _decode_step(self) -> bool:
        """Advance every active row whose client is not back-pressured; False when none could advance."""
        active = self.rows.active
        owners = [self.rows.owner[r] for r in range(active)]
        streams = [self.streams[sid] for sid in owners if sid is not None]
        assert len(streams) == active, "every active row has an owner"
        now = time.monotonic()
        commit = [not self._stalled(st, now) for st in streams]
        self._pace(streams, commit, now)
        if any(commit):
            bucket, _ = self.b.stepper.bucket_for(active, 0)
            t0 = time.perf_counter()
            collect = self._collect_audio_in_step if self._vocoding else None
            frames = self.b.step(active, commit, max(self.row_pos[:bucket]), collect)
            self._last_step_s = time.perf_counter() - t0 - self._collect_s
            self._step_avg_s += PREFILL_SMOOTHING * (self._last_step_s - self._step_avg_s)
            self.stats.step_s += self._last_step_s
            self.stats.steps += 1
            for r in range(active):
                self.row_pos[r] += commit[r]
            # accepting a frame can end a segment and swap rows, so go by session, not by row; the device side of
            # the swaps waits until every frame is in, then moves all rows at once
            self._pending_swaps = []
            try:
                for r, st in enumerate(streams):
                    if commit[r] and not st.closed:
                        self.stats.frames += 1
                        st.noise_step += 1
                        self._accept_frame(st, frames[r])
            finally:
                self._flush_swaps()
        elif not self.prefill_queue or self._prefill_held_since is not None:
            # everyone is back-pressured (pacing always leaves a stream that needs audio, or a prompt to write): wait
            # on the command queue instead of spinning, so a new request still starts at once
            self.nap_s = self.limits.idle_wait_s
        for st in streams:
            stalled_s = now - st.stalled_since if st.stalled_since is not None else 0.0
            if not st.closed and stalled_s > self.limits.stall_timeout_s:
                log.warning("session %s: client read nothing for %.0f s; closing", st.session.id, stalled_s)
                self._fail(st, _StallTimeout(), fatal=True)
        return any(commit)

    def _pace(self, streams: list[Stream], commit: list[bool], now: float) -> None:
        """Pacing (`pace_lead_s`): clear `commit` for the streams far ahead of their clients while another stream
        needs audio soon (a prompt in the queue, or a stream that advances with under PACE_NEEDY_S ahead)."""
        lead = self.limits.pace_lead_s
        if lead is None:
            return
        ahead = [st.client_buffer_s(self.rate_hz, now) for st in streams]
        if not (self.prefill_queue or any(a < PACE_NEEDY_S for a, c in zip(ahead, commit, strict=True) if c)):
            return
        paced = 0
        for r, a in enumerate(ahead):
            if commit[r] and a >= lead:
                commit[r] = False
                paced += 1
        if paced:
            self.stats.paced_turns += 1
            self.stats.paced_rows += paced

    def _stalled(self, st: Stream, now: float) -> bool:
        if st.session.undelivered_samples / self.rate_hz <= self.limits.max_undelivered_s:
            st.stalled_since = None
            return False
        if st.stalled_since is None:
            st.stalled_since = now
        return True

    def _accept_frame(self, st: Stream, frame: np.ndarray) -> None:
        seg = st.segment
        assert seg is not None
        seg.append(frame)
        ended_by = None
        if int(frame[0]) == self.b.im_end_id:
            ended_by = "end_token"
        else:
            st.vocoder_queue.append(frame[1:].copy())
            if seg.count >= seg.max_frames:
                ended_by = "max_new_tokens"
            audio_s = (st.utterance_samples + len(st.vocoder_queue) * self.b.info.samples_per_frame) / self.rate_hz
            if audio_s >= st.session.settings.max_audio_s:
                ended_by = "max_audio"
        if ended_by is not None:
            self._end_segment(st, ended_by)

    def _end_segment(self, st: Stream, ended_by: str) -> None:
        seg = st.segment
        assert seg is not None
        sid = st.session.id
        frames = seg.frames  # (n, 1+nc)
        gen = torch.from_numpy(np.ascontiguousarray(frames.T, dtype=np.int32))  # (1+nc, n), a copy
        st.history.append(gen)
        st.last_frame = frames[-1].copy()
        st.cache_len = st.prompt_end + seg.count - 1
        self._apply_swaps(self.rows.deactivate(sid))
        st.phase = Phase.IDLE
        spoken = frames[frames[:, 0] != self.b.im_end_id, 1:]  # (n', nc), a copy
        codes = np.ascontiguousarray(spoken.T) if len(spoken) else np.zeros((self.b.info.num_codebooks, 0), np.int64)
        done = SegmentDone(seg.utterance, seg.text, len(spoken), ended_by, codes)
        st.segment = None
        if ended_by == "max_audio":
            st.pending = collections.deque(p for p in st.pending if p[0] != seg.utterance)
            st.ended_utterances.add(seg.utterance)

        def after_tail() -> None:  # the events follow the segment's last audio
            self.outbox.post(st.session, done)
            if ended_by == "max_audio":
                self._maybe_finish_utterance(st, reason="max_audio", utterance=done.utterance)
            else:
                self._maybe_finish_utterance(st)

        st.tail_utterance = seg.utterance
        self._ended[sid] = (st, after_tail)  # its queued frames are vocoded at the end of this turn (or a later one)

    def _maybe_finish_utterance(self, st: Stream, reason: str = "stop", utterance: int | None = None) -> None:
        """Post UtteranceDone for every ended utterance whose work is over, in utterance order: one still speaking
        holds back the later ones (an empty utterance ended meanwhile must not finish before that audio). `reason`
        is for `utterance` (all of them when None); the others finished here stopped normally."""
        for utt in sorted(st.ended_utterances):
            in_flight = (st.segment is not None and st.segment.utterance == utt) or st.tail_utterance == utt
            if in_flight or any(p[0] == utt for p in st.pending):
                break
            st.ended_utterances.discard(utt)
            st.first_audio_marks.pop(utt, None)  # one that ended without audio
            samples = st.utterance_samples if st.history_utterance == utt else 0
            why = reason if utterance is None or utt == utterance else "stop"
            if utt in st.failed_utterances:
                st.failed_utterances.discard(utt)
                why = "error"
            self.outbox.post(st.session, UtteranceDone(utt, why, samples))

    # ---- vocoder -----------------------------------------------------------------------------------------------------
    def _vocode_ready(self) -> None:
        batch: list[tuple[Stream, int, bool]] = []
        low: list[tuple[float, Stream]] = []  # (client buffer s, stream) of refill candidates
        refill_below_s = self.limits.refill_below_s
        now = time.monotonic()
        for st in self.streams.values():
            size = st.schedule.size(st.chunk_index)
            queued = len(st.vocoder_queue)
            if queued >= size:
                batch.append((st, size, True))
            elif held := self._held_growth(st, size, queued, now):
                batch.append((st, held, False))  # the smaller size again; the schedule keeps its place
            elif (
                refill_below_s is not None
                and queued >= MIN_REFILL_FRAMES
                and st.session.settings.seed is None
                and st.utterance_started_s is not None
            ):
                buffer_s = st.client_buffer_s(self.rate_hz, now)
                if buffer_s < refill_below_s:
                    low.append((buffer_s, st))
        if len(low) > self.limits.max_refills_per_turn:  # the driest first; the rest wait for their scheduled chunk
            low = heapq.nsmallest(self.limits.max_refills_per_turn, low, key=lambda item: item[0])
        batch += [(st, refill_size(len(st.vocoder_queue)), False) for _, st in low]  # the next chunk is still `size`
        self.stats.refills += len(low)
        self._vocode(batch)

    def _held_growth(self, st: Stream, size: int, queued: int, now: float) -> int:
        """Where the schedule grows the next chunk (say 8 → 16 frames) but the client's buffer would run dry before
        the larger chunk is decoded at the current turn time, the previous size now instead (0: no such chunk).
        The fixed schedules keep a client ahead only while a turn takes under 2/3 of a frame (chunking.py,
        `sustainable_turn_fraction`); near real time — the load an admission limit of 0.9 lets in — every growth
        step ran the client dry (H200 run 16: 80–89 % of streams, once each). Unseeded streams only, like refills."""
        if not self.limits.grow_chunks_with_buffer or st.chunk_index == 0 or st.utterance_started_s is None:
            return 0
        previous = st.schedule.size(st.chunk_index - 1)
        turn_s = self.admission.turn_avg_s
        if size <= previous or queued < previous or turn_s <= 0 or st.session.settings.seed is not None:
            return 0
        if st.client_buffer_s(self.rate_hz, now) >= GROWTH_MARGIN * (size - queued) * turn_s:
            return 0  # the larger chunk will be there in time
        return previous

    def _flush_ended(self) -> None:
        """Vocode the queued frames of segments that ended, in chunk sizes with captured graphs: the k-th piece of
        every such stream in one call (a burst of streams ending together costs a few calls, not a few per stream);
        each segment's events are posted after its audio (`_collect_audio`). At most `max_tails_per_turn` segments
        a turn, driest clients first."""
        ended = list(self._ended.values())
        cap = self.limits.max_tails_per_turn
        if cap is not None and len(ended) > cap:
            now = time.monotonic()
            ended = heapq.nsmallest(cap, ended, key=lambda e: e[0].client_buffer_s(self.rate_hz, now))
            self.stats.tails_deferred += len(self._ended) - cap
        for st, _ in ended:
            del self._ended[st.session.id]
            st.tail_utterance = None
        pieces = {st.session.id: split_tail(len(st.vocoder_queue)) for st, _ in ended}
        for k in range(max((len(p) for p in pieces.values()), default=0)):
            self._vocode([(st, pieces[st.session.id][k], True) for st, _ in ended if k < len(pieces[st.session.id])])
        self._after_audio += ended

    def _vocode(self, batch: list[tuple[Stream, int, bool]]) -> None:
        """Launch the vocoding of (stream, frames, advance the chunk schedule) entries in one backend call (none: no
        call); `_collect_audio` posts the audio."""
        batch = [entry for entry in batch if not entry[0].closed]
        if not batch:
            return
        slots, codes = [], []
        for st, size, _ in batch:
            slots.append(st.slot)
            codes.append(np.stack(st.vocoder_queue[:size], axis=1))  # (nc, F)
            del st.vocoder_queue[:size]
        t0 = time.perf_counter()
        try:
            collect = self.b.vocode_launch(slots, codes)
        except Exception as e:
            for st, _, _ in batch:
                self._fail(st, e)
            return
        finally:
            self.stats.vocode_s += time.perf_counter() - t0
        self._vocoding.append((batch, collect))

    def _collect_audio_in_step(self) -> None:
        """`_collect_audio` while the decode step runs: rows must not move before its frames are in, so a failed
        call's streams fail after the step (turn)."""
        t0 = time.perf_counter()
        self._collect_audio(self._vocode_failures)
        self._collect_s += time.perf_counter() - t0

    def _collect_audio(self, failures: list[tuple[Stream, Exception]] | None = None) -> None:
        """Post the audio of every vocoder call launched this turn, in launch order, then the ended segments'
        events; a failed call fails its streams (now, or by adding them to `failures`)."""
        t0 = time.perf_counter()
        vocoding, self._vocoding = self._vocoding, []
        for batch, collect in vocoding:
            try:
                pcm = collect()
            except Exception as e:
                for st, _, _ in batch:
                    if failures is None:
                        self._fail(st, e)
                    else:
                        failures.append((st, e))
                continue
            now = time.monotonic()
            for (st, size, advance), audio in zip(batch, pcm, strict=True):
                if st.closed:  # closed since the launch (its client stalled past the timeout in this turn's step)
                    continue
                st.chunk_index += advance  # a refill keeps the schedule's place
                self.stats.vocoded_frames += size
                st.count_sent_audio(len(audio), self.rate_hz, now)
                utt = st.segment.utterance if st.segment is not None else st.history_utterance
                self._note_first_audio(st, utt, now)
                self.outbox.post(st.session, AudioChunk(utt, audio))
        self.stats.vocode_s += time.perf_counter() - t0
        self.outbox.flush()
        after, self._after_audio = self._after_audio, []
        for st, after_tail in after:
            if not st.closed:
                after_tail()
        self.outbox.flush()

    def _note_first_audio(self, st: Stream, utterance: int, now: float) -> None:
        """An utterance's audio is posted: the first time, add its way there to the first-audio sums."""
        marks = st.first_audio_marks.pop(utterance, None)
        if marks is None or marks.started_at is None or marks.decoding_at is None:  # already counted, or not measured
            return
        s = self.stats
        s.first_audio_utterances += 1
        s.first_audio_wait_s += marks.started_at - marks.text_at
        s.first_audio_prefill_s += marks.decoding_at - marks.started_at
        s.first_audio_decode_s += now - marks.decoding_at

    # ---- rows --------------------------------------------------------------------------------------------------------
    def _apply_swaps(self, swaps: list[tuple[int, int]]) -> None:
        """Mirror RowTable swaps on the device; row_pos[r] is also the count of valid KV positions of row r. While a
        step's frames are accepted (`_pending_swaps` is a list) the device part waits for `_flush_swaps`, which
        moves every row of the turn's swaps at once."""
        for a, b in swaps:
            if self._pending_swaps is not None:
                self._pending_swaps.append((a, b))
            else:
                self.b.swap_rows(a, b, self.row_pos[a], self.row_pos[b])
            self.row_pos[a], self.row_pos[b] = self.row_pos[b], self.row_pos[a]

    def _flush_swaps(self) -> None:
        """The deferred swaps as one permutation of rows (Backend.permute_rows): run 16 on the H200 saw steps of
        45–114 ms in turns where dozens of segments ended, each swapping rows through a spare (~33 device ops)."""
        swaps, self._pending_swaps = self._pending_swaps or [], None
        holds: dict[int, int] = {}  # row → the row whose stream it holds now
        for a, b in swaps:
            holds[a], holds[b] = holds.get(b, b), holds.get(a, a)
        moved = [(dst, src) for dst, src in holds.items() if dst != src]
        if moved:
            length = max(self.row_pos[dst] for dst, _ in moved)  # the mirror is already permuted
            self.b.permute_rows([d for d, _ in moved], [s for _, s in moved], length)


class _StallTimeout(FishgateError):
    code = "client_too_slow"

    def __init__(self) -> None:
        super().__init__("the client stopped reading audio; the session was closed (read audio as it arrives)")


def run_forever(worker: Worker, stop: Callable[[], bool]) -> None:
    """The worker thread's body after start-up: apply commands, take turns, until `stop()`."""
    busy_at = time.monotonic()  # when the worker last had work or a command
    while not stop():
        block = not worker.has_work()
        if not block:
            busy_at = time.monotonic()
        elif (
            worker.commands.empty()
            and time.monotonic() - busy_at >= worker.limits.idle_capture_after_s
            and worker.b.capture_idle_graph(worker.row_pos)
        ):
            # exempt what the capture built from later collections (a full collection once the last one is in)
            if worker.b.graphs_missing == 0:
                freeze_startup_objects()
            else:
                freeze_new_objects()
            continue  # idle a while: one more graph instead of a nap (cold start captured only the small ones)
        nap_s, worker.nap_s = worker.nap_s, 0.0  # the last turn could advance nobody: wait, but not past a command
        try:
            wait_s = worker.limits.idle_wait_s if block else nap_s
            cmd = worker.commands.get(timeout=wait_s) if wait_s > 0 else worker.commands.get_nowait()
            busy_at = time.monotonic()
            worker.apply(cmd)
            while True:
                worker.apply(worker.commands.get_nowait())
        except queue.Empty:
            pass
        try:
            worker.turn()
        finally:  # what a failing turn had posted still reaches its sessions
            worker.outbox.flush()

"""The worker loop: the one thread that touches the model. Continuous batching of every session's segments.

Each turn: apply commands (new text, end, cancel, close), write a budget of prompt chunks (so running streams never
wait long), advance every decoding row by one frame in one batched step (one graph replay on GPU, one small
device→host copy), then vocode every stream whose queue reached its next chunk size, batched. One stream's failure
never stops the others.

The worker owns the sessions' side: commands, each stream's segments and utterances, and the events posted to
sessions. It asks `streaming.scheduler` what each phase of the turn does (prompts, step, vocoder, tails) and has
`streaming.executor` carry it out on the model; it never touches device state itself.
"""

from __future__ import annotations

import collections
import hashlib
import logging
import queue
import secrets
import time
from collections.abc import Callable

import numpy as np
import torch

from . import turn_stats
from .backend import Backend
from .chunking import ChunkSchedule, split_tail
from .config import WorkerLimits
from .errors import EngineFault, FishgateError, IncompatibleVoice, Overloaded, PromptTooLong
from .executor import Executor
from .gc_pauses import GcPauses, freeze_new_objects, freeze_startup_objects
from .scheduler import Scheduler
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
from .turn_stats import SlowTurns, WorkerStats

log = logging.getLogger(__name__)


class Worker:
    def __init__(self, backend: Backend, commands: queue.Queue, limits: WorkerLimits) -> None:
        self.b = backend
        self.commands = commands
        self.limits = limits
        self.executor = Executor(backend)
        self.rate_hz = backend.info.sample_rate_hz
        self.scheduler = Scheduler(
            limits,
            frame_s=backend.info.samples_per_frame / self.rate_hz,
            rate_hz=self.rate_hz,
            batch_invariant=backend.batch_invariant,
        )
        self.admission = self.scheduler.admission
        self.rows = self.executor.rows
        self.streams: dict[int, Stream] = {}
        self.free_slots = list(range(backend.config.max_sessions - 1, -1, -1))
        self.prefill_queue: list[int] = []  # session ids, FIFO
        self.stats = WorkerStats()
        self.slow_turns = SlowTurns(self.stats)
        self.outbox = Outbox()  # events for the sessions, handed to their loops after each command and turn phase
        self.idle_streams = 0  # set at the end of each turn while admission is on (see turn); read by other threads
        self._last_step_s = 0.0  # the backend's step call of the current turn (device work and its one sync)
        self._collect_s = 0.0  # of the current turn: waiting for and posting the vocoder's audio inside the step call
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

    @property
    def row_pos(self) -> list[int]:
        return self.executor.row_pos

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
        self.executor.open_row(session.id)
        self.streams[session.id] = stream
        self.b.reset_vocoder(stream.slot)

    def _remove(self, sid: int) -> None:
        st = self.streams.pop(sid, None)
        if st is None:
            return
        st.closed = True
        self._ended.pop(sid, None)
        self.executor.close_row(sid)
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
            self.executor.leave_batch(sid)
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
        two side by side (H200 at ~297 streams: step + vocoder 25 → 20 ms a turn; they share the GPU). A stream
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
            self._flush_tails()
        launch_s = time.perf_counter() - t1
        self._collect_s = 0.0
        self._prefill()
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
            self._flush_tails()
            self._collect_audio()
        self.stats.turns += 1
        t5 = time.perf_counter()
        turn_s = t5 - t0
        self.stats.turn_s += turn_s
        self.stats.turn_max_s = max(self.stats.turn_max_s, turn_s)
        if turn_s > turn_stats.SLOW_TURN_FRAMES * self.admission.frame_s:
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
            self.slow_turns.note(turn_s, phases, counts)
        if self.b.graphs_captured() != captured:  # a graph captured on first use: keep collections short after it
            freeze_new_objects()
        if decoded:  # not a turn that only waited for back-pressured clients (nap_s)
            self.admission.record_turn(turn_s, rows)
        if self.admission.limit_s is not None:  # sessions with nothing to do: admission counts only the others
            self.idle_streams = sum(1 for st in self.streams.values() if st.phase is Phase.IDLE and not st.pending)
            if self.after_turn is not None:
                self.after_turn()

    def _start_segment(self, st: Stream) -> None:
        utt, text, prepared = st.pending.popleft()
        st.start_utterance_history(utt)
        st.segment = Segment(utt, text, 0)  # so a failure below is attributed to this utterance
        s = st.session.settings
        try:
            # normalised and tokenised on the caller's thread (Engine._prepare: ~0.4 ms a segment), else here
            model_text, seg_tokens = prepared if prepared is not None else self.b.prepare_segment(text)
            tokens, start = self.executor.segment_prompt(st, seg_tokens, s.condition_on_previous_chunks)
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

    def _prefill(self) -> None:
        """Write the prompt chunks the scheduler plans; prompts that are complete sample their first frame together
        and join the decode batch."""
        if not self.prefill_queue:
            return
        queued = [self.streams[sid] for sid in self.prefill_queue]
        plan = self.scheduler.plan_prefill(queued, self.streams.values(), self.rows.active, time.monotonic())
        if plan.held:
            self.stats.prefill_holds += 1
        if not plan.batch:
            return
        try:
            logits, hidden = self.executor.write_prompts(plan.batch)
        except Exception as e:
            for st, _ in plan.batch:
                self._fail(st, e)
            return
        used = sum(take for _, take in plan.batch)
        self.stats.prefill_tokens += used
        finished = [i for i, (st, _) in enumerate(plan.batch) if st.prefill is not None and not st.prefill.remaining]
        if finished:
            self._begin_decoding([plan.batch[i][0] for i in finished], logits[finished], hidden[finished])

    def _begin_decoding(self, streams: list[Stream], logits: torch.Tensor, hidden: torch.Tensor) -> None:
        """Streams whose prompts are written: sample their first frames in one call, then join the decode batch."""
        frames = self.executor.start_segments(streams, logits, hidden)
        now = time.monotonic()
        for st, frame in zip(streams, frames, strict=True):
            marks = st.first_audio_marks.get(st.segment.utterance) if st.segment is not None else None
            if marks is not None and marks.started_at is not None and marks.decoding_at is None:
                marks.decoding_at = now
            self.prefill_queue.remove(st.session.id)
            st.prefill = None
            st.noise_step += 1
            st.phase = Phase.DECODE
            self.executor.join_batch(st)
            self._accept_frame(st, frame)

    def _decode_step(self) -> bool:
        """Advance every active row the scheduler lets step; False when none could advance."""
        active = self.rows.active
        owners = [self.rows.owner[r] for r in range(active)]
        streams = [self.streams[sid] for sid in owners if sid is not None]
        assert len(streams) == active, "every active row has an owner"
        plan = self.scheduler.plan_step(streams, bool(self.prefill_queue), time.monotonic())
        if plan.paced:
            self.stats.paced_turns += 1
            self.stats.paced_rows += plan.paced
        if any(plan.commit):
            t0 = time.perf_counter()
            collect = self._collect_audio_in_step if self._vocoding else None
            frames = self.executor.step(plan.commit, collect)
            self._last_step_s = time.perf_counter() - t0 - self._collect_s
            self.stats.step_s += self._last_step_s
            self.stats.steps += 1
            # accepting a frame can end a segment and swap rows, so go by session, not by row; the device side of
            # the swaps waits until every frame is in, then moves all rows at once
            with self.executor.swaps_deferred():
                for r, st in enumerate(streams):
                    if plan.commit[r] and not st.closed:
                        self.stats.frames += 1
                        st.noise_step += 1
                        self._accept_frame(st, frames[r])
        elif plan.nap:
            self.nap_s = self.limits.idle_wait_s
        for st, stalled_s in plan.timed_out:
            if not st.closed:
                log.warning("session %s: client read nothing for %.0f s; closing", st.session.id, stalled_s)
                self._fail(st, _StallTimeout(), fatal=True)
        return any(plan.commit)

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
        self.executor.leave_batch(sid)
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
        plan = self.scheduler.plan_vocode(self.streams.values(), time.monotonic())
        self.stats.refills += plan.refills
        self._vocode(plan.chunks)

    def _flush_tails(self) -> None:
        """Vocode the queued frames of segments that ended (the ones the scheduler picks this turn), in chunk sizes
        with captured graphs: the k-th piece of every such stream in one call (a burst of streams ending together
        costs a few calls, not a few per stream); each segment's events are posted after its audio."""
        if not self._ended:
            return
        chosen = self.scheduler.plan_tails([st for st, _ in self._ended.values()], time.monotonic())
        self.stats.tails_deferred += len(self._ended) - len(chosen)
        ended = [self._ended.pop(st.session.id) for st in chosen]
        for st, _ in ended:
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
        t0 = time.perf_counter()
        try:
            collect = self.executor.launch_vocode(batch)
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

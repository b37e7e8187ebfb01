"""The worker's policies, apart from the work: which prompts are written, which rows step, which audio is vocoded,
and who waits. Pure Python: importing it imports no torch, and nothing here touches the device.

A turn is a pipeline of three phases, each planned on the state the phase before left: prompts are written (a prompt
that completes joins the decode batch), the batch steps one frame, then queued frames are vocoded (with a GPU
vocoder overlapped, the chunks the previous step completed go first). The worker asks the scheduler at each phase
(`plan_prefill`, `plan_step`, `plan_vocode`, `plan_tails`) and the executor carries the plan out on the model.

Policies:
- Prompt budget: a turn writes up to `prefill_tokens_per_turn` prompt tokens in `prefill_chunk_tokens` chunks.
- Holds: new prompts wait (at most `prefill_hold_max_s` at a time) while a decoding stream's client is nearly dry.
- Back-pressure: a stream whose client has more than `max_undelivered_s` of audio unread sits out steps; after
  `stall_timeout_s` it is closed.
- Pacing: while another stream needs audio soon, a stream more than `pace_lead_s` ahead of its client's playback
  sits out steps.
- Chunks: each stream's chunk schedule, a growth step held while its client's buffer would not last, refills for
  nearly dry clients, and a cap on segment tails per turn.
- Admission: `RealtimeAdmission` refuses new sessions while turns are too slow for real time.

The scheduler writes only its own bookkeeping: the hold clock and each stream's `stalled_since`.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from .chunking import MIN_REFILL_FRAMES, Latency, refill_size
from .config import PACE_NEEDY_S, WorkerLimits
from .realtime_admission import RealtimeAdmission
from .stream_state import Phase, Stream

# A schedule's larger chunk is sent only if the client's buffer lasts this many times its decoding time (turn jitter).
GROWTH_MARGIN = 1.25


@dataclass(slots=True)
class PrefillPlan:
    held: bool = False  # new prompts wait this turn for a nearly dry stream
    batch: list[tuple[Stream, int]] = field(default_factory=list)  # (stream, prompt tokens to write now), in order


@dataclass(slots=True)
class StepPlan:
    commit: list[bool]  # per active row: advance it this step (else it computes and discards)
    paced: int = 0  # rows that sit out because they are far ahead of their clients
    nap: bool = False  # nobody can advance: wait on the command queue before the next turn
    timed_out: list[tuple[Stream, float]] = field(default_factory=list)  # (stream, seconds stalled): close them


@dataclass(slots=True)
class VocodePlan:
    chunks: list[tuple[Stream, int, bool]]  # (stream, frames, advance its chunk schedule)
    refills: int = 0  # chunks sent early to nearly dry clients


class Scheduler:
    def __init__(self, limits: WorkerLimits, *, frame_s: float, rate_hz: int, batch_invariant: bool) -> None:
        self.limits = limits
        self.rate_hz = rate_hz
        self.batch_invariant = batch_invariant
        self.admission = RealtimeAdmission(
            frame_s,
            limits.admission_turn_fraction,
            capacity_fraction=limits.admission_capacity_fraction,
        )
        self.prefill_held_since: float | None = None

    # ---- prompts -----------------------------------------------------------------------------------------------------
    def plan_prefill(
        self, queued: Sequence[Stream], streams: Iterable[Stream], active_rows: int, now: float
    ) -> PrefillPlan:
        """The prompt chunks this turn writes: one chunk of each of several queued prompts (boundaries fixed relative
        to each prompt, so KV values never depend on load), up to the turn's token budget, at least one chunk."""
        if not queued:
            return PrefillPlan()
        if self._hold_prefill(streams, active_rows, now):
            return PrefillPlan(held=True)
        chunk = self.limits.prefill_chunk_tokens
        budget = self.limits.prefill_tokens_per_turn or (chunk if self.batch_invariant else 4 * chunk)
        plan = PrefillPlan()
        used = 0
        for st in queued:
            assert st.prefill is not None
            take = min(chunk, st.prefill.remaining)
            if plan.batch and used + take > budget:
                break
            plan.batch.append((st, take))
            used += take
        return plan

    def _hold_prefill(self, streams: Iterable[Stream], active_rows: int, now: float) -> bool:
        """Hold new prompts back while a decoding stream's client is nearly dry (its frames come first), for at most
        `prefill_hold_max_s` at a time so that a burst of arrivals still gets in."""
        gate = self.limits.prefill_hold_below_s
        if gate is None or not active_rows:
            self.prefill_held_since = None
            return False
        low_only = self.limits.prefill_hold_for == "low"
        dry = any(
            st.phase is Phase.DECODE
            and st.utterance_started_s is not None
            and (not low_only or st.session.settings.latency is Latency.LOW)
            and st.client_buffer_s(self.rate_hz, now) < gate
            for st in streams
        )
        if not dry:
            self.prefill_held_since = None
            return False
        if self.prefill_held_since is None:
            self.prefill_held_since = now
        return now - self.prefill_held_since < self.limits.prefill_hold_max_s

    # ---- the decode step ---------------------------------------------------------------------------------------------
    def plan_step(self, streams: Sequence[Stream], prompts_queued: bool, now: float) -> StepPlan:
        """Which of the decoding streams (in row order) advance this step: not those whose clients are
        back-pressured, nor those paced while another stream needs audio soon; and which stalled ones to close."""
        commit = [not self._stalled(st, now) for st in streams]
        plan = StepPlan(commit, paced=self._pace(streams, commit, prompts_queued, now))
        if not any(commit):
            # everyone is back-pressured (pacing always leaves a stream that needs audio, or a prompt to write): wait
            # on the command queue instead of spinning, so a new request still starts at once
            plan.nap = not prompts_queued or self.prefill_held_since is not None
        for st in streams:
            stalled_s = now - st.stalled_since if st.stalled_since is not None else 0.0
            if stalled_s > self.limits.stall_timeout_s:
                plan.timed_out.append((st, stalled_s))
        return plan

    def _stalled(self, st: Stream, now: float) -> bool:
        if st.session.undelivered_samples / self.rate_hz <= self.limits.max_undelivered_s:
            st.stalled_since = None
            return False
        if st.stalled_since is None:
            st.stalled_since = now
        return True

    def _pace(self, streams: Sequence[Stream], commit: list[bool], prompts_queued: bool, now: float) -> int:
        """Pacing (`pace_lead_s`): clear `commit` for the streams far ahead of their clients while another stream
        needs audio soon (a prompt in the queue, or a stream that advances with under PACE_NEEDY_S ahead); returns
        how many sit out."""
        lead = self.limits.pace_lead_s
        if lead is None:
            return 0
        ahead = [st.client_buffer_s(self.rate_hz, now) for st in streams]
        if not (prompts_queued or any(a < PACE_NEEDY_S for a, c in zip(ahead, commit, strict=True) if c)):
            return 0
        paced = 0
        for r, a in enumerate(ahead):
            if commit[r] and a >= lead:
                commit[r] = False
                paced += 1
        return paced

    # ---- audio -------------------------------------------------------------------------------------------------------
    def plan_vocode(self, streams: Iterable[Stream], now: float) -> VocodePlan:
        """The chunks vocoded now: every stream whose queue reached its scheduled size (or the previous size where
        its growth is held), then refills for the driest clients, at most `max_refills_per_turn`."""
        chunks: list[tuple[Stream, int, bool]] = []
        low: list[tuple[float, Stream]] = []  # (client buffer s, stream) of refill candidates
        refill_below_s = self.limits.refill_below_s
        for st in streams:
            size = st.schedule.size(st.chunk_index)
            queued = len(st.vocoder_queue)
            if queued >= size:
                chunks.append((st, size, True))
            elif held := self._held_growth(st, size, queued, now):
                chunks.append((st, held, False))  # the smaller size again; the schedule keeps its place
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
        chunks += [(st, refill_size(len(st.vocoder_queue)), False) for _, st in low]  # the next chunk is still `size`
        return VocodePlan(chunks, refills=len(low))

    def _held_growth(self, st: Stream, size: int, queued: int, now: float) -> int:
        """Where the schedule grows the next chunk (say 8 → 16 frames) but the client's buffer would run dry before
        the larger chunk is decoded at the current turn time, the previous size now instead (0: no such chunk).
        The fixed schedules keep a client ahead only while a turn takes under 2/3 of a frame (chunking.py,
        `sustainable_turn_fraction`); near real time, the load an admission limit of 0.9 lets in, every growth step
        ran the client dry (H200, 384 streams: 80–89 % of streams, once each). Unseeded streams only, like refills."""
        if not self.limits.grow_chunks_with_buffer or st.chunk_index == 0 or st.utterance_started_s is None:
            return 0
        previous = st.schedule.size(st.chunk_index - 1)
        turn_s = self.admission.turn_avg_s
        if size <= previous or queued < previous or turn_s <= 0 or st.session.settings.seed is not None:
            return 0
        if st.client_buffer_s(self.rate_hz, now) >= GROWTH_MARGIN * (size - queued) * turn_s:
            return 0  # the larger chunk will be there in time
        return previous

    def plan_tails(self, ended: Sequence[Stream], now: float) -> list[Stream]:
        """The ended segments whose last frames are vocoded this turn: all, or the `max_tails_per_turn` whose clients
        are driest (the rest wait a turn, their streams starting their next segment after that)."""
        cap = self.limits.max_tails_per_turn
        if cap is None or len(ended) <= cap:
            return list(ended)
        return heapq.nsmallest(cap, ended, key=lambda st: st.client_buffer_s(self.rate_hz, now))

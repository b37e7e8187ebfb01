"""Clients about to run dry: refills (queued frames go out early, in a smaller chunk) and prefill holds (new
prompts wait a moment while a decoding stream's client is nearly dry).

The engine runs a real tiny random-weight model and vocoder (tests/assets); its decode step never emits the end token
(so every utterance has its full length whatever the unseeded sampling draws) and is made slower than real time (60
ms per 46 ms frame, as an overloaded GPU would be) for its first steps or all of them. Tests that need steps faster
than real time as well run the worker on a virtual clock (engine_helpers.virtual_clock): each decode step advances it
by a fixed amount and nothing else does, so "fast" and "slow" hold by construction on any machine.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import numpy as np
import pytest

from streaming.chunking import SCHEDULES, Latency, refill_size
from streaming.config import BackendConfig
from streaming.engine import Engine
from streaming.session import SegmentDone, SynthesisSettings, Voice
from tests.streaming.engine_helpers import (
    RANDOM_TINY_MODEL,
    NeverEnding,
    VirtualClock,
    collect,
    running_engine,
    speak,
    virtual_clock,
)
from tests.streaming.test_engine import offline_decode

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")

STEP_S = 0.06  # > 2048 / 44100 s: the client's buffer shrinks while the stream decodes
FAST_STEP_S = 0.01  # on the virtual clock: a step ~4.6x faster than real time (and everything else takes no time)
FRAMES = 40
SPF = 2048
TEXT = "A sentence long enough to be spoken for a while by the untrained model."


class SlowNeverEnding(NeverEnding):
    """The real backend with a decode step slower than real time whose frames never carry the end token."""

    slow_steps: int | None = None  # steps slower than real time (None: all of them)
    step_s = STEP_S
    steps = 0

    def step(self, rows: int, commit: Sequence[bool], max_pos: int, while_running=None) -> np.ndarray:
        if self.slow_steps is None or self.steps < self.slow_steps:
            time.sleep(self.step_s)
        self.steps += 1
        return super().step(rows, commit, max_pos, while_running)


class VirtualSteps(NeverEnding):
    """The real backend on the worker's virtual clock: its first `slow_steps` decode steps take STEP_S each, the rest
    FAST_STEP_S (the clock moves by that much; no real time is spent), and its frames never carry the end token."""

    def __init__(self, config: BackendConfig, clock: VirtualClock, slow_steps: int = 0) -> None:
        super().__init__(config)
        self.clock, self.slow_steps, self.steps = clock, slow_steps, 0

    def step(self, rows: int, commit: Sequence[bool], max_pos: int, while_running=None) -> np.ndarray:
        self.clock.advance(STEP_S if self.steps < self.slow_steps else FAST_STEP_S)
        self.steps += 1
        return super().step(rows, commit, max_pos, while_running)


def speak_slowly(
    refill_below_s: float | None, seed: int | None, backend=SlowNeverEnding, frames: int = FRAMES, grow: bool = True
):
    async def main(engine: Engine):
        session = engine.open_session(Voice(), SynthesisSettings(seed=seed, max_new_tokens=frames))
        return await speak(session, TEXT)

    with running_engine(
        RANDOM_TINY_MODEL, max_sessions=2, backend_factory=backend, warm_up=False, refill_below_s=refill_below_s,
        grow_chunks_with_buffer=grow,
    ) as engine:  # fmt: skip
        return asyncio.run(main(engine))


def test_refill_size_is_the_largest_graph_size_that_fits() -> None:
    assert [refill_size(n) for n in (4, 5, 7, 8, 15, 16, 23)] == [4, 4, 4, 8, 8, 16, 16]


def test_a_dry_client_gets_every_four_frames_and_the_audio_is_unchanged() -> None:
    utt = speak_slowly(0.15, seed=None)
    assert utt.done is not None and utt.done.reason == "stop" and not utt.errors
    frames = [n // SPF for n in utt.chunk_samples]
    assert sum(frames) == utt.codes.shape[1] == FRAMES
    # the schedule's first two chunks (4, 4) come as planned; from then on the client's buffer is below 0.15 s and
    # every 4 queued frames go out at once instead of waiting for the 8 the schedule asks for
    assert frames == [4] * (FRAMES // 4), frames
    # chunk boundaries anywhere give the offline decode of the same codes
    assert np.abs(utt.pcm - offline_decode(RANDOM_TINY_MODEL, utt.codes)).max() <= 1e-4


def test_refills_do_not_advance_the_schedule() -> None:
    """Slow for 14 steps, then fast: once the buffer is back up, the schedule resumes where it was (8, 8, 16).
    On the virtual clock, so the fast steps are fast (and the slow ones slow) whatever the machine's speed."""
    with virtual_clock() as clock:
        utt = speak_slowly(
            0.15, seed=None, backend=lambda config: VirtualSteps(config, clock, slow_steps=14), frames=80
        )
    frames = [n // SPF for n in utt.chunk_samples]
    assert sum(frames) == 80 and frames[:4] == [4, 4, 4, 4], frames
    assert [f for f in frames if f > 4][:3] == [8, 8, 16], frames


@pytest.mark.parametrize(("refill_below_s", "grow", "seed"), [(None, False, None), (0.15, True, 7)])
def test_without_refills_or_with_a_seed_chunks_follow_the_schedule(refill_below_s, grow, seed) -> None:
    """Refills and held growth off, or a seeded stream (whose chunking must not depend on timing): the schedule,
    then the segment's tail."""
    utt = speak_slowly(refill_below_s, seed, grow=grow)
    frames = [n // SPF for n in utt.chunk_samples]
    schedule = SCHEDULES[Latency.BALANCED]  # 4, 4, 8, 8, 16, 24: 40 frames = 4 + 4 + 8 + 8 + 16
    assert frames == list(schedule[:5]) and sum(frames) == FRAMES, frames


class NearRealTime(SlowNeverEnding):
    step_s = 0.044  # 0.95 of a frame: real time, but too slow for the schedule's growth steps (they need ≤ 2/3)


@pytest.mark.parametrize("grow", [False, True])
def test_growth_waits_until_the_clients_buffer_covers_it(grow) -> None:
    """Without refills, at 0.95 of a frame a turn: the fixed schedule (4, 4, 8, 8, 16) runs the client dry at its
    growth steps (chunking.sustainable_turn_fraction: 2/3); held growth sends the previous size again while the
    buffer would not cover the larger chunk's decoding (here from the third chunk on: 371 ms sent − 4 turns of 44
    ms played < 1.25 × 4 frames × 44 ms). Chunk boundaries move, the audio does not."""
    utt = speak_slowly(None, seed=None, backend=NearRealTime, frames=FRAMES, grow=grow)
    frames = [n // SPF for n in utt.chunk_samples]
    assert sum(frames) == FRAMES and utt.done is not None and utt.done.reason == "stop", frames
    if grow:
        assert frames[:3] == [4, 4, 4] and frames != list(SCHEDULES[Latency.BALANCED][:5]), frames
    else:
        assert frames == list(SCHEDULES[Latency.BALANCED][:5]), frames
    assert np.abs(utt.pcm - offline_decode(RANDOM_TINY_MODEL, utt.codes)).max() <= 1e-4


def test_the_schedules_need_turns_under_two_thirds_of_a_frame() -> None:
    from streaming.chunking import sustainable_turn_fraction

    assert {round(sustainable_turn_fraction(s), 3) for s in SCHEDULES.values()} == {0.667}
    assert sustainable_turn_fraction((4,)) == 1.0  # equal chunks: any turn faster than real time keeps up
    assert sustainable_turn_fraction((4, 8)) == pytest.approx(4 / 8)  # one doubling: half of real time


class VerySlowNeverEnding(SlowNeverEnding):
    step_s = 0.12  # 4 frames (0.19 s of audio) take 0.48 s: the client is dry for ~0.3 s before each chunk


@pytest.mark.parametrize("hold_below_s", [None, 0.1])
def test_a_new_prompt_waits_a_moment_while_a_running_client_is_dry(hold_below_s) -> None:
    """Stream A decodes much slower than real time, so its client runs dry between chunks; B arrives while it is
    dry. With holds on, B's prompt waits (bounded: B still finishes); with holds off it goes straight in. Either
    way both utterances complete."""

    async def main(engine: Engine):
        a = engine.open_session(Voice(), SynthesisSettings(max_new_tokens=FRAMES))
        a.speak(TEXT)
        a.end_utterance()
        first = [await a.next_event() for _ in range(4)]  # A's first chunks (4 frames each: 0.19 s of audio)
        await asyncio.sleep(0.25)  # A's client has played its last chunk; the next is ~0.2 s away
        b = engine.open_session(Voice(), SynthesisSettings(max_new_tokens=8))
        return first, await asyncio.gather(collect(a), speak(b, "Short."))

    limits = {"refill_below_s": 0.15, "prefill_hold_below_s": hold_below_s, "prefill_hold_max_s": 0.25}
    limits["prefill_hold_for"] = "all"  # A is a normal-latency stream
    with running_engine(
        RANDOM_TINY_MODEL, max_sessions=2, backend_factory=VerySlowNeverEnding, warm_up=False, **limits
    ) as engine:
        first, (rest_a, b) = asyncio.run(main(engine))
        holds = engine.stats()["prefill_holds"]
    assert len(first) == 4 and rest_a.done is not None and b.done is not None and b.done.reason == "stop"
    assert b.codes.shape[1] == 8 and len(b.pcm) == 8 * SPF
    assert (holds > 0) == (hold_below_s is not None), holds


def test_the_chunk_schedule_starts_over_only_after_the_client_ran_dry() -> None:
    """A client whose audio ran out while it waited for more text has an empty buffer again, so the next segment
    starts with the schedule's small first chunks (4, 4, 8), not where the last segment left off (8, 8). A client
    that still has audio to play goes on with the schedule; so does a seeded stream even when it ran dry (its
    chunking must not depend on timing). Every segment here is 16 frames long: 4 + 4 + 8 by the schedule.

    On the virtual clock: each decode step takes FAST_STEP_S and the pause between the segments moves the clock on
    by `pause_s`, so a client that kept playing is ~0.6 s ahead when its second segment starts, and one that paused
    is ~0.4 s dry, whatever the machine's speed."""
    frames = 16
    text = "Sixteen frames of speech."

    async def segments(engine: Engine, clock: VirtualClock, seed: int | None, pause_s: float | None) -> list[list[int]]:
        """Chunk sizes in frames of two segments, the second sent after `pause_s` (None: both at once)."""
        session = engine.open_session(Voice(), SynthesisSettings(seed=seed, max_new_tokens=frames))
        session.speak(text)
        if pause_s is not None:
            first = await collect(session, until=SegmentDone)
            clock.advance(pause_s)  # the worker is idle (it has no text): no step moves the clock meanwhile
        session.speak(text)
        session.end_utterance()
        rest = await collect(session)
        session.close()
        chunks = [n // SPF for n in ([*first.chunk_samples, *rest.chunk_samples] if pause_s else rest.chunk_samples)]
        assert sum(chunks) == 2 * frames and rest.done is not None and not rest.errors, chunks
        return [chunks[:3], chunks[3:]]

    async def main(engine: Engine, clock: VirtualClock):
        dry = frames * SPF / 44100 + 0.25  # a pause longer than the first segment's audio
        return (
            await segments(engine, clock, None, dry),
            await segments(engine, clock, None, None),
            await segments(engine, clock, 7, dry),
        )

    with (
        virtual_clock() as clock,
        running_engine(
            RANDOM_TINY_MODEL, max_sessions=2, backend_factory=lambda config: VirtualSteps(config, clock),
            warm_up=False, refill_below_s=None,
        ) as engine,
    ):  # fmt: skip
        ran_dry, kept_playing, seeded = asyncio.run(main(engine, clock))
    assert ran_dry == [[4, 4, 8], [4, 4, 8]], ran_dry
    assert kept_playing == [[4, 4, 8], [8, 8]], kept_playing
    assert seeded == [[4, 4, 8], [8, 8]], seeded


def test_the_client_buffer_estimate_carries_no_past_gap() -> None:
    """A player that runs dry waits for the next chunk and plays on from there. The engine's estimate of what the
    client still holds must follow that: after a 2 s gap, the next 1 s chunk leaves 1 s buffered (not −1 s for the
    rest of the utterance, which restarted the chunk schedule and fired refills long after the client caught up);
    without a gap, sending more never moves the clock."""
    from streaming.chunking import ChunkSchedule
    from streaming.stream_state import Stream

    rate = 1000
    st = Stream(session=None, slot=0, seed=0, schedule=ChunkSchedule((4,)), prefix=None)  # type: ignore[arg-type]
    assert st.client_buffer_s(rate, now=5.0) == 0.0  # nothing sent yet
    st.count_sent_audio(1000, rate, now=10.0)  # 1 s at t = 10
    assert st.client_buffer_s(rate, now=10.5) == 0.5
    st.count_sent_audio(2000, rate, now=10.5)  # more while it still plays: the clock stays
    assert st.client_buffer_s(rate, now=11.0) == 2.0
    assert st.client_buffer_s(rate, now=15.0) == -2.0  # dry for 2 s (it ran out at t = 13)
    st.count_sent_audio(1000, rate, now=15.0)
    assert st.client_buffer_s(rate, now=15.0) == 1.0
    assert st.client_buffer_s(rate, now=15.25) == 0.75


@pytest.mark.parametrize("hold_for", ["all", "low"])
def test_holds_for_low_latency_wait_only_for_streams_that_asked_for_latency_low(hold_for) -> None:
    """With --prefill-hold-for low, a nearly dry stream holds new prompts only if its session asked for latency low;
    with all, any does. The scheduler alone (pure Python, timing-free): one decoding stream with 60 ms of audio
    buffered, under the 0.1 s limit, and one prompt queued."""
    import torch

    from streaming.chunking import ChunkSchedule, Latency
    from streaming.config import WorkerLimits
    from streaming.scheduler import Scheduler
    from streaming.session import Session
    from streaming.stream_state import Phase, PrefillJob, Stream

    limits = WorkerLimits(prefill_hold_below_s=0.1, prefill_hold_max_s=0.25, prefill_hold_for=hold_for)
    rate = 44_100
    loop = asyncio.new_event_loop()
    loop.close()  # the sessions' loop is never run here

    def holds(latency: Latency, buffered_s: float = 0.06) -> bool:
        scheduler = Scheduler(limits, frame_s=2048 / rate, rate_hz=rate, batch_invariant=True)
        now = 100.0
        session = Session(Voice(), SynthesisSettings(latency=latency), lambda _: None, loop)
        decoding = Stream(session, slot=0, seed=1, schedule=ChunkSchedule((4, 8)), prefix=None, phase=Phase.DECODE)
        decoding.utterance_samples, decoding.utterance_started_s = int(buffered_s * rate), now
        waiting = Stream(session, slot=1, seed=2, schedule=ChunkSchedule((4, 8)), prefix=None, phase=Phase.PREFILL)
        waiting.prefill = PrefillJob(torch.zeros((5, 40), dtype=torch.int32), 0)
        plan = scheduler.plan_prefill([waiting], [decoding, waiting], active_rows=1, now=now)
        assert plan.held is not bool(plan.batch)
        return plan.held

    assert holds(Latency.LOW)
    assert holds(Latency.BALANCED) is (hold_for == "all")
    assert holds(Latency.NORMAL) is (hold_for == "all")
    assert not holds(Latency.LOW, buffered_s=0.5)  # over the limit: never

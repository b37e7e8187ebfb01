"""Segment tails under a per-turn budget (WorkerLimits.max_tails_per_turn): when more segments end in one turn than
the budget, the rest are vocoded in later turns. The audio is the same, each segment's events still follow its last
audio, its stream starts its next segment only after that, and a cancel or close drops a tail still waiting."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from streaming.session import AudioChunk, Cancelled, SegmentDone, SynthesisSettings, UtteranceDone, Voice
from tests.streaming.engine_helpers import RANDOM_TINY_MODEL, NeverEnding, running_engine, speak

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")

N = 4
FRAMES = 11  # every segment runs to max_new_tokens (NeverEnding), so all end in the same turn, with a 3-frame tail
TEXTS = ["First part of it, then", "the second part."]


def together(**limits) -> tuple[list, int]:
    """N seeded sessions, two segments each, started in one turn; their utterances and the tails deferred."""

    async def main():
        with running_engine(RANDOM_TINY_MODEL, max_sessions=N, backend_factory=NeverEnding, **limits) as engine:
            gate = threading.Event()
            held = asyncio.ensure_future(engine.run_job(lambda worker: gate.wait(10)))  # commands pile up meanwhile
            await asyncio.sleep(0.05)
            sessions = [
                engine.open_session(Voice(), SynthesisSettings(seed=40 + i, max_new_tokens=FRAMES)) for i in range(N)
            ]
            pending = [asyncio.ensure_future(speak(s, *TEXTS)) for s in sessions]
            await asyncio.sleep(0.05)
            gate.set()
            await held
            return await asyncio.gather(*pending), engine.stats()["tails_deferred"]

    return asyncio.run(main())


def test_deferred_tails_give_the_same_audio_and_events() -> None:
    free, deferred_none = together(max_tails_per_turn=None)
    capped, deferred = together(max_tails_per_turn=1)
    assert deferred_none == 0 and deferred >= N - 1  # the first segments' tails: three of four waited at least a turn
    for a, b in zip(free, capped, strict=True):
        assert a.done is not None and b.done is not None and not b.errors
        assert len(b.segments) == len(a.segments) == 2
        assert np.array_equal(a.codes, b.codes)
        assert np.array_equal(a.pcm, b.pcm)  # seeded, batch-invariant CPU: the same samples, bit for bit
        assert b.done.audio_samples == len(b.pcm)


@pytest.mark.parametrize("cancel", ["its utterance", "the next utterance"])
def test_a_cancel_while_a_tail_waits(cancel: str) -> None:
    """Two streams end a segment in the same turn with a budget of one tail: the other's tail waits; the worker is
    held right then and the waiting stream gets a cancel. Of its own utterance: the tail is dropped, Cancelled comes
    without that segment's SegmentDone. Of the next utterance (queued text, not started): the waiting tail is still
    spoken, its utterance finishes whole, the next one is cancelled. The other stream finishes normally, the worker
    keeps serving."""

    async def main():
        with running_engine(RANDOM_TINY_MODEL, max_sessions=2, backend_factory=NeverEnding, max_tails_per_turn=1) as e:
            found, release = threading.Event(), threading.Event()
            waiting: list[int] = []

            def watch(worker) -> bool:  # between turns on the worker thread: a deferred tail means hold here
                if worker._ended:
                    waiting.extend(worker._ended)
                    found.set()
                    release.wait(10)
                    return True
                return False

            vocoded_before = e.stats()["vocoded_frames"]
            gate = threading.Event()
            held = asyncio.ensure_future(e.run_job(lambda worker: gate.wait(10)))
            await asyncio.sleep(0.05)
            sessions = [e.open_session(Voice(), SynthesisSettings(seed=7 + i, max_new_tokens=FRAMES)) for i in range(2)]
            for s in sessions:
                s.speak(TEXTS[0])
                s.end_utterance()
            gate.set()
            await held
            job = asyncio.ensure_future(e.run_job(watch))
            while not found.is_set():  # a watch per pause between turns until one finds a waiting tail (and holds)
                if job.done():
                    job = asyncio.ensure_future(e.run_job(watch))
                await asyncio.sleep(0.001)
            victim = {s.id: s for s in sessions}[waiting[0]]
            if cancel == "the next utterance":
                victim.speak("The next utterance.")
            victim.cancel(0 if cancel == "its utterance" else 1)  # queued while the worker is held: applied first
            release.set()
            assert await job
            events = {s.id: [] for s in sessions}

            async def drain(s):
                ends = 2 if s is victim and cancel == "the next utterance" else 1
                while ends:
                    ev = await asyncio.wait_for(s.next_event(), 30)
                    events[s.id].append(ev)
                    ends -= isinstance(ev, UtteranceDone | Cancelled)

            await asyncio.gather(*(drain(s) for s in sessions))
            assert await e.run_job(lambda worker: not worker._ended and not worker.free_slots)
            vocoded = e.stats()["vocoded_frames"] - vocoded_before
            for s in sessions:
                s.close()
            while not await e.run_job(lambda worker: len(worker.free_slots) == 2):
                await asyncio.sleep(0.01)
            again = await speak(e.open_session(Voice(), SynthesisSettings(seed=1, max_new_tokens=5)), "Still here.")
            return victim.id, events, again, vocoded

    victim, events, again, vocoded = asyncio.run(main())
    assert again.done is not None and len(again.pcm) == 5 * 2048  # the worker still serves
    for sid, evs in events.items():
        kinds = [type(ev) for ev in evs]
        if sid == victim and cancel == "its utterance":
            assert Cancelled in kinds and SegmentDone not in kinds and UtteranceDone not in kinds
            # the other stream's 11 frames and the victim's first two chunks (4 + 4, the balanced schedule); its
            # waiting 3-frame tail was never vocoded (the audio it had been sent was dropped by the cancel)
            assert vocoded == 2 * FRAMES - 3
        elif sid == victim:
            cancelled = [ev for ev in evs if isinstance(ev, Cancelled)]
            done = [ev for ev in evs if isinstance(ev, UtteranceDone)]
            assert [ev.utterance for ev in cancelled] == [1] and [(ev.utterance, ev.reason) for ev in done] == [
                (0, "stop")
            ]
            assert done[0].audio_samples == FRAMES * 2048 and vocoded == 2 * FRAMES  # its tail was spoken
        else:
            assert kinds[-2:] == [SegmentDone, UtteranceDone] and AudioChunk in kinds
            audio = sum(len(ev.pcm) for ev in evs if isinstance(ev, AudioChunk))
            assert evs[-1].audio_samples == audio == FRAMES * 2048

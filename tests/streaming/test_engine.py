"""The engine end to end on CPU with real (tiny) checkpoints: streaming equals offline, batching equals solo,
lifecycle (cancel, close, backpressure, failures) frees everything."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import gc
import json
import threading
import time

import numpy as np
import pytest
import torch

from model.codec_checkpoint import load_codec
from streaming import engine as engine_module
from streaming.backend import Backend, default_checkpoint
from streaming.config import BackendConfig
from streaming.engine import Engine, EngineConfig
from streaming.errors import NotReady, Overloaded, TextTooLong
from streaming.session import (
    AudioChunk,
    Cancelled,
    SegmentDone,
    SessionError,
    SynthesisSettings,
    UtteranceDone,
    Voice,
)
from tests.model.fixture_sets import dual_ar_sets, firefly_sets
from tests.streaming.engine_helpers import (
    EVENT_TIMEOUT_S,
    NeverEnding,
    Utterance,
    collect,
    fixture_checkpoint,
    running_engine,
    speak,
    speak_together,
)

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")

SETTINGS = SynthesisSettings(seed=1234, max_new_tokens=40)
TEXTS = ("Hello there, this is a test.", "A second sentence follows it.")


def offline_decode(checkpoint, codes: np.ndarray) -> np.ndarray:
    codec = load_codec(checkpoint or default_checkpoint())
    return codec.decode(torch.from_numpy(codes).unsqueeze(0))[0].numpy()


def test_streamed_audio_equals_offline_decode_across_segment_seams() -> None:
    async def main():
        with running_engine() as engine:
            s = engine.open_session(Voice(), SETTINGS)
            utt = await speak(s, *TEXTS)
            s.close()
            return utt

    utt = asyncio.run(main())
    assert utt.done is not None and utt.done.reason == "stop" and not utt.errors
    assert len(utt.segments) == 2 and utt.chunks > 2  # several chunks per utterance, two segments
    assert len(utt.pcm) == utt.codes.shape[1] * 2048 == utt.done.audio_samples
    offline = offline_decode(None, utt.codes)
    assert np.abs(utt.pcm - offline).max() <= 1e-4  # seam included: one continuous decoder state


def test_audio_stays_continuous_when_a_long_history_is_trimmed_before_the_next_segment() -> None:
    """Once an utterance's history outgrows the model's budget, the next segment's prompt is rebuilt from a trimmed
    history instead of being appended to the cached one. That changes only what the model reads: the audio must
    still flow on through the same vocoder state, so the whole utterance's streamed audio equals the offline decode
    of all its codes, seams included. The context is lowered here so that the trimming starts after a few segments."""
    rebuilt: list[int] = []  # prompt lengths of the segments whose prompt was rebuilt from a trimmed history

    def short_context(config: BackendConfig) -> Backend:
        backend = Backend(dataclasses.replace(config, max_seq_len=1200))
        build = backend.builder.segment_prompt

        def recording(*args):
            prompt = build(*args)
            rebuilt.append(prompt.shape[1])
            return prompt

        backend.builder.segment_prompt = recording  # type: ignore[method-assign]
        return backend

    texts = ("The first sentence opens it.", "A second one follows.", "Then comes a third.", "And a fourth ends it.")

    async def main():
        with running_engine(backend_factory=short_context) as engine:
            s = engine.open_session(Voice(), SynthesisSettings(seed=1234, max_new_tokens=40))
            utt = await speak(s, *texts)
            s.close()
            return utt

    utt = asyncio.run(main())
    assert utt.done is not None and utt.done.reason == "stop" and not utt.errors
    assert len(utt.segments) == len(texts) and all(seg.frames > 0 for seg in utt.segments)
    assert rebuilt, "the history should have been trimmed before a later segment"
    assert len(utt.pcm) == utt.codes.shape[1] * 2048 == utt.done.audio_samples
    assert np.abs(utt.pcm - offline_decode(None, utt.codes)).max() <= 1e-4


def test_each_utterance_reports_only_its_own_audio_length() -> None:
    """Three utterances of one session: two with text (the second sent before the first is spoken), then one with
    none. The end of each utterance reports exactly the samples of its own audio, never those of an earlier
    utterance of the same session nor a running total; the utterance without text reports none."""

    async def main():
        with running_engine() as engine:
            s = engine.open_session(Voice(), SynthesisSettings(seed=11, max_new_tokens=30))
            s.speak(TEXTS[0])
            s.speak(TEXTS[1])
            s.end_utterance()
            s.speak("A shorter one.")
            s.end_utterance()
            utterances = [await collect(s) for _ in range(2)]
            s.end_utterance()  # nothing was said in this one
            utterances.append(await collect(s))
            s.close()
            return utterances

    first, second, empty = asyncio.run(main())
    assert [u.done.utterance if u.done else None for u in (first, second, empty)] == [0, 1, 2]
    for utt in (first, second):
        assert utt.done is not None and utt.done.reason == "stop" and not utt.errors
        assert utt.done.audio_samples == len(utt.pcm) == utt.codes.shape[1] * 2048 > 0
    assert len(first.pcm) != len(second.pcm)  # a count from the wrong utterance could not pass by chance
    assert empty.done is not None and empty.done.audio_samples == 0 and len(empty.pcm) == 0


def test_without_conditioning_a_segment_does_not_depend_on_the_ones_before() -> None:
    """condition_on_previous_chunks=False (a model trained on single utterances): each segment's prompt is the
    voice prefix and its own text, so two utterances that differ only in their first segment (of equal length, so
    the seeded noise counters agree) give the same second segment; with conditioning on they differ."""

    async def second_segments(condition: bool) -> list[np.ndarray]:
        settings = SynthesisSettings(seed=1234, max_new_tokens=12, condition_on_previous_chunks=condition)
        out = []
        with running_engine() as engine:
            for first in ("Hello there, this is a test.", "Quite different words come first here."):
                utt = await speak(engine.open_session(Voice(), settings), first, "A second sentence follows it.")
                assert [s.codes.shape[1] for s in utt.segments] == [12, 12] and not utt.errors
                out.append(utt.segments[1].codes)
        return out

    alone = asyncio.run(second_segments(False))
    assert np.array_equal(alone[0], alone[1])
    conditioned = asyncio.run(second_segments(True))
    assert not np.array_equal(conditioned[0], conditioned[1])


async def seeded_beside_others(engine: Engine, texts: list[str]) -> tuple[Utterance, list[Utterance]]:
    """The seeded session (SETTINGS, TEXTS) started after unseeded others speaking `texts`; (its utterance, theirs)."""
    others = [engine.open_session(Voice(), SynthesisSettings(seed=i, temperature=1.0)) for i in range(len(texts))]
    for o, text in zip(others, texts, strict=True):
        o.speak(text)
        o.end_utterance()
    target = asyncio.create_task(speak(engine.open_session(Voice(), SETTINGS), *TEXTS))
    rest = await asyncio.gather(*(collect(o) for o in others))
    return await target, rest


def test_seeded_stream_is_identical_alone_and_under_load() -> None:
    """Bitwise: a seeded session gives the same codes and PCM alone and beside other sessions (other buckets)."""

    async def alone():
        with running_engine(max_sessions=8) as engine:
            s = engine.open_session(Voice(), SETTINGS)
            return await speak(s, *TEXTS)

    async def loaded():
        with running_engine(max_sessions=8) as engine:
            others = [f"Other speaker number {i} says something rather long, to overlap." for i in range(4)]
            return await seeded_beside_others(engine, others)

    solo = asyncio.run(alone())
    busy, rest = asyncio.run(loaded())
    assert all(r.done is not None for r in rest)
    assert np.array_equal(solo.codes, busy.codes)
    assert np.array_equal(solo.pcm, busy.pcm)


def test_first_frames_through_static_buffers_change_nothing_under_load() -> None:
    """graph_first_frames (GPU: one CUDA graph per batch bucket; here the same padded buffers run eagerly, padding
    on the swap spare row): a seeded session beside others, with rows swapping as streams come and go, gives the
    same codes and PCM as the plain (unpadded) path alone."""

    def static_first_frames(config: BackendConfig) -> Backend:
        return Backend(dataclasses.replace(config, graph_first_frames=True))

    def plain_first_frames(config: BackendConfig) -> Backend:
        return Backend(dataclasses.replace(config, graph_first_frames=False))

    async def alone():
        with running_engine(max_sessions=8, backend_factory=plain_first_frames) as engine:
            assert engine._worker.b.stepper.first_frame_scratch_row is None
            return await speak(engine.open_session(Voice(), SETTINGS), *TEXTS)

    async def loaded():
        with running_engine(max_sessions=6, backend_factory=static_first_frames) as engine:
            assert engine._worker.b.stepper.first_frame_scratch_row == 6  # the swap spare of 6 sessions
            return await seeded_beside_others(engine, [f"Speaker {i} " + "says a little. " * (i + 1) for i in range(4)])

    solo = asyncio.run(alone())
    busy, rest = asyncio.run(loaded())
    assert all(r.done is not None and not r.errors for r in rest)
    assert np.array_equal(solo.codes, busy.codes)
    assert np.array_equal(solo.pcm, busy.pcm)


def test_prefill_through_static_buffers_changes_nothing_alone_or_under_load() -> None:
    """graph_prefill (GPU: one CUDA graph per (rows, chunk, attention length) bucket; here the same padded passes run
    eagerly): a seeded session alone, and beside others with rows swapping (first frames through their static
    buffers too), gives the same codes and PCM as the default engine alone. The padded passes change the prefill's
    last bits on CPU (tests/model/test_prefill_graphs.py); the codes must not notice."""
    buckets: list[tuple[int, int, int]] = []

    def static_prefill(config: BackendConfig, first_frames: bool = False) -> Backend:
        backend = Backend(dataclasses.replace(config, graph_prefill=True, graph_first_frames=first_frames))
        passes = backend.stepper.static_prefill
        assert passes is not None and passes.scratch_row == backend.session_rows - 1  # the swap spare
        run = passes._run
        passes._run = lambda bucket: (buckets.append(bucket), run(bucket))[-1]  # type: ignore[method-assign]
        return backend

    async def alone(factory=Backend):
        with running_engine(max_sessions=8, backend_factory=factory) as engine:
            return await speak(engine.open_session(Voice(), SETTINGS), *TEXTS)

    async def loaded():
        factory = functools.partial(static_prefill, first_frames=True)
        with running_engine(max_sessions=6, backend_factory=factory) as engine:
            return await seeded_beside_others(engine, [f"Speaker {i} " + "says a little. " * (i + 1) for i in range(4)])

    solo = asyncio.run(alone())
    solo_static = asyncio.run(alone(static_prefill))
    assert buckets, "the prefill should have run through the static buffers"
    busy, rest = asyncio.run(loaded())
    assert all(r.done is not None and not r.errors for r in rest)
    assert {chunk for _, chunk, _ in buckets} >= {64, 128}  # the others' longer prompts took a larger bucket
    for other in (solo_static, busy):
        assert np.array_equal(solo.codes, other.codes)
        assert np.array_equal(solo.pcm, other.pcm)


def test_vocoder_beside_the_next_step_changes_no_audio_and_no_event_order() -> None:
    """vocoder_overlap (the GPU default: a turn queues the chunks its previous step completed on the vocoder's own
    stream, then prefills and steps while they decode; on CPU the same order, run in sequence): a seeded session
    with three segments beside four others gives the same codes, PCM and chunk sizes as the serial turn, and each
    segment's end still follows exactly its own audio."""

    def overlapped(config: BackendConfig) -> Backend:
        return Backend(dataclasses.replace(config, vocoder_overlap=True))

    async def ordered(session) -> list[tuple[str, int]]:
        events = []
        while True:
            ev = await asyncio.wait_for(session.next_event(), 60)
            if isinstance(ev, AudioChunk):
                events.append(("audio", len(ev.pcm)))
            elif isinstance(ev, SegmentDone):
                events.append(("segment", ev.codes.shape[1] * 2048))
            elif isinstance(ev, UtteranceDone):
                return events
            else:
                raise AssertionError(f"unexpected {ev!r}")

    async def run(factory):
        with running_engine(max_sessions=6, backend_factory=factory) as engine:
            assert engine._worker.overlap_vocoder is (factory is overlapped)
            others = [engine.open_session(Voice(), SynthesisSettings(seed=i)) for i in range(4)]
            for i, o in enumerate(others):
                o.speak(f"Speaker {i} " + "says a little more. " * (i + 1))
                o.end_utterance()
            target = engine.open_session(Voice(), SETTINGS)
            for text in (*TEXTS, "And a third one ends it."):
                target.speak(text)
            target.end_utterance()
            events = await ordered(target)
            rest = await asyncio.gather(*(collect(o) for o in others))
            return events, rest

    serial, serial_rest = asyncio.run(run(Backend))
    overlap, overlap_rest = asyncio.run(run(overlapped))
    assert serial == overlap  # the same chunks in the same order, segment ends at the same places
    assert sum(1 for kind, _ in serial if kind == "segment") == 3
    audio = 0
    for kind, samples in overlap:
        if kind == "audio":
            audio += samples
        else:
            audio -= samples
            assert audio == 0, "a segment's end arrived before all of its audio, or after the next one's"
    for a, b in zip(serial_rest, overlap_rest, strict=True):  # seeded others: their codes and PCM are equal too
        assert b.done is not None and not b.errors
        assert np.array_equal(a.codes, b.codes) and np.array_equal(a.pcm, b.pcm)


@pytest.mark.skipif(not dual_ar_sets() or not firefly_sets(), reason="needs the upstream fixture folders")
def test_engine_reproduces_upstream_greedy_frames_and_ends_on_the_end_token(tmp_path) -> None:
    """Through the whole engine (reference voice prompt, prefill, batched steps): upstream's greedy frames."""
    fs = next(f for f in dual_ar_sets() if f.meta["greedy"]["ended_with_im_end"])
    ckpt = fixture_checkpoint(tmp_path, dual_ar=fs.name)
    fx, meta = fs.tensors(), fs.meta
    p = meta["greedy"]["params"]
    greedy = SynthesisSettings(
        seed=7, temperature=p["temperature"], top_p=p["top_p"], repetition_penalty=p["repetition_penalty"],
        max_new_tokens=p["max_new_tokens"],
    )  # fmt: skip
    voice = Voice(((meta["prompt_texts"]["ref_text"], fx["prompt/ref_codes"].numpy().astype(np.int64)),))

    async def main():
        with running_engine(ckpt) as engine:
            s = engine.open_session(voice, greedy)
            return await speak(s, meta["prompt_texts"]["text_single"])

    utt = asyncio.run(main())
    seg = utt.segments[0]
    upstream = fx["greedy/y"][:, fx["prompt/full"].shape[1] :].numpy()  # frames incl. the final <|im_end|>
    assert seg.ended_by == "end_token"
    assert np.array_equal(seg.codes, upstream[1:, :-1])  # every frame but the end frame is vocoded
    assert len(utt.pcm) == seg.frames * 2048


def test_max_new_tokens_ends_a_segment() -> None:
    async def main():
        with running_engine() as engine:
            s = engine.open_session(Voice(), SynthesisSettings(seed=3, max_new_tokens=5))
            return await speak(s, "A sentence long enough that the frame cap is what ends it.")

    utt = asyncio.run(main())
    assert [s.ended_by for s in utt.segments] == ["max_new_tokens"]
    assert utt.segments[0].frames == 5 and len(utt.pcm) == 5 * 2048


def test_cancel_stops_now_and_the_session_goes_on() -> None:
    async def main():
        with running_engine() as engine:
            s = engine.open_session(Voice(), SynthesisSettings(seed=5, max_new_tokens=400))
            s.speak("This utterance is long enough that it will still be running when the cancel arrives. " * 3)
            first = await s.next_event()  # audio has started
            s.cancel()
            cancelled = await collect(s)
            at_cancel = engine.stats()  # the Cancelled event comes after the segment left the decode batch
            await asyncio.sleep(0.3)
            later = engine.stats()
            after = await speak(s, "And now something short.")
            stats = engine.stats()
            s.close()
            return first, cancelled, at_cancel, later, after, stats

    _first, cancelled, at_cancel, later, after, stats = asyncio.run(main())
    assert cancelled.cancelled is not None and cancelled.done is None
    # generation stopped, not just the audio: no row decodes and no frame is made after the cancel
    assert at_cancel["decoding"] == 0 and later["frames"] == at_cancel["frames"], (at_cancel, later)
    assert after.done is not None and len(after.pcm) > 0 and not after.errors
    assert stats["decoding"] == 0


def test_audio_dropped_by_a_cancel_no_longer_counts_as_unread() -> None:
    """The audio a cancel throws away never reaches the client, so it must stop counting as unread: both the chunks
    already waiting in the session and those still on their way from the worker. Counted wrongly, the session would
    look as if its client lagged behind (backpressure stalls it, the live endpoint waits for audio that never comes).
    Once the client has read everything, nothing is unread, after the cancel and after the next utterance."""

    async def main():
        # no end token: every segment runs its 400 frames, so the worker is still posting audio after the first
        # chunk arrived, whatever the speed (backpressure stalls it only past 20 s of unread audio)
        with running_engine(backend_factory=NeverEnding) as engine:
            s = engine.open_session(Voice(), SynthesisSettings(seed=5, max_new_tokens=400))
            s.speak("This utterance is long enough that it will still be running when the cancel arrives. " * 3)
            while not any(isinstance(ev, AudioChunk) for ev in s._events):  # the first audio waits, unread
                await asyncio.sleep(0.01)

            def in_session() -> int:
                return sum(len(ev.pcm) for ev in s._events if isinstance(ev, AudioChunk))

            # the event loop is busy (blocked here) until the worker has posted more: those chunks are on their way
            deadline = time.monotonic() + EVENT_TIMEOUT_S
            while s.posted_samples - s.consumed_samples - in_session() <= 0 and time.monotonic() < deadline:
                time.sleep(0.01)
            waiting = in_session()
            on_their_way = s.posted_samples - s.consumed_samples - waiting
            s.cancel()
            cancelled = await collect(s)
            after_cancel = s.undelivered_samples
            after = await speak(s, "And now something short.")
            s.close()
            return waiting, on_their_way, cancelled, after_cancel, after, s.undelivered_samples

    waiting, on_their_way, cancelled, after_cancel, after, at_end = asyncio.run(main())
    assert waiting > 0 and on_their_way > 0, (waiting, on_their_way)  # both kinds of dropped audio were there
    assert cancelled.cancelled is not None and len(cancelled.pcm) == 0  # none of it reached the client
    assert after_cancel == 0
    assert after.done is not None and len(after.pcm) == after.done.audio_samples > 0 and not after.errors
    assert at_end == 0


def test_a_thousand_open_cancel_close_cycles_leak_nothing() -> None:
    async def main():
        with running_engine(max_sessions=2) as engine:
            worker = engine._worker
            for i in range(1000):
                s = engine.open_session(Voice(), SynthesisSettings(seed=i, max_new_tokens=3))
                s.speak("Hi.")
                if i % 3 == 1:
                    s.end_utterance()
                    await collect(s)  # the utterance runs to its end
                else:
                    await s.next_event()  # the first audio: the segment is decoding now
                    if i % 3 == 0:
                        s.cancel()  # barge-in while generating
                s.close()  # i % 3 == 2: close while generating (a client that vanished)

            def left() -> tuple[int, int, int, int]:
                return engine.open_sessions, worker.rows.active, len(worker.streams), len(worker.free_slots)

            deadline = time.monotonic() + EVENT_TIMEOUT_S  # the worker takes the last closes (a leak still times out)
            while left() != (0, 0, 0, 2) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            return left()

    open_sessions, active, streams, free_slots = asyncio.run(main())
    assert (open_sessions, active, streams, free_slots) == (0, 0, 0, 2)


def test_admission_control_refuses_beyond_capacity() -> None:
    async def main():
        with running_engine(max_sessions=2) as engine:
            a = engine.open_session(Voice(), SETTINGS)
            engine.open_session(Voice(), SETTINGS)
            with pytest.raises(Overloaded, match="max-sessions"):
                engine.open_session(Voice(), SETTINGS)
            a.close()
            engine.open_session(Voice(), SETTINGS).close()  # a freed place is usable again
            engine.drain()
            with pytest.raises(NotReady):
                engine.open_session(Voice(), SETTINGS)

    asyncio.run(main())


def test_a_full_command_queue_refuses_work_but_never_a_close(monkeypatch) -> None:
    """A client sending text faster than a busy worker takes it fills the command queue: new work is refused with
    Overloaded, but the engine must not lose count: an open that was refused holds no place, and a close always
    reaches the worker (a refused Close left the worker holding the slot, and the next admission ended the worker)."""
    monkeypatch.setattr(engine_module, "COMMAND_QUEUE_SIZE", 32)

    async def main():
        with running_engine(max_sessions=2) as engine:
            worker = engine._worker
            gate = threading.Event()
            busy = asyncio.ensure_future(engine.run_job(lambda w: gate.wait(30)))  # a long worker turn
            await asyncio.sleep(0.1)
            s1 = engine.open_session(Voice(), SETTINGS)
            with pytest.raises(Overloaded, match="command queue is full"):
                for _ in range(100):
                    s1.speak("Hello there.")
            with pytest.raises(Overloaded, match="command queue is full"):
                engine.open_session(Voice(), SETTINGS)
            assert engine.open_sessions == 1  # the refused open holds no place
            s1.close()  # accepted although the queue is full
            gate.set()
            await busy
            # the worker thread pops the stream before it returns the slot: wait for both (a leak still times out)
            for _ in range(100):
                if engine.stats()["command_queue"] == 0 and not worker.streams and len(worker.free_slots) == 2:
                    break
                await asyncio.sleep(0.05)
            freed = (engine.open_sessions, len(worker.streams), len(worker.free_slots))
            outs = await asyncio.gather(
                *(speak(engine.open_session(Voice(), SETTINGS), "Still serving.") for _ in range(2))
            )
            return freed, outs, engine.state.value

    freed, outs, state = asyncio.run(main())
    assert freed == (0, 0, 2)
    assert state == "ready" and all(o.done is not None and len(o.pcm) > 0 for o in outs)


def test_reference_encodes_wait_on_their_own_thread_and_are_bounded() -> None:
    """Encodes run one at a time on the engine's encoder thread; beyond MAX_PENDING_ENCODES waiting, Overloaded."""
    t = np.arange(2 * 44100) / 44100
    audio = (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32)

    async def main():
        with running_engine() as engine:
            n = engine_module.MAX_PENDING_ENCODES
            threads: set[str] = set()
            encode = engine._worker.b.encode_reference

            def spy(*args):
                threads.add(threading.current_thread().name)
                return encode(*args)

            engine._worker.b.encode_reference = spy
            results = await asyncio.gather(
                *(engine.encode_reference(audio, 44100) for _ in range(n + 2)), return_exceptions=True
            )
            again = await engine.encode_reference(audio, 44100)  # nothing is left counted as waiting
            return results, threads, again

    results, threads, again = asyncio.run(main())
    codes = [r for r in results if isinstance(r, np.ndarray)]
    refused = [r for r in results if isinstance(r, Overloaded)]
    assert len(codes) == engine_module.MAX_PENDING_ENCODES and len(refused) == 2
    assert all(np.array_equal(c, codes[0]) for c in codes) and np.array_equal(again, codes[0])
    assert len(threads) == 1 and next(iter(threads)).startswith("fishgate-encode")


def test_text_waiting_to_be_spoken_is_capped_per_session() -> None:
    async def main():
        with running_engine() as engine:
            s = engine.open_session(Voice(), SynthesisSettings(seed=2, max_new_tokens=200))
            s.max_queued_chars = 60
            for _ in range(5):
                s.speak("Hello there.")  # 12 characters each: 60 in all
            with pytest.raises(TextTooLong, match="--max-queued-chars"):
                s.speak("One more.")
            s.speak("   ")  # blank text is not queued work
            s.cancel()
            await collect(s)  # the Cancelled event releases what was queued
            after_cancel = s.queued_chars
            s.speak("Hello there.")
            s.end_utterance()
            spoken = await collect(s)  # SegmentDone releases each segment's text
            left = s.queued_chars
            s.close()
            return after_cancel, spoken, left

    after_cancel, spoken, left = asyncio.run(main())
    assert after_cancel == 0 and left == 0
    assert spoken.done is not None and len(spoken.pcm) > 0


def test_backpressure_stalls_then_closes_a_client_that_never_reads() -> None:
    async def main():
        with running_engine(max_undelivered_s=0.5, stall_timeout_s=1.0) as engine:
            slow = engine.open_session(Voice(), SynthesisSettings(seed=9, max_new_tokens=2000))
            slow.speak("Never read. " * 50)
            fast = engine.open_session(Voice(), SETTINGS)
            ok = await speak(fast, *TEXTS)  # the other session is unaffected
            peak = slow.undelivered_samples
            deadline = time.monotonic() + EVENT_TIMEOUT_S
            while not slow.closed:  # the stall timeout's fatal error has arrived (it closes the session)
                assert time.monotonic() < deadline, "the stalled stream was never closed"
                await asyncio.sleep(0.05)
            rest = await collect(slow)  # drains the buffer, then the fatal stall error
            await asyncio.sleep(0.05)
            # its capacity is back although nobody called slow.close() (it used to stay counted for good)
            registered = set(engine._sessions)
            return ok, peak, rest, engine.stats(), registered, fast.id

    ok, peak, rest, stats, registered, fast_id = asyncio.run(main())
    assert registered == {fast_id}
    assert ok.done is not None
    assert peak <= (0.5 + 1.5) * 44100  # limit + at most one chunk (24 frames) past it
    assert rest.errors and rest.errors[-1].fatal and rest.errors[-1].code == "client_too_slow"
    assert stats["sessions"] == 0 or stats["decoding"] == 0


def test_one_failing_session_leaves_the_others_intact() -> None:
    async def main():
        with running_engine(max_sessions=4) as engine:
            good = engine.open_session(Voice(), SETTINGS)
            bad = engine.open_session(Voice(), SETTINGS)
            bad.speak("x" * 5000)  # longer than the model's 2048-position context
            bad.end_utterance()
            good_utt = await speak(good, *TEXTS)
            bad_utt = await collect(bad)
            again = await speak(bad, "Short and fine.")  # the failing session itself recovers
            return good_utt, bad_utt, again

    good, bad, again = asyncio.run(main())
    assert good.done is not None and not good.errors
    assert bad.errors and bad.errors[0].code == "prompt_too_long" and "context" in bad.errors[0].message
    assert bad.done is not None and bad.done.reason == "error"
    assert again.done is not None and len(again.pcm) > 0
    gc.collect()


def default_num_codebooks() -> int:
    return int(json.loads((default_checkpoint() / "config.json").read_text())["num_codebooks"])


def test_voice_prefix_is_prefilled_once_and_reused() -> None:
    """Sessions with the same reference voice share its prefilled KV prefix; the audio equals a fresh prefill's."""
    rng = np.random.default_rng(0)
    codes = rng.integers(0, 1000, (default_num_codebooks(), 120))
    voice = Voice((("A reference sentence, spoken by somebody.", codes),))
    settings = SynthesisSettings(seed=21, max_new_tokens=30)

    async def fresh():
        with running_engine() as engine:
            utt = await speak(engine.open_session(voice, settings), "Now the target text.")
            return utt, engine.stats()["prefill_tokens"]

    async def cached():
        with running_engine() as engine:
            await speak(engine.open_session(voice, SynthesisSettings(seed=5, max_new_tokens=10)), "Warm it up.")
            before = engine.stats()["prefill_tokens"]
            utt = await speak(engine.open_session(voice, settings), "Now the target text.")
            return utt, engine.stats()["prefill_tokens"] - before, len(engine._worker.executor.prefix_cache)

    solo, solo_tokens = asyncio.run(fresh())
    reused, reused_tokens, cached_voices = asyncio.run(cached())
    assert cached_voices == 1
    assert reused_tokens < solo_tokens - 120  # the ~150-token prefix was not written again
    assert np.array_equal(solo.codes, reused.codes)
    assert np.abs(solo.pcm - reused.pcm).max() <= 1e-4


def test_a_voice_of_another_codec_closes_only_its_session() -> None:
    """Reference codes with too few codebook rows (a voice stored for another model) used to kill the worker thread.
    Now that session gets `incompatible_voice` naming the fix and closes; no slot leaks; others keep speaking."""
    nc = default_num_codebooks()
    wrong = Voice((("Stored for a smaller model.", np.zeros((nc - 1, 40), dtype=np.int64)),))

    async def main(engine):
        slots = len(engine._worker.free_slots)
        bad = engine.open_session(wrong, SynthesisSettings(seed=1))
        event = await asyncio.wait_for(bad.next_event(), 30)
        bad.close()
        session = engine.open_session(Voice(), SynthesisSettings(seed=2, max_new_tokens=20))
        good = await speak(session, "Still here.")
        session.close()
        deadline = time.monotonic() + EVENT_TIMEOUT_S  # the worker takes the close (a leaked slot still times out)
        while len(engine._worker.free_slots) != slots and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        return event, good, slots, len(engine._worker.free_slots)

    with running_engine(max_sessions=2) as engine:
        for _ in range(3):  # repeatedly: a leak of one slot per bad session would exhaust both
            event, good, slots_before, slots_after = asyncio.run(main(engine))
            assert isinstance(event, SessionError) and event.fatal and event.code == "incompatible_voice", event
            assert (
                f"have {nc - 1} rows but the model needs {nc}" in event.message
                and "encode the reference" in event.message
            )
            assert good.done is not None and not good.errors and good.codes.shape[1] > 0
            assert slots_after == slots_before
        assert engine.state.value == "ready"


@pytest.mark.skipif(not dual_ar_sets() or not firefly_sets(), reason="needs the upstream fixture folders")
def test_a_model_that_declares_a_text_normalizer_reads_normalised_text(tmp_path, caplog) -> None:
    """fishgate.json "text_normalizer": "english" (the trained default voice): the engine feeds the model the text
    spelled out, exactly as the same model without it would get the spelled-out text; official folders read raw."""
    import json

    (tmp_path / "raw").mkdir()
    (tmp_path / "norm").mkdir()
    raw = fixture_checkpoint(tmp_path / "raw")
    normalising = fixture_checkpoint(tmp_path / "norm")
    (normalising / "fishgate.json").write_text(json.dumps({"name": "n", "text_normalizer": "english"}))

    async def codes(checkpoint, text: str) -> np.ndarray:
        with running_engine(checkpoint) as engine:
            assert engine.info is not None
            s = engine.open_session(Voice(), SETTINGS)
            utt = await speak(s, text)
            s.close()
            assert utt.done is not None and not utt.errors
            assert utt.segments[0].text == text  # events keep the client's text
            return utt.codes

    written, spelled = "It costs $5 at 10:30.", "It costs five dollars at ten thirty."
    normalised = asyncio.run(codes(normalising, written))
    assert np.array_equal(normalised, asyncio.run(codes(raw, spelled)))
    assert not np.array_equal(asyncio.run(codes(raw, written)), normalised)

    (normalising / "fishgate.json").write_text(json.dumps({"name": "n", "text_normalizer": "klingon"}))
    engine = Engine(EngineConfig(BackendConfig(checkpoint=normalising, max_sessions=1)))
    engine.start()
    try:
        assert not engine.wait_ready(60)
        assert engine.fault == "start-up failed: ValueError"  # clients see no internals; the log names the fix
        assert "unknown text_normalizer 'klingon' in fishgate.json; known: english" in caplog.text
    finally:
        engine.stop()


def test_prompts_arriving_together_are_prefilled_in_one_batch() -> None:
    """Without batch invariance (the GPU default) prompts of one turn share a prefill call and a first-frame
    sample; every stream still equals the offline decode of its codes."""
    batch_sizes: list[int] = []

    class Recording(Backend):
        def prefill_many(self, rows, prompts, start_positions):
            batch_sizes.append(len(rows))
            return super().prefill_many(rows, prompts, start_positions)

    texts = ["One prompt.", "A second, longer prompt arrives together.", "And a third one."]
    settings = [SynthesisSettings(seed=i, max_new_tokens=12) for i in range(3)]
    with running_engine(batch_invariant=False, warm_up=False, backend_factory=Recording) as engine:
        utterances = asyncio.run(speak_together(engine, settings, texts))
    assert batch_sizes[0] == 3, batch_sizes
    for utt in utterances:
        assert utt.done is not None and utt.done.reason == "stop" and not utt.errors
        assert len(utt.pcm) == utt.codes.shape[1] * 2048 > 0
        assert np.abs(utt.pcm - offline_decode(None, utt.codes)).max() <= 1e-4


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "vocoder_overlap"])
def test_segments_ending_together_share_their_tail_vocoder_calls(overlap: bool) -> None:
    """Three streams admitted in one turn decode in lockstep and end on the same frame (13 = chunks of 4 + 4, tail
    4 + 1): each tail piece of all three goes in one vocoder call, and every event still follows its audio. The same
    with the vocoder's calls moved to the start of the next turn (vocoder_overlap)."""
    calls: list[tuple[list[int], list[int]]] = []  # (slots, frames of each) per backend call

    class Recording(NeverEnding):
        def vocode(self, slots, codes):
            calls.append((list(slots), [c.shape[1] for c in codes]))
            return super().vocode(slots, codes)

    def factory(config: BackendConfig) -> Backend:
        return Recording(dataclasses.replace(config, vocoder_overlap=overlap))

    settings = [SynthesisSettings(seed=i, max_new_tokens=13) for i in range(3)]
    with running_engine(warm_up=False, backend_factory=factory) as engine:
        assert engine._worker.overlap_vocoder is overlap
        utterances = asyncio.run(speak_together(engine, settings, ["Ending together."] * 3))
    assert [frames for _, frames in calls] == [[4] * 3, [4] * 3, [4] * 3, [1] * 3], calls
    for utt in utterances:
        assert utt.done is not None and utt.done.reason == "stop" and [s.frames for s in utt.segments] == [13]
        assert utt.chunk_samples == [4 * 2048, 4 * 2048, 4 * 2048, 2048]
        assert np.abs(utt.pcm - offline_decode(None, utt.codes)).max() <= 1e-4


def test_an_utterance_stops_at_its_audio_cap() -> None:
    """max_audio_s ends the utterance mid-segment (reason max_audio) and drops its later segments unspoken."""

    async def main():
        with running_engine() as engine:
            s = engine.open_session(Voice(), SynthesisSettings(seed=4, max_new_tokens=400, max_audio_s=0.5))
            s.speak("This first sentence is long enough to pass half a second of audio by far, surely.")
            s.speak("A second segment that must never be spoken.")
            s.end_utterance()
            out = await collect(s)
            s.close()
            return out

    out = asyncio.run(main())
    cap_frames = -(-int(0.5 * 44100) // 2048)  # the first frame count whose audio reaches 0.5 s
    assert out.done is not None and out.done.reason == "max_audio"
    assert [(seg.ended_by, seg.frames) for seg in out.segments] == [("max_audio", cap_frames)]
    assert len(out.pcm) == cap_frames * 2048


def test_cancelling_an_ended_utterance_leaves_the_next_one_speaking() -> None:
    """cancel(u) for an utterance whose generation is over must not abort the segment of the one now decoding."""

    async def main():
        with running_engine() as engine:
            s = engine.open_session(Voice(), SynthesisSettings(seed=6, max_new_tokens=300))
            s.speak("First.")
            first = s.end_utterance()
            s.speak("The second utterance is long enough to still be decoding when that cancel arrives.")
            second = s.end_utterance()
            events = []
            while True:  # until the second utterance's first audio: the first one's generation is over
                ev = await s.next_event()
                events.append(ev)
                if isinstance(ev, AudioChunk) and ev.utterance == second:
                    break
            s.cancel(first)
            with contextlib.suppress(TimeoutError):  # an aborted segment would leave the utterance unfinished
                while not (isinstance(events[-1], UtteranceDone) and events[-1].utterance == second):
                    events.append(await asyncio.wait_for(s.next_event(), 30))
            s.close()
            return first, second, events

    first, second, events = asyncio.run(main())
    assert any(isinstance(e, Cancelled) and e.utterance == first for e in events)
    done = [e for e in events if isinstance(e, SegmentDone) and e.utterance == second]
    assert len(done) == 1 and done[0].ended_by in ("end_token", "max_new_tokens")  # not aborted
    assert events[-1].reason == "stop"


def test_after_a_cancel_the_next_utterance_starts_a_fresh_vocoder() -> None:
    """A barge-in mid-segment leaves the vocoder's causal state mid-stream: the next utterance must start from a
    reset state, so its streamed audio equals the offline decode of its own codes."""

    async def main():
        with running_engine() as engine:
            s = engine.open_session(Voice(), SynthesisSettings(seed=8, max_new_tokens=300))
            s.speak("This utterance is long enough to be cut off in the middle of a word by the cancel.")
            await s.next_event()  # its audio has started
            s.cancel()
            await collect(s)
            after = await speak(s, "And a short one after it.")
            s.close()
            return after

    after = asyncio.run(main())
    assert after.done is not None and len(after.pcm) == after.codes.shape[1] * 2048 > 0
    assert np.abs(after.pcm - offline_decode(None, after.codes)).max() <= 1e-4


def test_warm_up_vocodes_one_row_at_every_chunk_size_and_resets_its_slot() -> None:
    """Warm-up runs the vocoder once at every chunk size (each has its own graph on a GPU) before ready, and leaves
    the slot it used reset."""
    from streaming.chunking import all_chunk_sizes

    calls: list[tuple[list[int], int]] = []

    class Recording(Backend):
        def vocode(self, slots, codes):
            calls.append((list(slots), codes[0].shape[1]))
            return super().vocode(slots, codes)

    with running_engine(max_sessions=16, backend_factory=Recording) as engine:
        state = asyncio.run(engine.run_job(lambda w: w.b.vocoder.state[:16].abs().max().item()))
    assert calls == [([0], f) for f in all_chunk_sizes()]
    assert state == 0.0


def test_an_empty_utterance_ended_meanwhile_finishes_after_the_one_still_speaking() -> None:
    """Events stay in utterance order: a session ends utterance 0 (text still generating), then ends utterance 1
    with no text at all. Utterance 1's UtteranceDone must come after every audio chunk and the UtteranceDone of
    utterance 0 (it used to be posted at once, overtaking the audio), and report no audio of its own."""

    async def main():
        with running_engine() as engine:
            s = engine.open_session(Voice(), SynthesisSettings(seed=2, max_new_tokens=40))
            s.speak("A sentence that takes a while to speak.")
            s.end_utterance()
            s.end_utterance()  # utterance 1: nothing to say
            events = []
            while not (isinstance(ev := await asyncio.wait_for(s.next_event(), 60), UtteranceDone) and ev.utterance):
                events.append(ev)
            s.close()
            return events, ev

    events, last = asyncio.run(main())
    kinds = [(type(e).__name__, getattr(e, "utterance", None)) for e in events]
    assert ("AudioChunk", 0) in kinds and kinds[-1] == ("UtteranceDone", 0), kinds
    assert last.utterance == 1 and last.audio_samples == 0 and last.reason == "stop"

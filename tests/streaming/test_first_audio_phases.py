"""The worker's split of an utterance's way to first audio (/metrics `first_audio_*`): measured, bounded by what a
client sees, and no marks left behind by cancelled, failed or silent utterances."""

from __future__ import annotations

import asyncio
import threading
import time

from streaming.session import AudioChunk, SessionError, SynthesisSettings, Voice
from tests.streaming.engine_helpers import EVENT_TIMEOUT_S, RANDOM_TINY_MODEL, collect, running_engine

PHASES = ("first_audio_wait_seconds", "first_audio_prefill_seconds", "first_audio_decode_seconds")


def test_first_audio_phases_add_up_to_no_more_than_the_client_waited() -> None:
    async def main():
        with running_engine(RANDOM_TINY_MODEL, max_sessions=2) as engine:
            before = engine.stats()
            waited = []
            for text in ("Hello there, this is the first utterance.", "And a second one on the same session."):
                session = engine.open_session(Voice(), SynthesisSettings(seed=1, max_new_tokens=24))
                sent = time.monotonic()
                session.speak(text)
                session.end_utterance()
                while not isinstance(await asyncio.wait_for(session.next_event(), EVENT_TIMEOUT_S), AudioChunk):
                    pass
                waited.append(time.monotonic() - sent)
                await collect(session)
                session.close()
            return before, engine.stats(), waited

    before, after, waited = asyncio.run(main())
    assert after["first_audio_utterances"] - before["first_audio_utterances"] == 2
    phases = [after[k] - before[k] for k in PHASES]
    assert all(p >= 0 for p in phases), phases
    # decoding and vocoding a first chunk of frames takes real time; the worker's part never exceeds the client's
    # (its clock starts when the text is applied, after it was sent, and stops when the audio is posted)
    assert phases[1] + phases[2] > 0
    assert sum(phases) <= sum(waited) + 2e-3 * len(waited), (phases, waited)


def test_no_first_audio_marks_outlive_cancelled_or_failed_utterances() -> None:
    async def main():
        with running_engine(max_sessions=2) as engine:
            cancelled = engine.open_session(Voice(), SynthesisSettings(seed=2, max_new_tokens=200))
            failed = engine.open_session(Voice(), SynthesisSettings(seed=3))
            gate = threading.Event()
            held = asyncio.ensure_future(engine.run_job(lambda w: gate.wait(10)))  # commands pile up meanwhile
            await asyncio.sleep(0.05)
            utt = cancelled.speak("An utterance cancelled before the worker starts it.")
            cancelled.end_utterance()
            cancelled.cancel(utt)
            failed.speak("x" * 5000)  # longer than the model's context: fails when its segment starts (not ended:
            # an ended utterance's marks also go when it finishes)
            await asyncio.sleep(0.05)
            gate.set()
            await held
            outs = await asyncio.gather(collect(cancelled), collect(failed, until=(SessionError,)))
            marks = await engine.run_job(lambda w: {sid: dict(st.first_audio_marks) for sid, st in w.streams.items()})
            return outs, marks

    (cancelled, failed), marks = asyncio.run(main())
    assert cancelled.cancelled is not None and failed.errors and failed.errors[0].code == "prompt_too_long"
    assert len(marks) == 2 and all(not m for m in marks.values()), marks

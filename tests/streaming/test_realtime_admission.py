"""Admission by real-time headroom (streaming.realtime_admission): the running average of decoding turns against a
share of a frame's duration, with hysteresis, and forgotten when the engine idles. The live-server behaviour is
tests/server/test_live_protocol.py's."""

from __future__ import annotations

import pytest

from streaming.realtime_admission import RESUME_RATIO, STALE_S, RealtimeAdmission

FRAME_S = 2048 / 44100


def feed(guard: RealtimeAdmission, turn_s: float, n: int, start: float, every_s: float = 0.05) -> float:
    t = start
    for _ in range(n):
        t += every_s
        guard.record_turn(turn_s, now=t)
    return t


def test_refuses_while_turns_are_slower_than_the_limit_and_admits_with_hysteresis() -> None:
    guard = RealtimeAdmission(FRAME_S, 0.9)
    limit = 0.9 * FRAME_S
    t = feed(guard, 0.5 * limit, 20, 0.0)
    assert guard.refusal(now=t) is None
    t = feed(guard, 1.5 * limit, 20, t)  # the average climbs past the limit
    message = guard.refusal(now=t)
    assert message is not None and "behind real time" in message and "--admission-turn-fraction" in message
    # just under the limit is not enough to admit again (hysteresis) ...
    t = feed(guard, 0.95 * limit, 40, t)
    assert guard.refusal(now=t) is not None
    # ... below RESUME_RATIO of it is
    t = feed(guard, 0.5 * RESUME_RATIO * limit, 40, t)
    assert guard.refusal(now=t) is None


def test_an_idle_engine_admits_and_restarts_its_average() -> None:
    guard = RealtimeAdmission(FRAME_S, 0.9)
    t = feed(guard, 2 * FRAME_S, 10, 0.0)
    assert guard.refusal(now=t) is not None
    assert guard.refusal(now=t + STALE_S + 0.01) is None  # no decoding turn for a while: the average is stale
    guard.record_turn(0.1 * FRAME_S, now=t + 5)  # the first turn after the pause starts the average afresh
    assert guard.turn_avg_s == pytest.approx(0.1 * FRAME_S) and guard.refusal(now=t + 5) is None


def test_an_engine_whose_turns_take_seconds_is_not_taken_for_an_idle_one() -> None:
    """Far behind (a 1.5 s turn, say a burst of prefills on a slow machine): during the next turn, longer than
    STALE_S after the last one ended, new sessions are still refused, and that turn extends the average."""
    guard = RealtimeAdmission(FRAME_S, 0.9)
    t = feed(guard, 1.5, 3, 0.0, every_s=1.5)
    assert guard.refusal(now=t + 1.2) is not None  # mid-turn, 1.2 s after the last turn ended
    guard.record_turn(1.6, now=t + 1.6)
    assert guard.turn_avg_s > 1.5 and guard.refusal(now=t + 1.7) is not None


def test_off_never_refuses_and_bad_limits_are_refused() -> None:
    guard = RealtimeAdmission(FRAME_S, None)
    t = feed(guard, 10 * FRAME_S, 10, 0.0)
    assert guard.refusal(now=t) is None and guard.turn_avg_s > FRAME_S  # still measured (for /metrics)
    for bad in (0.0, -1.0, 2.5):
        with pytest.raises(ValueError, match="max_turn_fraction"):
            RealtimeAdmission(FRAME_S, bad)


def test_turns_that_only_wait_for_back_pressured_clients_do_not_count() -> None:
    """A client that stops reading stalls its stream; the worker's turns then only nap (idle_wait_s, 50 ms): slower
    than the limit here, yet the engine is not behind real time, so new sessions must not be refused for it."""
    import asyncio
    import time

    from streaming.session import SynthesisSettings, Voice
    from tests.streaming.engine_helpers import running_engine

    async def main() -> tuple[bool, str | None]:
        with running_engine(max_sessions=2, max_undelivered_s=0.05, admission_turn_fraction=0.5) as engine:
            session = engine.open_session(Voice(), SynthesisSettings(seed=1))
            session.speak("A long sentence that nobody reads, " * 8)
            session.end_utterance()  # and never read: the stream stalls after 0.05 s of audio
            worker = engine._worker
            deadline = time.monotonic() + 60
            while not any(st.stalled_since is not None for st in worker.streams.values()):
                assert time.monotonic() < deadline, "the stream never stalled"
                await asyncio.sleep(0.05)
            await asyncio.sleep(1.5)  # stalled turns only, for longer than STALE_S
            stalled = any(st.stalled_since is not None for st in worker.streams.values())
            return stalled, worker.admission.refusal()

    stalled, refusal = asyncio.run(main())
    assert stalled and refusal is None


def test_capacity_lets_a_burst_in_a_few_turns_at_a_time_up_to_the_limit() -> None:
    """A burst far above capacity (as on the H200: 384 clients, turns of 3 ms + 0.12 ms a stream): admitting only
    as many sessions as the last turns' estimate allows ramps up turn by turn and settles near the streams that fit
    the limit, never past it — where the average alone let sessions in until turns took 69 ms."""
    limit = 0.9 * FRAME_S
    fixed_s, per_row_s = 0.003, 0.00012
    fits = int((limit - fixed_s) / per_row_s)  # 323 streams: the real capacity at the limit
    guard = RealtimeAdmission(FRAME_S, 0.9)
    working, t, turns = 1, 0.0, []
    for _ in range(60):
        t += 0.05
        guard.record_turn(fixed_s + per_row_s * working, rows=working, now=t)
        turns.append(fixed_s + per_row_s * working)
        while working < 1000 and guard.refusal(working=working, now=t) is None:  # the burst waits at the door
            working += 1
    assert max(turns) <= limit  # no turn past the limit, so no admitted stream underruns
    assert 0.9 * fits <= working <= fits, (working, fits)
    message = guard.refusal(working=working, now=t)
    assert message is not None and "real-time capacity" in message and "--admission-turn-fraction" in message


def test_capacity_counts_only_sessions_with_work_and_always_admits_one() -> None:
    guard = RealtimeAdmission(FRAME_S, 0.9)
    # nothing measured yet (a fresh server): one at a time until the first turn gives an estimate
    assert guard.capacity() == 1.0 and guard.refusal(working=0, now=0.0) is None
    assert "real-time capacity" in (guard.refusal(working=1, now=0.0) or "")
    guard.record_turn(0.02, rows=2, now=1.0)  # 10 ms a stream: ~4 fit 41.8 ms
    assert guard.capacity() == pytest.approx(0.9 * FRAME_S * 2 / 0.02)
    assert guard.refusal(working=3, now=1.0) is None and guard.refusal(working=4, now=1.0) is not None
    slow = RealtimeAdmission(FRAME_S, 0.9)
    slow.record_turn(2 * FRAME_S, rows=1, now=1.0)  # too slow for even one stream: it still serves one
    assert slow.refusal(working=0, now=1.0 + STALE_S + 1) is None and slow.capacity() == 1.0
    assert RealtimeAdmission(FRAME_S, None).capacity() is None


def test_sessions_without_work_do_not_count_against_the_capacity() -> None:
    """On a real engine with a limit no CPU turn meets (capacity 1): once the average is stale, idle sessions are all
    admitted (a live socket waiting for text costs the GPU nothing), one speaking session fills the capacity so the
    next one is refused with the flag named, and when it has finished the next one is admitted again."""
    import asyncio
    import time

    from streaming.errors import Overloaded
    from streaming.session import SynthesisSettings, Voice
    from tests.streaming.engine_helpers import running_engine, speak

    async def settle(engine, idle: int) -> None:  # the worker has counted its idle sessions and the average is stale
        deadline = time.monotonic() + 30
        while engine._worker.idle_streams != idle:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.02)
        await asyncio.sleep(STALE_S + 0.2)

    async def main() -> None:
        with running_engine(max_sessions=6, admission_turn_fraction=0.01) as engine:
            first = engine.open_session(Voice(), SynthesisSettings(seed=1))
            await speak(first, "Hello there.")
            assert engine._worker.admission.capacity() == 1.0
            await settle(engine, 1)
            idle = [first]
            for n in range(3):
                idle.append(engine.open_session(Voice(), SynthesisSettings(seed=2 + n)))
                await settle(engine, len(idle))
            speaking = asyncio.ensure_future(
                speak(idle[1], "A sentence long enough to keep the engine busy for a while.")
            )
            deadline = time.monotonic() + 30
            while engine._worker.idle_streams == len(idle):
                assert time.monotonic() < deadline
                await asyncio.sleep(0.01)
            with pytest.raises(Overloaded, match="--admission-turn-fraction"):
                engine.open_session(Voice(), SynthesisSettings(seed=9))
            await speaking
            await settle(engine, len(idle))
            engine.open_session(Voice(), SynthesisSettings(seed=10)).close()

    asyncio.run(main())


def test_admit_waits_while_deferred_then_admits_or_refuses_saying_how_long_it_waited() -> None:
    """Engine.admit (the server's way in): while the real-time admission defers new sessions (here a limit every CPU
    turn exceeds), a new session waits instead of being refused at once — counted in `admission_waiting` — and is
    admitted as soon as the guard lets it in (the engine idles once the running stream ends); with a short wait the
    refusal stands and says how long it waited. The running stream is never disturbed."""
    import asyncio
    import time

    from streaming.errors import AdmissionDeferred
    from streaming.session import SynthesisSettings, Voice
    from tests.streaming.engine_helpers import collect, running_engine, speak
    from tests.streaming.test_admission_queue import assert_waited

    async def main() -> None:
        with running_engine(max_sessions=4, admission_turn_fraction=0.001) as engine:
            first = await engine.admit(Voice(), SynthesisSettings(seed=1), wait_s=0)
            first.speak("A sentence long enough to keep the engine busy for a while, and a little more.")
            first.end_utterance()
            running = asyncio.ensure_future(collect(first))
            deadline = time.monotonic() + 60
            while not engine._worker.admission.behind_now():
                assert time.monotonic() < deadline, "the engine never fell behind its (impossible) limit"
                await asyncio.sleep(0.01)
            t0 = time.monotonic()
            with pytest.raises(AdmissionDeferred, match=r"--admission-turn-fraction.*\(waited") as refused:
                await engine.admit(Voice(), SynthesisSettings(seed=2), wait_s=0.25)
            waited = time.monotonic() - t0
            assert waited >= 0.25
            assert_waited(str(refused.value), 0.25, waited)  # what it says it waited: no more than it did
            assert engine.admission_waiting == 0
            later = asyncio.ensure_future(engine.admit(Voice(), SynthesisSettings(seed=3), wait_s=60))
            deadline = time.monotonic() + 30
            while not (engine.admission_waiting or later.done()):  # it tried, was deferred and joined the queue
                assert time.monotonic() < deadline, "the second session never queued"
                await asyncio.sleep(0.01)
            assert not later.done() and engine.stats()["admission_waiting"] == 1
            done = await running
            second = await later  # the stream ended; the engine idles; the waiting session is let in
            assert engine.admission_waiting == 0
            assert done.done is not None and done.done.reason == "stop" and len(done.pcm) > 0
            heard = await speak(second, "Admitted after waiting.")
            assert heard.done is not None and heard.done.reason == "stop" and len(heard.pcm) > 0

    asyncio.run(main())


def test_a_tighter_capacity_fraction_caps_streams_below_the_behind_limit() -> None:
    """--admission-capacity-fraction: the capacity cap fits the streams into that share of a frame while the "behind"
    guard keeps the turn fraction's limit: a burst settles near the streams whose turns fit 2/3 of a frame, and a turn
    between the two limits does not close admission."""
    fixed_s, per_row_s = 0.003, 0.00008

    def settle(guard: RealtimeAdmission) -> int:
        working, t = 1, 0.0
        for _ in range(80):
            t += 0.05
            guard.record_turn(fixed_s + per_row_s * working, rows=working, now=t)
            while working < 2000 and guard.refusal(working=working, now=t) is None:
                working += 1
        return working

    tight = RealtimeAdmission(FRAME_S, 0.9, capacity_fraction=2 / 3)
    assert tight.capacity_limit_s == pytest.approx(2 / 3 * FRAME_S) and tight.limit_s == pytest.approx(0.9 * FRAME_S)
    fits_tight = (2 / 3 * FRAME_S - fixed_s) / per_row_s  # 349 streams
    fits_loose = (0.9 * FRAME_S - fixed_s) / per_row_s  # 485 streams
    assert 0.9 * fits_tight <= settle(tight) <= fits_tight
    assert 0.9 * fits_loose <= settle(RealtimeAdmission(FRAME_S, 0.9)) <= fits_loose
    between = RealtimeAdmission(FRAME_S, 0.9, capacity_fraction=2 / 3)
    between.record_turn(0.8 * FRAME_S, rows=400, now=1.0)  # past the capacity's turn, under the limit: not behind
    assert not between.behind_now(now=1.0)
    message = between.refusal(working=400, now=1.0)
    assert message is not None and "--admission-capacity-fraction" in message
    with pytest.raises(ValueError, match="capacity_fraction"):
        RealtimeAdmission(FRAME_S, 0.9, capacity_fraction=3)

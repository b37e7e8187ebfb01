"""The worker's events reach the sessions' event loop in one call per flush, in order, and one session's failure to
take an event does not cost the others theirs (streaming.session.Outbox)."""

from __future__ import annotations

import asyncio
import logging
import threading

import numpy as np

from streaming.session import AudioChunk, Outbox, SegmentDone, Session, SynthesisSettings, Voice


def _sessions(loop: asyncio.AbstractEventLoop, n: int) -> list[Session]:
    return [Session(Voice(), SynthesisSettings(), lambda cmd: None, loop) for _ in range(n)]


def _count_wakeups(loop: asyncio.AbstractEventLoop) -> list[int]:
    calls = [0]
    real = loop.call_soon_threadsafe

    def counting(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
    return calls


def test_a_flush_is_one_call_to_the_loop_and_keeps_each_sessions_order() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        sessions = _sessions(loop, 3)
        calls = _count_wakeups(loop)
        box = Outbox()

        def worker() -> None:  # a plain thread: asyncio.to_thread would call the loop itself
            for i in range(4):
                for s in sessions:
                    box.post(s, AudioChunk(0, np.full(10, i, np.float32)))
            box.post(sessions[1], SegmentDone(0, "text", 4, "end_token", np.zeros((4, 4), np.int64)))
            assert all(s.posted_samples == 40 for s in sessions)  # back-pressure counts at post, before the flush
            assert not any(s._events for s in sessions)  # nothing reaches a session before the flush
            box.flush()
            box.flush()  # nothing left: no call

        t = threading.Thread(target=worker)
        t.start()
        t.join()
        assert calls[0] == 1
        for s in sessions:
            got = [await s.next_event() for _ in range(4)]
            assert [int(ev.pcm[0]) for ev in got] == [0, 1, 2, 3]
        assert isinstance(await sessions[1].next_event(), SegmentDone)

    asyncio.run(main())


def test_one_session_failing_to_take_an_event_leaves_the_others_theirs(caplog) -> None:
    async def main() -> list[Session]:
        loop = asyncio.get_running_loop()
        sessions = _sessions(loop, 3)

        def broken(ev) -> None:
            raise RuntimeError("boom")

        sessions[0].deliver = broken  # type: ignore[method-assign]
        box = Outbox()
        for s in sessions:
            box.post(s, AudioChunk(0, np.zeros(5, np.float32)))
        box.flush()
        await asyncio.sleep(0)  # the flush's callback runs
        return sessions

    with caplog.at_level(logging.ERROR, logger="streaming.session"):
        sessions = asyncio.run(main())
    assert [len(s._events) for s in sessions[1:]] == [1, 1]
    assert any("delivering AudioChunk" in r.getMessage() for r in caplog.records)


def test_a_closed_loop_drops_the_events_without_raising() -> None:
    loop = asyncio.new_event_loop()
    sessions = _sessions(loop, 1)
    loop.close()
    box = Outbox()
    box.post(sessions[0], AudioChunk(0, np.zeros(5, np.float32)))
    box.flush()
    assert len(box) == 0

"""The admission queue (streaming.admission_queue): deferred sessions wait first come, first served, are woken one at a
time by notify() (from any thread), cost no retries between notifications beyond the head's slow retry, and leave
with a refusal that says how long they waited."""

from __future__ import annotations

import asyncio
import threading

import pytest

from streaming.admission_queue import HEAD_RETRY_S, AdmissionQueue
from streaming.errors import AdmissionDeferred


class Door:
    """A stand-in for the engine's admission: admits while it has room, counting every try."""

    def __init__(self, room: int = 0) -> None:
        self.room = room
        self.tries = 0
        self.admitted: list[str] = []

    def opener(self, name: str):
        def try_open() -> str:
            self.tries += 1
            if self.room <= 0:
                raise AdmissionDeferred("the engine is at its real-time capacity; retry later")
            self.room -= 1
            self.admitted.append(name)
            return name

        return try_open


def test_waiters_are_admitted_in_arrival_order_one_notify_per_turn() -> None:
    async def main() -> None:
        queue, door = AdmissionQueue(max_waiting=8), Door()
        tasks = [asyncio.ensure_future(queue.admit(door.opener(n), wait_s=30)) for n in "abcd"]
        await asyncio.sleep(0.01)
        assert len(queue) == 4 and door.admitted == []
        door.room = 2
        tries = door.tries
        threading.Thread(target=queue.notify).start()  # the worker's thread, at the end of a turn
        await asyncio.sleep(0.02)
        assert door.admitted == ["a", "b"] and len(queue) == 2
        assert door.tries - tries <= 4  # two admitted, one refused try (and at most one slow retry of the head)
        door.room = 5
        queue.notify()
        assert await asyncio.gather(*tasks) == ["a", "b", "c", "d"]
        assert len(queue) == 0

    asyncio.run(main())


def test_a_waiting_crowd_costs_only_the_heads_slow_retries() -> None:
    async def main() -> int:
        queue, door = AdmissionQueue(max_waiting=64), Door()
        tasks = [asyncio.ensure_future(queue.admit(door.opener(str(n)), wait_s=30)) for n in range(50)]
        await asyncio.sleep(0.01)
        before = door.tries
        await asyncio.sleep(0.5)
        spent = door.tries - before
        door.room = 50
        queue.notify()
        await asyncio.gather(*tasks)
        return spent

    spent = asyncio.run(main())
    assert spent <= 0.5 / HEAD_RETRY_S + 2  # only the head retries (a 10 ms poll per waiter: ~2,500 tries)


def test_the_refusal_stands_after_the_wait_and_says_how_long() -> None:
    async def main() -> None:
        queue, door = AdmissionQueue(max_waiting=8), Door()
        with pytest.raises(AdmissionDeferred, match=r"real-time capacity.*\(waited 0\.[23] s\)"):
            await queue.admit(door.opener("a"), wait_s=0.25)
        assert len(queue) == 0
        with pytest.raises(AdmissionDeferred, match=r"real-time capacity; retry later$"):
            await queue.admit(door.opener("b"), wait_s=0)  # no wait: refused at once, as before the queue

    asyncio.run(main())


def test_a_full_queue_answers_at_once_and_a_cancelled_waiter_passes_its_turn_on() -> None:
    async def main() -> None:
        queue, door = AdmissionQueue(max_waiting=2), Door()
        first = asyncio.ensure_future(queue.admit(door.opener("a"), wait_s=30))
        second = asyncio.ensure_future(queue.admit(door.opener("b"), wait_s=30))
        await asyncio.sleep(0.01)
        with pytest.raises(AdmissionDeferred):
            await queue.admit(door.opener("c"), wait_s=30)  # two already wait
        door.room = 1
        queue.notify()
        first.cancel()  # the client went away just as its turn came
        assert await second == "b"
        with pytest.raises(asyncio.CancelledError):
            await first
        assert len(queue) == 0

    asyncio.run(main())


def test_other_errors_pass_through_at_once() -> None:
    async def main() -> None:
        queue = AdmissionQueue(max_waiting=2)

        def not_ready() -> str:
            raise RuntimeError("not ready")

        with pytest.raises(RuntimeError, match="not ready"):
            await queue.admit(not_ready, wait_s=30)
        assert len(queue) == 0

    asyncio.run(main())

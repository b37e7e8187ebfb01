"""The admission queue (streaming.admission_queue): deferred sessions wait first come, first served, are woken one at a
time by notify() (from any thread), cost no retries between notifications beyond the head's slow retry, and leave
with a refusal that says how long they waited."""

from __future__ import annotations

import asyncio
import re
import threading
import time

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


def slow_retries_in(seconds: float) -> float:
    """The most tries the head's slow retry makes in `seconds` (one every HEAD_RETRY_S, plus one either end)."""
    return seconds / HEAD_RETRY_S + 2


async def until(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the condition never held"
        await asyncio.sleep(0.001)


def assert_waited(message: str, wait_s: float, elapsed_s: float) -> None:
    """The refusal's "(waited X s)" is at least the wait asked for and at most what the caller measured around it
    (to its one decimal), however long a loaded machine took."""
    match = re.search(r"\(waited (\d+\.\d) s\)", message)
    assert match is not None, message
    assert wait_s - 0.05 - 1e-9 <= float(match.group(1)) <= elapsed_s + 0.05 + 1e-9, (message, elapsed_s)


def test_waiters_are_admitted_in_arrival_order_one_notify_per_turn() -> None:
    async def main() -> None:
        queue, door = AdmissionQueue(max_waiting=8), Door()
        tasks = [asyncio.ensure_future(queue.admit(door.opener(n), wait_s=30)) for n in "abcd"]
        await asyncio.sleep(0.01)
        assert len(queue) == 4 and door.admitted == []
        door.room = 2
        tries, t0 = door.tries, time.monotonic()
        notifier = threading.Thread(target=queue.notify)  # the worker's thread, at the end of a turn
        notifier.start()
        notifier.join()
        await until(lambda: len(door.admitted) == 2 and len(queue) == 2)
        assert door.admitted == ["a", "b"] and len(queue) == 2
        # two admitted, one refused try, and the head's slow retries while this (maybe loaded) machine got there
        assert door.tries - tries <= 3 + slow_retries_in(time.monotonic() - t0)
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
        before, t0 = door.tries, time.monotonic()
        await asyncio.sleep(0.5)
        spent, elapsed = door.tries - before, time.monotonic() - t0  # a loaded machine may sleep longer than asked
        door.room = 50
        queue.notify()
        await asyncio.gather(*tasks)
        return spent, elapsed

    spent, elapsed = asyncio.run(main())
    assert spent <= slow_retries_in(elapsed)  # only the head retries (a 10 ms poll per waiter: ~2,500 tries)


def test_the_refusal_stands_after_the_wait_and_says_how_long() -> None:
    async def main() -> None:
        queue, door = AdmissionQueue(max_waiting=8), Door()
        t0 = time.monotonic()
        with pytest.raises(AdmissionDeferred, match=r"real-time capacity.*\(waited \d+\.\d s\)") as refused:
            await queue.admit(door.opener("a"), wait_s=0.25)
        assert_waited(str(refused.value), 0.25, time.monotonic() - t0)
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

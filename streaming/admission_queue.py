"""Sessions waiting for the real-time admission to let them in: first come, first served, woken one at a time.

A session the real-time admission defers (streaming.realtime_admission raises AdmissionDeferred through
`try_open`) waits here for up to its `wait_s` instead of being refused at once. Nobody polls: the worker calls
`notify()` after each turn and the engine when a session closes; that wakes the head of the queue on its event loop,
it tries again, and once admitted it wakes the next one. A turn that made room for n sessions admits them with n + 1
tries, and a waiting crowd costs nothing between turns (a retry timer per waiter would cost the event loop — and,
through the GIL, the worker — work in proportion to the crowd, every few milliseconds). The head alone also retries
every HEAD_RETRY_S, for the moment the engine goes idle (no turns, so no notify) and the admission lets it in.

New sessions queue behind the waiting ones rather than overtaking them. At most `max_waiting` wait; beyond that a
deferred session is refused at once.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections.abc import Callable
from typing import TypeVar

from .errors import AdmissionDeferred

T = TypeVar("T")

HEAD_RETRY_S = 0.05  # the head of the queue also tries this often (an idle engine takes no turns to notify it)


class _Waiter:
    __slots__ = ("loop", "woken")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.woken = asyncio.Event()


class AdmissionQueue:
    def __init__(self, max_waiting: int) -> None:
        self.max_waiting = max_waiting
        self._waiters: collections.deque[_Waiter] = collections.deque()
        self._wake_pending = False

    def __len__(self) -> int:
        return len(self._waiters)

    async def admit(self, try_open: Callable[[], T], wait_s: float) -> T:
        """try_open()'s result, trying now (when nobody waits) and then each time this session's turn comes, for up
        to `wait_s`; after that the last AdmissionDeferred stands, saying how long it waited. try_open's other
        errors pass through at once."""
        started = time.monotonic()
        if not self._waiters or wait_s <= 0:
            try:
                return try_open()
            except AdmissionDeferred:
                if wait_s <= 0 or len(self._waiters) >= self.max_waiting:
                    raise
        elif len(self._waiters) >= self.max_waiting:
            return try_open()  # a full queue: this one gets the plain answer, admitted or refused now
        waiter = _Waiter(asyncio.get_running_loop())
        self._waiters.append(waiter)
        try:
            while True:
                remaining = started + wait_s - time.monotonic()
                if remaining <= 0:
                    return self._last_try(try_open, started)
                head = self._waiters[0] is waiter
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(waiter.woken.wait(), min(remaining, HEAD_RETRY_S) if head else remaining)
                if not (waiter.woken.is_set() or self._waiters[0] is waiter):
                    continue  # its deadline: the loop's top makes the last try
                waiter.woken.clear()
                try:
                    session = try_open()
                except AdmissionDeferred:
                    continue  # not yet: it keeps its place
                self._waiters.remove(waiter)
                self._wake_next()  # the next one may fit too
                return session
        finally:
            if waiter in self._waiters:
                self._waiters.remove(waiter)
                if self._waiters and waiter.woken.is_set():
                    self._wake_next()  # it was woken but leaves (cancelled): pass the turn on

    def _last_try(self, try_open: Callable[[], T], started: float) -> T:
        try:
            return try_open()
        except AdmissionDeferred as e:
            raise AdmissionDeferred(f"{e} (waited {time.monotonic() - started:.1f} s)") from None

    def notify(self) -> None:
        """Room may have been made (a turn ended, a session closed): wake the head of the queue. Any thread."""
        if not self._waiters or self._wake_pending:
            return
        try:
            loop = self._waiters[0].loop
        except IndexError:  # emptied meanwhile by the event loop's thread
            return
        self._wake_pending = True
        try:
            loop.call_soon_threadsafe(self._woken_by_notify)
        except RuntimeError:  # that loop has closed
            self._wake_pending = False

    def _woken_by_notify(self) -> None:
        self._wake_pending = False
        self._wake_next()

    def _wake_next(self) -> None:
        """Wake the first waiter not woken yet (on its own loop)."""
        for waiter in self._waiters:
            if not waiter.woken.is_set():
                if waiter.loop is _running_loop():
                    waiter.woken.set()
                else:
                    with contextlib.suppress(RuntimeError):
                        waiter.loop.call_soon_threadsafe(waiter.woken.set)
                return


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:  # called from a thread without one
        return None

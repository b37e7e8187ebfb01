"""Seconds the GPU spent on named spans of a turn's work (prefill, step, vocode), from CUDA events.

A turn's wall time by phase (worker.py) says where the host waited, not what the device did meanwhile: with the
vocoder beside the step the two share the GPU, and a phase's wall time includes host work and waits. Each span
records an event before and after its work on the stream it is queued on; `settle` adds the spans the device has
finished (non-blocking `query`) and keeps the rest for later, so reading them never waits. Off (no events) on CPU.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterator

import torch

MAX_PENDING = 4096  # spans not yet settled; beyond this the oldest are dropped uncounted (settle is never called)


class DeviceTimes:
    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.seconds: collections.Counter[str] = collections.Counter()
        self._pending: collections.deque[tuple[str, torch.cuda.Event, torch.cuda.Event]] = collections.deque(
            maxlen=MAX_PENDING
        )

    @contextlib.contextmanager
    def span(self, name: str) -> Iterator[None]:
        """Time the work queued on the current stream inside the block (also when it raises)."""
        if not self.enabled:
            yield
            return
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        try:
            yield
        finally:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._pending.append((name, start, end))

    def settle(self) -> None:
        """Add every span the device has finished; the others wait for a later call."""
        left: collections.deque[tuple[str, torch.cuda.Event, torch.cuda.Event]] = collections.deque(maxlen=MAX_PENDING)
        for name, start, end in self._pending:
            if end.query():
                self.seconds[name] += start.elapsed_time(end) / 1e3
            else:
                left.append((name, start, end))
        self._pending = left

    @property
    def pending(self) -> int:
        return len(self._pending)

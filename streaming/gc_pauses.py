"""Python's cyclic garbage collector: its pauses measured and logged, and made rarer by freezing start-up objects.

A collection holds the GIL, so it stops the event loop and the engine's worker alike: every stream waits. After
start-up the process holds hundreds of thousands of long-lived objects (torch, compiled graphs, caches; importing
torch and inductor alone: ~290,000, a full collection 150 ms on a 2-core CI machine), which every full collection
walks again. `freeze_startup_objects` collects once and moves what survived to the permanent generation (`gc.freeze`),
so later collections walk only what requests created. `GcPauses` records each collection's duration through
`gc.callbacks` (for /metrics) and logs the long ones: a warning for those the interpreter started (they stop running
streams unannounced), a debug line for the collections the freezes here ask for (start-up, idle time; they are
counted all the same). At exit the frozen objects are handed back to the collector: what stays frozen is never freed,
and Triton's bindings (nanobind) then print a page of "leaked" objects on every exit.
"""

from __future__ import annotations

import atexit
import gc
import logging
import threading
import time

log = logging.getLogger(__name__)

LONG_PAUSE_S = 0.05  # a collection longer than this is logged (a warning at most every LOG_EVERY_S)
LOG_EVERY_S = 10.0

_deliberate = threading.local()  # .active: this thread runs a collection that a freeze below asked for


class GcPauses:
    """Counts and times collections while installed (process-wide; install one at a time)."""

    def __init__(self) -> None:
        self.collections = 0
        self.pause_s = 0.0
        self.max_pause_s = 0.0
        self.long_pauses = 0
        self._started: dict[int, float] = {}  # thread id → start of the collection it runs
        self._logged_at = -float("inf")

    def install(self) -> None:
        if self._callback not in gc.callbacks:
            gc.callbacks.append(self._callback)

    def uninstall(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        now = time.perf_counter()
        tid = threading.get_ident()
        if phase == "start":
            self._started[tid] = now
            return
        started = self._started.pop(tid, None)
        if started is None:
            return
        pause = now - started
        self.collections += 1
        self.pause_s += pause
        self.max_pause_s = max(self.max_pause_s, pause)
        if pause > LONG_PAUSE_S:
            self.long_pauses += 1
            if getattr(_deliberate, "active", False):  # ours, at start-up or idle: nothing is wrong
                log.debug(
                    "garbage collection (generation %d, before a freeze) took %.0f ms",
                    info.get("generation", -1), pause * 1e3,
                )  # fmt: skip
            elif now - self._logged_at >= LOG_EVERY_S:
                self._logged_at = now
                log.warning(
                    "garbage collection (generation %d) paused every thread for %.0f ms; %d long pauses so far",
                    info.get("generation", -1), pause * 1e3, self.long_pauses,
                )  # fmt: skip

    def stats(self) -> dict[str, float]:
        return {
            "gc_collections": self.collections,
            "gc_pause_seconds": round(self.pause_s, 4),
            "gc_max_pause_seconds": round(self.max_pause_s, 4),
            "gc_long_pauses": self.long_pauses,
        }


def freeze_new_objects() -> int:
    """Exempt what was built since the last freeze (a graph captured after start-up: compiled code, dynamo's and
    inductor's caches) from later collections, after collecting only the young generations (a few ms); returns the
    frozen count. Each full collection otherwise walks every capture so far: during an H200 start-up without the
    freeze at ready, full collections grew from 78 to 785 ms as graphs were captured, and captures after ready
    (idle time, first use) build the same kind of objects while streams run. Cyclic garbage that already reached the
    oldest generation stays frozen (bounded: one set per captured graph)."""
    _collect_and_freeze(1)
    return gc.get_freeze_count()


def freeze_startup_objects() -> int:
    """Collect once, then exempt every surviving object from later collections; returns how many were frozen."""
    _collect_and_freeze(2)
    return gc.get_freeze_count()


def _collect_and_freeze(generation: int) -> None:
    _deliberate.active = True
    try:
        gc.collect(generation)
    finally:
        _deliberate.active = False
    gc.freeze()
    atexit.unregister(gc.unfreeze)  # registered once, however many freezes
    atexit.register(gc.unfreeze)

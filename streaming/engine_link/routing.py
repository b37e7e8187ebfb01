"""The choices of a pool of engines (streaming.engine_link.pool), as pure functions: the order in which engines are
offered a new session, the pool's state from its engines', whether two engines serve the same model, and the pool's
counters from theirs. No I/O, no asyncio: tested without engines (tests/streaming/test_engine_pool.py).
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..engine_api import EngineState, ModelInfo

# The pool's state when no engine is ready, most telling first: one still starting will be ready soon.
STATE_ORDER = (EngineState.READY, EngineState.STARTING, EngineState.DRAINING)
# Counters whose pool-wide figure is the largest engine's, not the sum (averages, maxima, flags, buckets, start-up).
MAX_KEYS = frozenset({
    "turn_avg_seconds", "turn_max_seconds", "gc_max_pause_seconds", "behind_real_time", "step_batch_bucket",
    "step_length_bucket",
})  # fmt: skip
MAX_PREFIXES = ("startup_",)


@dataclass(frozen=True, slots=True)
class Candidate:
    """A ready engine that serves the pool's model, as the pool sees it now."""

    address: str
    headroom: int  # sessions it would take now (RemoteEngine.headroom)
    open_sessions: int  # this gateway's sessions on it


def rank(candidates: Sequence[Candidate], rng: random.Random) -> list[str]:
    """Addresses in the order a new session tries them: the largest headroom first; among equals, the engine with
    fewest of this gateway's sessions, then chance (so gateways that see the same numbers spread their sessions)."""
    keyed = sorted((-c.headroom, c.open_sessions, rng.random(), c.address) for c in candidates)
    return [address for *_, address in keyed]


def pool_state(states: Iterable[EngineState]) -> EngineState:
    """READY when any engine is; else STARTING when any is (it will be soon), else DRAINING when any is, else
    UNAVAILABLE (none reachable, or no engine at all)."""
    present = set(states)
    for state in STATE_ORDER:
        if state in present:
            return state
    return EngineState.UNAVAILABLE


def same_model(a: ModelInfo, b: ModelInfo) -> bool:
    """Whether two engines serve the same model, as a gateway relies on it (voices, sampling defaults, sample rate,
    context): every field but the device, which differs between the GPUs of one host."""
    return dataclasses.replace(a, device="") == dataclasses.replace(b, device="")


def total_stats(per_engine: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """The pool's counters: each numeric counter summed over its engines (the largest for MAX_KEYS and start-up
    figures); strings and nested values are left out."""
    out: dict[str, Any] = {}
    for stats in per_engine.values():
        for key, value in stats.items():
            if not isinstance(value, int | float) or isinstance(value, bool):
                continue
            if key in MAX_KEYS or key.startswith(MAX_PREFIXES):
                out[key] = max(out.get(key, value), value)
            else:
                out[key] = out.get(key, 0) + value
    for key, value in out.items():
        if isinstance(value, float):
            out[key] = round(value, 4)
    return out

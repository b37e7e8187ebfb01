"""What the worker counts: work done, policy decisions, where a turn's time goes, and slow turns.

`WorkerStats` is read by other threads (/metrics, benchmarks) as plain numbers; `SlowTurns` logs a turn that set
every running stream back, with where its time went, at most once every `SLOW_TURN_LOG_S`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

log = logging.getLogger("streaming.worker")

# A turn longer than this many frames of audio set every running stream back by as much: it is counted, and logged
# with where its time went (a warning at most every SLOW_TURN_LOG_S, with the count of those not logged). An H200
# at 384 streams saw turns averaging 173 ms for a second with nothing in the phase totals to say why.
SLOW_TURN_FRAMES = 2.0
SLOW_TURN_LOG_S = 1.0


@dataclass
class WorkerStats:
    steps: int = 0
    frames: int = 0
    prefill_tokens: int = 0
    vocoded_frames: int = 0
    errors: int = 0
    prefill_holds: int = 0  # turns that held new prompts back for a nearly dry stream
    refills: int = 0  # chunks sent early to a nearly dry stream
    tails_deferred: int = 0  # segment tails left for a later turn (max_tails_per_turn), once for each turn they wait
    paced_turns: int = 0  # decoding turns in which streams far ahead of their clients sat out (pace_lead_s)
    paced_rows: int = 0  # frames not made for that reason, summed over those turns (one per stream and turn)
    # cumulative wall seconds by phase of the loop (where a turn's time goes; exported through /metrics)
    turns: int = 0
    prefill_s: float = 0.0
    step_s: float = 0.0  # inside the batched decode step (device work + its one sync)
    vocode_s: float = 0.0  # inside vocoder calls
    turn_s: float = 0.0  # whole turns (the rest is host bookkeeping)
    slow_turns: int = 0  # turns longer than SLOW_TURN_FRAMES frames of audio (each stream fell behind by that much)
    turn_max_s: float = 0.0  # the longest turn so far
    # where an utterance's first audio goes, summed over utterances (worker side, from its text being applied here):
    # waiting for its first segment to start (an earlier utterance's segments, the turn), its prompt (queue and
    # passes, to the first frame), then decoding and vocoding its first chunk until the audio is posted
    first_audio_utterances: int = 0
    first_audio_wait_s: float = 0.0
    first_audio_prefill_s: float = 0.0
    first_audio_decode_s: float = 0.0


class SlowTurns:
    def __init__(self, stats: WorkerStats) -> None:
        self.stats = stats
        self._logged_at = -float("inf")
        self._unlogged = 0

    def note(self, turn_s: float, phases: dict[str, float], counts: dict[str, int]) -> None:
        self.stats.slow_turns += 1
        now = time.monotonic()
        if now - self._logged_at < SLOW_TURN_LOG_S:
            self._unlogged += 1
            return
        where = ", ".join(f"{name} {sec * 1e3:.1f}" for name, sec in phases.items())
        what = ", ".join(f"{n} {name}" for name, n in counts.items())
        log.warning(
            "slow turn: %.0f ms (%s ms; %s); %d more slow turns since the last report",
            turn_s * 1e3, where, what, self._unlogged,
        )  # fmt: skip
        self._logged_at, self._unlogged = now, 0

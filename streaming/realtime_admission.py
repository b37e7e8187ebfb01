"""Admission by real-time headroom: refuse new sessions while the engine's turns are too slow for real time.

One worker turn advances every decoding stream by one frame of audio (46.4 ms at 44.1 kHz). When a turn takes
longer than that, every stream falls behind real time and every client underruns (H200: 256 steady streams,
44 ms turns for 173 decoding rows, all 512 requests underran). `--max-sessions` cannot know that point, which moves
with text lengths, voices and chunk sizes; this guard watches it. The worker records each turn that decoded; while
their running average exceeds `max_turn_fraction` of a frame, new sessions are refused (Overloaded, 503 / 1013 with
Retry-After) so the streams already running keep real time. It admits again once the average is back under
`RESUME_RATIO` of that limit (hysteresis), or once no decoding turn has run for `STALE_S` (the engine went idle).

The average lags a burst: on the H200 (384 clients arriving over 9 s) sessions kept being admitted until it
crossed the limit, turns reached 69 ms, and 92 % of the admitted streams underran. So a second bound caps how many
sessions may have work at once: the streams the last turns suggest fit the limit, `limit × rows / turn` from the
running averages of decoding rows and turn time. A turn costs a fixed part plus a part per row, so this estimate is
low at light load and rises turn by turn towards the real capacity (1 row in 3 ms → 13 streams → …): a burst is let
in a few turns' worth at a time instead of all at once. Before the first decoding turn it is one stream; it survives
idle periods (it describes the engine, not the moment). Off unless configured (`--admission-turn-fraction`).

The capacity may use a tighter limit than the "behind" guard (`--admission-capacity-fraction`): a stream whose
chunks are still growing needs turns of at most 2/3 of a frame (streaming.chunking.sustainable_turn_fraction), a
stream in steady chunks only under one frame. On the H200 at 384 streams, both at the bench's 0.9 let every session
in, full-load turns were 31.6-38.6 ms, and 2.7-14.5 % of requests underran briefly; both at 0.65 instead tripped the
"behind" guard on the first wave's long turns and held newcomers back at 300 streams too.

Optionally (`--admission-per-turn N`) at most N sessions are admitted between two decoding turns: when room opens
after the engine was behind, the sessions waiting for it would otherwise start their prompts in the same turns, just
as their young streams have the least margin (stand-in device at 300 streams: 1 % of requests underran with 4,
against 5–15 % without, for ~0.5 s more first audio).
"""

from __future__ import annotations

import time

SMOOTHING = 0.2  # weight of the newest turn in the running average (~5 turns, a quarter of a second under load)
RESUME_RATIO = 0.8  # admit again below this share of the limit
STALE_S = 1.0  # no decoding turn for this long (or 4 average turns, if longer): the average no longer applies


class RealtimeAdmission:
    def __init__(
        self,
        frame_s: float,
        max_turn_fraction: float | None,
        capacity_fraction: float | None = None,
    ) -> None:
        for name, value in (("max_turn_fraction", max_turn_fraction), ("capacity_fraction", capacity_fraction)):
            if value is not None and not 0 < value <= 2:
                raise ValueError(f"{name} must be in (0, 2], got {value}")
        self.frame_s = frame_s
        self.limit_s: float | None = None
        self.capacity_limit_s: float | None = None  # the turn the capacity estimate fits the streams into
        if max_turn_fraction is not None:
            self.limit_s = max_turn_fraction * frame_s
            self.capacity_limit_s = (capacity_fraction or max_turn_fraction) * frame_s
        self.turn_avg_s = 0.0
        self.rows_avg = 0.0
        self.behind = False
        self._last_turn_at = -float("inf")

    def record_turn(self, seconds: float, rows: int = 1, now: float | None = None) -> None:
        """A turn that decoded `rows` streams took `seconds` (worker thread)."""
        now = time.monotonic() if now is None else now
        if self._stale(now - seconds):  # measured from the turn's start: a long turn is not a pause
            self.turn_avg_s = seconds  # the first turn after a pause starts the average afresh
            self.rows_avg = float(rows)
        else:
            self.turn_avg_s += SMOOTHING * (seconds - self.turn_avg_s)
            self.rows_avg += SMOOTHING * (rows - self.rows_avg)
        self._last_turn_at = now
        if self.limit_s is not None:
            if self.turn_avg_s > self.limit_s:
                self.behind = True
            elif self.turn_avg_s < RESUME_RATIO * self.limit_s:
                self.behind = False

    def _stale(self, now: float) -> bool:
        """No decoding turn has ended for longer than the engine's pauses last: it went idle. Relative to the average
        too, so an engine whose turns take seconds (far behind) is not taken for an idle one during each turn."""
        return now - self._last_turn_at > max(STALE_S, 4 * self.turn_avg_s)

    def behind_now(self, now: float | None = None) -> bool:
        """Whether new sessions wait now (any thread: reads a few attributes)."""
        now = time.monotonic() if now is None else now
        return self.limit_s is not None and self.behind and not self._stale(now)

    def capacity(self) -> float | None:
        """Streams with work that the limit allows, estimated from the last turns (None: off). Before the first
        decoding turn nothing is known, so one: a burst at a fresh server waits a turn for the first estimate
        instead of flooding in."""
        if self.capacity_limit_s is None:
            return None
        if self.turn_avg_s <= 0:
            return 1.0
        # at least one: an engine too slow for even one stream in real time still serves one at a time
        return max(1.0, self.capacity_limit_s * max(self.rows_avg, 1.0) / self.turn_avg_s)

    def refusal(self, working: int = 0, now: float | None = None) -> str | None:
        """Why a new session must wait now, or None to admit it; `working` = sessions that have work now (admitted
        sessions that are not idle), which the new one would join."""
        now = time.monotonic() if now is None else now
        if self.behind_now(now):
            return (
                f"the engine is behind real time: a turn takes {self.turn_avg_s * 1e3:.0f} ms for "
                f"{self.frame_s * 1e3:.0f} ms of audio per stream, so new sessions wait until it catches up; retry "
                "later (--admission-turn-fraction sets the limit)"
            )
        capacity = self.capacity()
        if capacity is not None and working + 1 > capacity:
            basis = (
                f"the last turns ({self.turn_avg_s * 1e3:.0f} ms for {self.rows_avg:.0f} streams) allow about "
                f"{capacity:.0f}"
                if self.turn_avg_s > 0
                else "until its first turn is measured it takes one"
            )
            return (
                f"the engine is at its real-time capacity: {working} streams have work and {basis}; retry later "
                "(--admission-turn-fraction and --admission-capacity-fraction set the limit)"
            )
        return None

"""When to run the vocoder: how many new code frames make the next PCM chunk of a stream.

The first chunk is small (time to first audio); later chunks grow so the client's buffer stays ahead of playback
while the vocoder runs fewer, larger (cheaper per frame) calls. One code frame is 2048 samples = 46.4 ms at
44.1 kHz. A stream restarts its schedule when its audio ran dry (a pause waiting for text): the client's buffer is
then empty again. The decoder is stateful and causal, so any chunk boundaries give the same audio.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum


class Latency(Enum):
    """Fish's `latency` request field."""

    LOW = "low"  # first audio after 2 frames (93 ms of audio): fastest start, most vocoder calls
    BALANCED = "balanced"  # first audio after 4 frames (186 ms)
    NORMAL = "normal"  # first audio after 8 frames (372 ms): fewest, largest calls


# Frames per chunk, by chunk index; the last entry repeats. Each size appears twice before it grows, so while
# chunk k plays the next one needs about 1x real time to arrive (a doubling ramp needs 2x: measured underruns
# at 8 concurrent CPU streams with 4 → 8 → 16). Every size also has a captured vocoder graph on GPU.
SCHEDULES: dict[Latency, tuple[int, ...]] = {
    Latency.LOW: (2, 2, 4, 4, 8, 8, 16, 24),
    Latency.BALANCED: (4, 4, 8, 8, 16, 24),
    Latency.NORMAL: (8, 8, 16, 24),
}
# Chunk sizes the engine may ever ask for outside a schedule (segment tails and refills are split into these).
TAIL_SIZES = (16, 8, 4, 2, 1)
# The smallest early chunk for a client about to run dry (one frame per vocoder call costs more than it buys).
MIN_REFILL_FRAMES = 4


@dataclass(frozen=True, slots=True)
class ChunkSchedule:
    sizes: tuple[int, ...]

    @staticmethod
    def for_latency(latency: Latency) -> ChunkSchedule:
        return ChunkSchedule(SCHEDULES[latency])

    def size(self, index: int) -> int:
        return self.sizes[min(index, len(self.sizes) - 1)]


def sustainable_turn_fraction(sizes: tuple[int, ...]) -> float:
    """The slowest turn, as a share of a frame's duration, at which a client playing from its first chunk never runs
    dry on this schedule (one frame per turn, chunks sent when full). Before chunk k+1 (n frames) arrives, n turns
    pass; the buffer then holds the first chunk plus what every later chunk gained, so
    `r ≤ (n₀ + S_k) / (S_k + n_{k+1})` with S_k the frames of chunks 1…k. Each schedule above gives 2/3: a growth
    step (8 → 16 frames, say) needs the engine half again faster than real time, whatever the admission lets in."""
    bound, sent = 1.0, 0
    for k in range(1, len(sizes) + 1):
        nxt = sizes[min(k, len(sizes) - 1)]
        bound = min(bound, (sizes[0] + sent) / (sent + nxt))
        sent += nxt
    return bound


def split_tail(frames: int) -> list[int]:
    """Split a segment's leftover frames into TAIL_SIZES pieces (largest first), e.g. 13 → [8, 4, 1]."""
    out = []
    for size in TAIL_SIZES:
        while frames >= size:
            out.append(size)
            frames -= size
    return out


def refill_size(queued: int) -> int:
    """The largest chunk size with a captured graph that `queued` frames fill (queued ≥ 1): a tail's first piece."""
    return split_tail(queued)[0]


def call_groups(sizes: Sequence[int], padding_budget: int, max_rows: int) -> list[tuple[int, list[int]]]:
    """The vocoder calls for chunks of these sizes (frames): (frames the call runs, indices of its chunks), one call
    per distinct size, except that a size's chunks join the call of the smallest larger size kept where the frames
    they would pad (chunks × the difference) stay within `padding_budget` and the joined call needs no more of its
    ⌈rows / max_rows⌉ passes. The trade: a call costs ~2 ms on an H200 whatever its size, a padded row-frame ~0.02 ms
    (an H200 shape table; a turn at ~300 streams made 2.8 calls). A budget of 0 keeps every size apart."""
    by_size: dict[int, list[int]] = {}
    for i, n in enumerate(sizes):
        by_size.setdefault(n, []).append(i)
    kept: list[tuple[int, list[int]]] = []  # largest frames first
    for n in sorted(by_size, reverse=True):
        members = by_size[n]
        for frames, host in reversed(kept):  # the smallest larger size first: the least padding
            same_passes = -(-(len(host) + len(members)) // max_rows) == -(-len(host) // max_rows)
            if len(members) * (frames - n) <= padding_budget and same_passes:
                host.extend(members)
                break
        else:
            kept.append((n, list(members)))
    return kept


def all_chunk_sizes() -> list[int]:
    """Every chunk length the engine can request (for graph capture and warm-up)."""
    return sorted({*TAIL_SIZES, *(s for sizes in SCHEDULES.values() for s in sizes)})

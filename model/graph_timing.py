"""How long a captured CUDA graph takes to replay, and the cheapest plan those times give: what the decode and vocoder
graphs are routed by."""

from __future__ import annotations

import math

import torch


def replay_ms(graph: torch.cuda.CUDAGraph, replays: int) -> float:
    """Milliseconds per replay of a freshly captured graph: one untimed replay, then `replays` between CUDA events.
    The replays run: the caller makes them harmless (state restored, nothing committed)."""
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / replays


def cheapest_plan(batch: int, own: int, replay_ms: dict[int, float], below: float) -> tuple[int, int]:
    """(bucket, replays) to run `batch` rows: the own bucket once, or the bucket whose ⌈batch / bucket⌉ replays cost
    least (`replay_ms`: the timed candidates) where that is under `below` of the own bucket's time (a margin over
    timing noise). Ties go to fewer replays; an own bucket not timed yet runs."""
    own_ms = replay_ms.get(own)
    if own_ms is None:
        return own, 1
    best, best_ms = (own, 1), own_ms * below
    for bucket, ms in sorted(replay_ms.items(), reverse=True):  # larger buckets first: ties keep fewer replays
        replays = math.ceil(batch / bucket)
        if replays * ms < best_ms:
            best, best_ms = (bucket, replays), replays * ms
    return best

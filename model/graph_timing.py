"""How long a captured CUDA graph takes to replay: what the decode and vocoder graphs are routed by."""

from __future__ import annotations

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

"""bench/vocoder_merge_model.py: a segment's chunks cover its frames, and merging never adds calls."""

from __future__ import annotations

import argparse

from bench.vocoder_merge_model import per_turn, stream_calls
from streaming.chunking import SCHEDULES, Latency


def test_a_segments_chunks_and_tail_pieces_cover_its_frames() -> None:
    calls = stream_calls(200, SCHEDULES[Latency.BALANCED])
    assert sum(n for _, _, n in calls) == 200
    assert [n for _, kind, n in calls if kind == "ready"][:6] == [4, 4, 8, 8, 16, 24]
    assert all(at == 200 for at, kind, _ in calls if kind.startswith("tail"))


def test_merging_makes_fewer_calls_and_pads_more_with_the_budget() -> None:
    args = argparse.Namespace(streams=64, waves=1, frames=120, ramp_s=3.0, turn_ms=30.0)
    base_ms, base_calls, base_pad = per_turn(args, 0)
    merged_ms, merged_calls, merged_pad = per_turn(args, 32)
    assert base_pad == 0 and merged_pad > 0
    assert merged_calls < base_calls and base_ms > 0 and merged_ms > 0

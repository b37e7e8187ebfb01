"""How a turn's vocoder chunks are grouped into calls (streaming.chunking.call_groups): the backend makes one call per
chunk length (budget 0); the padding budget, which let chunks of different lengths share a call, is what
bench/vocoder_merge_model.py prices (merged calls measured slower on an H200, so the backend no longer merges)."""

from __future__ import annotations

from streaming.chunking import call_groups


def test_without_a_padding_budget_every_chunk_length_has_its_own_call() -> None:
    groups = call_groups([4, 24, 4, 16, 24], padding_budget=0, max_rows=64)
    assert sorted((frames, sorted(members)) for frames, members in groups) == [(4, [0, 2]), (16, [3]), (24, [1, 4])]


def test_shorter_chunks_join_the_smallest_longer_call_within_the_budget() -> None:
    # the 16-frame chunk pads 8 frames into the 24-frame call; the two 4-frame ones would pad 2 × 20 = 40 there
    assert call_groups([4, 24, 4, 16], padding_budget=24, max_rows=64) == [(24, [1, 3]), (4, [0, 2])]
    assert call_groups([4, 24, 4, 16], padding_budget=40, max_rows=64) == [(24, [1, 3, 0, 2])]
    # four 16s would pad 32 into the 24-frame call: they keep their own, and the 4s join it (2 × 12), not the 24s
    groups = call_groups([4, 24, 4, 16, 16, 16, 16], padding_budget=24, max_rows=64)
    assert groups == [(24, [1]), (16, [3, 4, 5, 6, 0, 2])]


def test_a_merge_never_costs_the_longer_call_another_pass() -> None:
    # 3 rows of 24 frames fill passes of 3 rows: one more row would need a second pass, so the 16s stay apart
    assert call_groups([24, 24, 24, 16], padding_budget=100, max_rows=3) == [(24, [0, 1, 2]), (16, [3])]
    assert call_groups([24, 24, 16], padding_budget=100, max_rows=3) == [(24, [0, 1, 2])]

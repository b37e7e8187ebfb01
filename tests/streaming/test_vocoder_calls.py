"""Merging a turn's vocoder chunks of different lengths into fewer calls (BackendConfig.vocoder_merge_padding): the
grouping rule, and a backend whose merged calls give every slot the audio of one call per chunk length."""

from __future__ import annotations

import numpy as np

from streaming.backend import Backend
from streaming.chunking import call_groups
from streaming.config import BackendConfig
from tests.streaming.test_engine import offline_decode


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


def test_a_backend_merging_chunk_lengths_gives_every_slot_the_same_audio() -> None:
    """The real backend (embedded default model) vocodes a few turns' chunks of mixed lengths for three slots: with a
    padding budget that merges everything it makes one call a turn instead of one per length, and every chunk's audio
    is the unmerged backend's (to float rounding: other batch shapes), which is the offline decode of each slot's
    codes."""
    apart = Backend(BackendConfig(max_sessions=4, batch_invariant=False))  # CPU engines vocode slot by slot
    merged = Backend(BackendConfig(max_sessions=4, batch_invariant=False, vocoder_merge_padding=10_000))
    nc = apart.info.num_codebooks
    rng = np.random.default_rng(7)
    codes = rng.integers(0, 100, size=(3, nc, 60))
    done = [0, 0, 0]
    audio: list[list[np.ndarray]] = [[], [], []]
    turns = [([0, 1, 2], [4, 8, 2]), ([0, 1, 2], [8, 1, 4]), ([2, 0], [16, 4]), ([0, 1, 2], [24, 16, 1])]
    for slots, sizes in turns:
        chunks = [codes[s, :, done[s] : done[s] + n] for s, n in zip(slots, sizes, strict=True)]
        calls = merged.vocode_calls
        got = merged.vocode(slots, chunks)
        assert merged.vocode_calls - calls == 1
        expected = apart.vocode(slots, chunks)
        for s, n, g, e in zip(slots, sizes, got, expected, strict=True):
            assert g.shape == e.shape == (n * apart.info.samples_per_frame,)
            assert np.abs(g - e).max() <= 1e-5
            audio[s].append(g)
            done[s] += n
    assert apart.vocode_calls == sum(len(set(sizes)) for _, sizes in turns)
    for s in range(3):
        offline = offline_decode(None, codes[s, :, : done[s]])
        assert np.abs(np.concatenate(audio[s]) - offline).max() <= 1e-4
    invariant = Backend(BackendConfig(max_sessions=2, vocoder_merge_padding=64))  # the CPU default: batch-invariant
    assert invariant.batch_invariant and invariant.merge_padding == 0  # slot by slot: nothing to merge

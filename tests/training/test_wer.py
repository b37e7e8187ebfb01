"""Tests for training/wer.py's scoring (no Whisper needed): edit counts against an independent distance."""

from __future__ import annotations

import random

from training.wer import corpus_wer, edit_counts


def _levenshtein(a: list[str], b: list[str]) -> int:
    """Plain recursive-table edit distance, written separately from wer.edit_counts."""
    table = {(i, 0): i for i in range(len(a) + 1)} | {(0, j): j for j in range(len(b) + 1)}
    for i in range(1, len(a) + 1):
        for j in range(1, len(b) + 1):
            table[i, j] = min(table[i - 1, j] + 1, table[i, j - 1] + 1, table[i - 1, j - 1] + (a[i - 1] != b[j - 1]))
    return table[len(a), len(b)]


def test_edit_counts_known_cases() -> None:
    ref = ["the", "cat", "sat", "on", "the", "mat"]
    assert edit_counts(ref, ref).errors == 0
    counts = edit_counts(ref, ["the", "cat", "sit", "on", "mat", "today"])
    assert (counts.substitutions, counts.deletions, counts.insertions) == (1, 1, 1)
    assert edit_counts(ref, []).deletions == 6
    assert edit_counts([], ["a", "b"]).insertions == 2


def test_edit_counts_match_independent_distance() -> None:
    rng = random.Random(0)
    vocab = ["a", "b", "c", "d"]
    for _ in range(300):
        ref = [rng.choice(vocab) for _ in range(rng.randint(0, 9))]
        hyp = [rng.choice(vocab) for _ in range(rng.randint(0, 9))]
        counts = edit_counts(ref, hyp)
        assert counts.errors == _levenshtein(ref, hyp)
        assert counts.ref_words == len(ref)
        assert len(ref) - counts.deletions - counts.substitutions == len(hyp) - counts.insertions - counts.substitutions


def test_corpus_wer_normalises_both_sides() -> None:
    wer, errors, ref_words = corpus_wer(
        [("Mr. Smith paid $5 at 3:30.", "mister smith paid five dollars at three thirty"), ("One two.", "one three")]
    )
    assert (errors, ref_words) == (1, 10)
    assert wer == 0.1
    # the denominator is the reference's words, not the transcript's: 2 deletions of 4 words, 2 words heard
    assert corpus_wer([("one two three four", "one two")]) == (0.5, 2, 4)
    assert corpus_wer([("one two", "one two three four")]) == (1.0, 2, 2)  # 2 insertions of 2 words

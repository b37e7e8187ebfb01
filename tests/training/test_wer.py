"""Tests for training/wer.py's scoring (no Whisper needed): edit counts against an independent distance, edge slips,
levels."""

from __future__ import annotations

import random

from training.wer import SENTENCE_LEVELS, SHORT_PHRASE_LEVELS, alignment, corpus_wer, edit_counts, score_clip


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


def test_alignment_reads_in_order_and_counts_like_edit_counts() -> None:
    ref, hyp = ["the", "cat", "sat", "on", "the", "mat"], ["the", "cat", "sit", "on", "mat", "today"]
    assert alignment(ref, hyp) == ["=", "=", "S", "=", "D", "=", "I"]
    assert alignment([], ["a"]) == ["I"] and alignment(["a"], []) == ["D"] and alignment([], []) == []


def test_a_clip_score_marks_words_dropped_or_added_at_its_edges() -> None:
    def slips(reference: str, transcript: str) -> tuple[bool, bool]:
        score = score_clip("x", reference, transcript)
        return score.start_slip, score.end_slip

    assert slips("Of course.", "But of course.") == (True, False)
    assert slips("I can help with that.", "can help with that.") == (True, False)
    assert slips("Thank you.", "Thank you very.") == (False, True)
    assert slips("Done.", "") == (True, True)
    # a misheard edge word is a substitution, not a slip; nor is a word missing in the middle
    assert slips("Your meeting starts soon.", "Your meeting starts in.") == (False, False)
    assert slips("Please sit down now.", "Please down now.") == (False, False)


def test_levels_include_their_bounds() -> None:
    """The issue reads 'pass ≤ 12 %': a WER exactly on a level reaches it."""
    assert (SENTENCE_LEVELS.passing, SENTENCE_LEVELS.target) == (0.12, 0.06)
    assert (SHORT_PHRASE_LEVELS.passing, SHORT_PHRASE_LEVELS.target) == (0.12, 0.10)
    verdicts = [SENTENCE_LEVELS.verdict(w) for w in (0.0, 0.06, 0.0601, 0.12, 0.1201)]
    assert verdicts == ["target", "target", "pass", "pass", "fail"]

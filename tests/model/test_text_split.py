"""clean_text / split_text against upstream's recorded split (fixtures) and hand-checked tricky inputs.

The expected values below were derived by hand from the rules in spec §2.5 (and cross-checked once against upstream
v1.5.1's `split_text`, together with a 200k-case random comparison, outside this repository).
"""

from __future__ import annotations

import pytest

from model.text_split import clean_text, split_text, utf8_len
from tests.model.fixture_sets import dual_ar_sets, params


@pytest.mark.parametrize("fs", params(dual_ar_sets()))
def test_split_matches_upstream_fixture(fs):
    meta = fs.meta["split_text"]
    assert clean_text(meta["input"]) == meta["clean_text"]
    assert split_text(meta["input"], meta["chunk_length"]) == meta["segments"]


@pytest.mark.parametrize("fs", params(dual_ar_sets()))
def test_generate_long_segments_match_fixture_texts(fs):
    gl = fs.meta["generate_long"]
    texts = split_text(fs.meta["split_text"]["input"], gl["params"]["chunk_length"])
    assert texts == [seg["text"] for seg in gl["segments"]]


# ---- clean_text ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("raw", "cleaned"),
    [
        ("  It’s ‘fine’  ", "It's 'fine'"),
        ("Hi 😀 there 🚀", "Hi  there "),  # strip happens before emoji removal: the trailing space survives
        ("flag 🇺🇸!", "flag !"),
        ("a,,,b,,c", "a,b,c"),
        ("a，，b", "a，，b"),  # full-width commas are not collapsed
        ("wait... what", "wait... what"),  # periods are not collapsed either
        ("你好，世界！", "你好，世界！"),  # Chinese punctuation is not converted in v1.5.1
        ("\u2764 heart", "\u2764 heart"),  # U+2764 is outside the removed emoji blocks
        ("", ""),
    ],
)
def test_clean_text(raw, cleaned):
    assert clean_text(raw) == cleaned


def test_clean_text_is_not_idempotent_like_upstream():
    once = clean_text("😀 hi")
    assert once == " hi"
    assert clean_text(once) == "hi"


# ---- split_text ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "length", "segments"),
    [
        # decimals are not split; the sentence that holds one is cut at spaces because it is too long
        ("Pi is 3.14 today. Next one.", 12, ["Pi is 3.14", "today.", "Next one."]),
        # only d.d is protected: "2.0.1" protects "2.0", the second dot is a sentence end
        ("Version 2.0.1 is out. Great.", 14, ["Version 2.0.", "1 is out.", "Great."]),
        ("Ends with number 12. 34 next", 10, ["Ends with", "number 12.", "34 next"]),
        # a long word without spaces is hard-cut by bytes
        ("a" * 25, 10, ["a" * 10, "a" * 10, "a" * 5]),
        # CJK sentence ends, 3 bytes per character
        ("你好。世界！再见？好的", 7, ["你好。", "世界！", "再见？", "好的"]),
        # the byte cut fires once a piece reaches the limit, so a multi-byte char overshoots it
        ("你你你你", 4, ["你你", "你你"]),
        # trailing spaces count towards the merge limit
        ("word1 word2 word3 word4", 11, ["word1", "word2", "word3 word4"]),
        ("One, two, three, four, five, six.", 12, ["One, two,", "three,", "four, five,", "six."]),
        # comma runs collapse before splitting; a lone full-width comma is kept (not ASCII punctuation)
        ("a,,,b,,c，，d", 3, ["a,", "b,", "c，", "，", "d"]),
        # punctuation-only and whitespace-only pieces are dropped
        ("Hello. ... !!! World.", 6, ["Hello.", "World."]),
        ("?!. ,", 1, []),
        ("   ", 10, []),
        ("", 10, []),
        ("😀😀😀", 5, []),
        ("Short text.", 100, ["Short text."]),
        ("It’s ‘fine’, really.", 100, ["It's 'fine', really."]),
    ],
)
def test_split_text_tricky(text, length, segments):
    assert split_text(text, length) == segments


def test_split_segments_respect_limit_when_splittable():
    text = "The quick brown fox jumps over the lazy dog. " * 20 + "Done, finally, at last!"
    for length in (10, 24, 50, 150):
        segments = split_text(text, length)
        assert all(utf8_len(s) <= length for s in segments)
        # no characters other than whitespace are lost or reordered
        assert "".join(segments).replace(" ", "") == clean_text(text).replace(" ", "")


def test_split_large_input_is_linear_enough():
    text = "word " * 200_000  # 1 MB of text
    segments = split_text(text, 200)
    assert len(segments) == 5000
    assert segments[0] == " ".join(["word"] * 40)


def test_split_rejects_non_positive_length():
    with pytest.raises(ValueError, match="length_bytes"):
        split_text("hello", 0)

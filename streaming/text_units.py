"""Where text may be cut: punctuation tables, the abbreviation list, the boundary scanner and fallback split points.

Every function here is pure and works on `(text, index)`; none knows about buffering, time or segment sizes (that is
`streaming.segmenter`). Decisions look back at most `LOOKBACK_CHARS` characters, so a caller that keeps that much
already-emitted context in front of its buffer gets the same answers as a scan over the whole text.
"""

from __future__ import annotations

import enum
import re
import unicodedata
from dataclasses import dataclass

SENTENCE_END_CHARS = ".!?…。！？"  # a punctuation run whose last char is one of these ends a sentence
CLAUSE_END_CHARS = ",;:，、；："  # ... and one of these ends a clause
END_CHARS = SENTENCE_END_CHARS + CLAUSE_END_CHARS
FULLWIDTH_END_CHARS = "。！？，、；："  # CJK punctuation ends a unit with no space after it; ASCII needs a space
CLOSER_CHARS = "\"'”’»)]}」』）】》〉*"  # closing quotes/brackets (and markdown '*') stay with the unit they close
OPENER_CHARS = "\"'“‘«([{「『（【《〈*"  # stripped from a word before the abbreviation check
# Words whose trailing '.' is not a sentence end. Kept small on purpose: each entry hides real sentence ends too
# ("... talk to the Dr. Then ..."), and "etc."/"No." end sentences too often to list. Dotted forms ("e.g.", "i.e.",
# "U.S.", "a.m.") and single capital initials ("J. R. R. Tolkien", but not "I") are matched by pattern instead.
ABBREVIATIONS = frozenset({"mr", "mrs", "ms", "dr", "prof", "sr", "jr", "st", "vs", "cf", "approx"})
# Spoken weight of a character, in Latin letters: a Han ideograph or a Hangul syllable is a syllable of speech (about
# three letters of English, and three UTF-8 bytes, which is what upstream's chunk_length counts); a kana is a mora
# (about two). Every other character counts one. Segment sizes are measured in this unit (`spoken_length`).
HAN_HANGUL_WEIGHT = 3
KANA_WEIGHT = 2
# How far back a decision may look (abbreviation words, punctuation runs); callers keep more than this as context.
LOOKBACK_CHARS = 24

_DOTTED_ABBREVIATION = re.compile(r"[A-Za-z](?:\.[A-Za-z])+")
_LIST_MARKER = re.compile(r"\d{1,3}")  # "1." at a line start numbers a list item, it does not end a sentence
_INTERESTING = re.compile(r"[\s。！？，、；：]")
_NON_SPACE = re.compile(r"\S")
_SPEAKABLE = re.compile(r"[^\W_]")  # a letter or digit in any script: something a TTS voice can say
_ZWJ = "\u200d"
_CJK_RANGES = (
    (0x3000, 0x303F),  # CJK symbols and punctuation
    (0x3040, 0x30FF),  # hiragana, katakana
    (0x3400, 0x4DBF),  # CJK extension A
    (0x4E00, 0x9FFF),  # CJK unified ideographs
    (0xAC00, 0xD7AF),  # hangul syllables
    (0xF900, 0xFAFF),  # CJK compatibility ideographs
    (0xFF00, 0xFFEF),  # half- and full-width forms
    (0x20000, 0x2FFFF),  # CJK extensions B-F
)


_HAN_HANGUL_RANGES = ((0x3400, 0x4DBF), (0x4E00, 0x9FFF), (0xAC00, 0xD7AF), (0xF900, 0xFAFF), (0x20000, 0x2FFFF))
_KANA_RANGES = ((0x3040, 0x30FF), (0x31F0, 0x31FF), (0xFF66, 0xFF9D))
_WEIGHTED = re.compile("[" + "".join(f"{chr(lo)}-{chr(hi)}" for lo, hi in _HAN_HANGUL_RANGES + _KANA_RANGES) + "]")


class BoundaryKind(enum.Enum):
    SENTENCE = "sentence"  # sentence punctuation, or a paragraph break (a blank line)
    CLAUSE = "clause"  # clause punctuation, or a single line break


@dataclass(frozen=True, slots=True)
class Boundary:
    """A place where one unit ends: text[:end] is the unit (with its punctuation), text[cut:] starts the next."""

    end: int  # index just past the unit's punctuation and closers
    cut: int  # index just past the whitespace that follows `end` (where the next unit's first visible char is)
    kind: BoundaryKind


def is_speakable(text: str) -> bool:
    """True when `text` holds a letter or digit (any script); whitespace, punctuation and emoji alone are not."""
    return _SPEAKABLE.search(text) is not None


def spoken_weight(char: str) -> int:
    """How many Latin letters of speech one character carries (HAN_HANGUL_WEIGHT, KANA_WEIGHT, else 1)."""
    code = ord(char)
    if any(lo <= code <= hi for lo, hi in _HAN_HANGUL_RANGES):
        return HAN_HANGUL_WEIGHT
    if any(lo <= code <= hi for lo, hi in _KANA_RANGES):
        return KANA_WEIGHT
    return 1


def spoken_length(text: str) -> int:
    """Length of `text` in Latin-letter equivalents: `len(text)` for text without Han, kana or Hangul."""
    if _WEIGHTED.search(text) is None:
        return len(text)
    return sum(spoken_weight(c) for c in text)


def spoken_prefix(text: str, start: int, budget: int) -> int:
    """The largest `end` such that `spoken_length(text[start:end]) <= budget` (`end` may be len(text))."""
    end = min(len(text), start + budget)
    if _WEIGHTED.search(text, start, end) is None:
        return end
    used = 0
    for i in range(start, len(text)):
        used += spoken_weight(text[i])
        if used > budget:
            return i
    return len(text)


def scan_boundaries(text: str, pos: int, *, final: bool) -> tuple[list[Boundary], int]:
    """Boundaries whose whitespace run starts at or after `pos`, and the index a later scan must resume from.

    A boundary is only reported once the first visible character after it has arrived (or `final` is set: the text
    ends here), so "3." waiting for "14" and "Hello." waiting for " World" are never cut early.
    """
    found: list[Boundary] = []
    n = len(text)
    last_cut = -1
    i = pos
    while (match := _INTERESTING.search(text, i)) is not None:
        i = match.start()
        kind: BoundaryKind | None
        if text[i].isspace():
            end = i
            cut = _space_end(text, i)
            kind = _kind_before(text, end, text.count("\n", end, cut))
        else:  # full-width punctuation: the run (with closers) is the unit end whatever follows
            end = i
            while end < n and (text[end] in END_CHARS or text[end] in CLOSER_CHARS):
                end += 1
            cut = _space_end(text, end)
            sentence = text.count("\n", end, cut) >= 2 or any(c in SENTENCE_END_CHARS for c in text[i:end])
            kind = BoundaryKind.SENTENCE if sentence else BoundaryKind.CLAUSE
        if cut == n and not final:
            return found, i  # what follows is unknown yet: rescan this run when more text arrives
        if kind is not None:
            found.append(Boundary(end, cut, kind))
            last_cut = cut
        i = cut
    if final and n > 0 and last_cut != n and not text[n - 1].isspace():
        kind = _kind_before(text, n, 0)  # "Hello." at the very end of the text
        if kind is not None:
            found.append(Boundary(n, n, kind))
    return found, n


def _space_end(text: str, i: int) -> int:
    """Index just past the whitespace run starting at `i` (`i` itself when text[i] is not whitespace)."""
    match = _NON_SPACE.search(text, i)
    return len(text) if match is None else match.start()


def _kind_before(text: str, end: int, newlines: int) -> BoundaryKind | None:
    """Kind of boundary at `end`, given the visible text before it and the newlines in the whitespace after it."""
    floor = max(0, end - LOOKBACK_CHARS)
    closed = end
    while closed > floor and text[closed - 1] in CLOSER_CHARS:
        closed -= 1
    run_start = closed
    while run_start > floor and text[run_start - 1] in END_CHARS:
        run_start -= 1
    run = text[run_start:closed]
    kind = None
    if run and not (run == "." and _period_is_not_final(text, run_start)):
        kind = BoundaryKind.SENTENCE if run[-1] in SENTENCE_END_CHARS else BoundaryKind.CLAUSE
    if newlines >= 2:
        return BoundaryKind.SENTENCE
    if newlines == 1 and kind is None:
        return BoundaryKind.CLAUSE
    return kind


def _period_is_not_final(text: str, dot: int) -> bool:
    """True when the '.' at `dot` (followed by whitespace) belongs to an abbreviation, initial or list number."""
    word_start = dot
    while word_start > max(0, dot - LOOKBACK_CHARS) and not text[word_start - 1].isspace():
        word_start -= 1
    word = text[word_start:dot].lstrip(OPENER_CHARS)
    if word.lower() in ABBREVIATIONS or _DOTTED_ABBREVIATION.fullmatch(word):
        return True
    if len(word) == 1 and "A" <= word <= "Z" and word != "I":
        return True
    at_line_start = word_start == 0 or text[word_start - 1] == "\n"
    return at_line_start and _LIST_MARKER.fullmatch(word) is not None


def is_cjk(char: str) -> bool:
    code = ord(char)
    return any(lo <= code <= hi for lo, hi in _CJK_RANGES)


def is_grapheme_break(text: str, i: int) -> bool:
    """True when cutting between text[i - 1] and text[i] splits no visible character (a good-enough UAX #29)."""
    before, after = text[i - 1], text[i]
    if _ZWJ in (before, after) or (before, after) == ("\r", "\n"):
        return False
    code = ord(after)
    if 0xFE00 <= code <= 0xFE0F or 0x1F3FB <= code <= 0x1F3FF or 0xE0020 <= code <= 0xE007F:
        return False  # variation selector, skin-tone modifier, emoji tag
    if unicodedata.category(after) in ("Mn", "Mc", "Me"):
        return False  # combining mark
    if _is_regional_indicator(before) and _is_regional_indicator(after):
        run = 0
        while i - run > 0 and _is_regional_indicator(text[i - run - 1]):
            run += 1
        return run % 2 == 0  # flags are pairs of regional indicators
    return True


def _is_regional_indicator(char: str) -> bool:
    return 0x1F1E6 <= ord(char) <= 0x1F1FF


def space_cut(text: str, lo: int, hi: int) -> int | None:
    """Cut after the last whitespace run starting in (lo, hi] whose preceding text[lo:run] is speakable, else None."""
    for w in range(hi, lo, -1):
        if text[w].isspace() and not text[w - 1].isspace():
            if not is_speakable(text[lo:w]):
                return None
            return _space_end(text, w)
    return None


def char_cut(text: str, lo: int, hi: int) -> int:
    """Last cut in (lo, hi] that splits no grapheme, next to a CJK char if possible, keeping text[lo:cut] speakable
    if possible; `hi` when every cut splits a grapheme."""
    first_letter = _SPEAKABLE.search(text, lo, hi)
    fallback = None
    for p in range(hi, lo, -1):
        if not is_grapheme_break(text, p):
            continue
        if first_letter is None or p <= first_letter.start():
            return p if fallback is None else fallback  # nothing speakable fits before any cut
        if is_cjk(text[p - 1]) or is_cjk(text[p]):
            return p
        if fallback is None:
            fallback = p
    return hi if fallback is None else fallback

"""Text cleaning and long-text splitting exactly as upstream v1.5.1 does before `generate_long` (spec §2.5).

`clean_text` normalises quotes, drops a few emoji ranges and collapses comma runs; `split_text` cuts a text into
segments of at most `length_bytes` UTF-8 bytes where possible (a single over-long word/character run can exceed it,
as upstream). Pure string code: it knows nothing about tokens, prompts or the model.
"""

from __future__ import annotations

import re
import string
from collections.abc import Iterable

# Typographic single quotes are the only symbols upstream maps (Chinese punctuation is deliberately left alone).
_QUOTE_MAP = {"‘": "'", "’": "'"}
_QUOTE_RE = re.compile("[‘’]")
# Emoji blocks upstream removes: emoticons, symbols & pictographs, transport & map, regional-indicator flags.
_EMOJI_RE = re.compile("[\U0001f600-\U0001f64f\U0001f300-\U0001f5ff\U0001f680-\U0001f6ff\U0001f1e0-\U0001f1ff]+")
_COMMA_RUN_RE = re.compile(",{2,}")
# Decimals such as 3.14 are rewritten to <3_f_14> so the sentence split does not cut them (upstream's marker format;
# `\d` is Python's Unicode digit class, as upstream). A user-typed "<3_f_14>" also comes back as "3.14", as upstream.
_FLOAT_RE = re.compile(r"(\d+)\.(\d+)")
_FLOAT_MARK_RE = re.compile(r"<(\d+)_f_(\d+)>")
# Split points, applied in this order only to pieces still longer than the limit.
SENTENCE_ENDS = frozenset(".!?。！？")
CLAUSE_ENDS = frozenset(",，")
WORD_ENDS = frozenset(" ")
# Pieces made only of whitespace and these characters are dropped.
_DROPPABLE = frozenset(string.punctuation)


def clean_text(text: str) -> str:
    """Upstream `clean_text`: strip, ‘ ’ → ', remove emoji, collapse runs of commas to one comma."""
    text = text.strip()
    text = _QUOTE_RE.sub(lambda m: _QUOTE_MAP[m.group()], text)
    text = _EMOJI_RE.sub("", text)
    return _COMMA_RUN_RE.sub(",", text)


def utf8_len(text: str) -> int:
    return len(text.encode("utf-8"))


def split_text(text: str, length_bytes: int) -> list[str]:
    """Upstream `split_text(text, length)`: cleaned segments, each ≤ `length_bytes` UTF-8 bytes unless unsplittable.

    Pieces longer than the limit are cut after sentence ends, then after commas, then after spaces, then every
    time the piece reaches the limit; consecutive pieces are then merged greedily while the merge fits. Segments are
    stripped, and those holding only whitespace/ASCII punctuation are dropped.
    """
    if length_bytes < 1:
        raise ValueError(f"length_bytes must be ≥ 1, got {length_bytes}")
    protected = _FLOAT_RE.sub(r"<\1_f_\2>", clean_text(text))
    pieces = _cut_after(length_bytes, SENTENCE_ENDS, [protected])
    pieces = [_FLOAT_MARK_RE.sub(r"\1.\2", p) for p in pieces]
    pieces = _cut_after(length_bytes, CLAUSE_ENDS, pieces)
    pieces = _cut_after(length_bytes, WORD_ENDS, pieces)
    pieces = _cut_at_length(length_bytes, pieces)
    return _merge(length_bytes, pieces)


def _cut_after(length_bytes: int, split_chars: frozenset[str], pieces: Iterable[str]) -> list[str]:
    """Cut each over-long piece right after every character in `split_chars` (the character stays with its left)."""
    out: list[str] = []
    for piece in pieces:
        if utf8_len(piece) <= length_bytes:
            out.append(piece)
            continue
        start = 0
        for pos, char in enumerate(piece):
            if char in split_chars:
                out.append(piece[start : pos + 1])
                start = pos + 1
        if start < len(piece):
            out.append(piece[start:])
    return out


def _cut_at_length(length_bytes: int, pieces: Iterable[str]) -> list[str]:
    """Cut each over-long piece as soon as it reaches `length_bytes` bytes (a multi-byte char may overshoot)."""
    out: list[str] = []
    for piece in pieces:
        if utf8_len(piece) <= length_bytes:
            out.append(piece)
            continue
        start = 0
        size = 0
        for pos, char in enumerate(piece):
            size += utf8_len(char)
            if size >= length_bytes:
                out.append(piece[start : pos + 1])
                start, size = pos + 1, 0
        if start < len(piece):
            out.append(piece[start:])
    return out


def _merge(length_bytes: int, pieces: Iterable[str]) -> list[str]:
    segments: list[str] = []
    current = ""
    for piece in pieces:
        if utf8_len(current) + utf8_len(piece) <= length_bytes:
            current += piece
        else:
            _keep(current, segments)
            current = piece
    _keep(current, segments)
    return segments


def _keep(segment: str, segments: list[str]) -> None:
    segment = segment.strip()
    if segment and not all(c.isspace() or c in _DROPPABLE for c in segment):
        segments.append(segment)

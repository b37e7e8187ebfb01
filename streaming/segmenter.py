"""Incremental text segmenter between a token-by-token text stream and a one-segment-at-a-time TTS engine (Sans-I/O).

Owns the buffer of not-yet-spoken text and the decision of when to cut it: at a sentence end, at a clause end once long
enough, at `max_chars`, on client `flush`, after an idle pause (time comes in as `now_s` arguments; no clock reads), and
at `finish`. Lengths are spoken lengths (`text_units.spoken_length`: a Han character or Hangul syllable counts 3, a kana
2, anything else 1), so Chinese, Japanese and Korean text starts speaking as early as English text that takes as long
to say. It does not know about sockets, threads or the engine; where text may end is `streaming.text_units`.

Errors: SegmenterOverflow (a `streaming.errors.TextTooLong`: the client sent more than MAX_BUFFER_CHARS unspoken text);
`feed` after `finish` is a caller bug and raises RuntimeError.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

from .chunking import Latency
from .errors import TextTooLong
from .text_units import (
    Boundary,
    BoundaryKind,
    char_cut,
    is_speakable,
    scan_boundaries,
    space_cut,
    spoken_length,
    spoken_prefix,
)

# Most unspoken characters a segmenter holds; `feed` refuses text beyond it (a bound on memory per session).
MAX_BUFFER_CHARS = 10_000
# Already-emitted text kept in front of the buffer so boundary decisions see the same look-back as a whole-text scan.
CONTEXT_CHARS = 32
# A max-length split prefers the last clause/sentence end over the last space if it keeps at least this share of
# `max_chars` (a 5-char "Well, " followed by a 150-char forced split reads worse than one split at a space).
MIN_BOUNDARY_SHARE_OF_MAX = 0.5
# Fish TTSRequest defaults and ranges (ANCHORS.md §4).
FISH_CHUNK_LENGTH = 200
FISH_CHUNK_LENGTH_RANGE = (100, 300)
FISH_MIN_CHUNK_LENGTH = 50
FISH_MIN_CHUNK_LENGTH_RANGE = (0, 100)
FISH_LATENCY = Latency.BALANCED
_NON_SPACE = re.compile(r"\S")


@dataclass(frozen=True, slots=True)
class _LatencyMode:
    first_min_chars: int  # first segment: shortest cut at a clause end
    clause_share_of_max: float  # later segments cut at a clause end once max(min_chars, share * max_chars) long
    idle_timeout_s: float  # LLM silence after which a buffered unit is spoken anyway


# Fish `latency`: "low" speaks the first clause of >= 8 chars, cuts later clauses as soon as min_chunk_length is
# reached and speaks after 0.25 s of silence; "balanced" (Fish's default) waits for 20 chars / half a chunk / 0.5 s;
# "normal" (quality first) for 40 chars / three quarters of a chunk / 1 s, so segments are longer and cut at sentences.
# In every mode the first sentence end cuts the first segment whatever its length.
LATENCY_MODES: dict[Latency, _LatencyMode] = {
    Latency.LOW: _LatencyMode(first_min_chars=8, clause_share_of_max=0.0, idle_timeout_s=0.25),
    Latency.BALANCED: _LatencyMode(first_min_chars=20, clause_share_of_max=0.5, idle_timeout_s=0.5),
    Latency.NORMAL: _LatencyMode(first_min_chars=40, clause_share_of_max=0.75, idle_timeout_s=1.0),
}


class SegmenterOverflow(TextTooLong):
    """`feed` would hold more than MAX_BUFFER_CHARS unspoken characters; nothing was buffered."""


class Reason(enum.Enum):
    """Why a segment was cut where it was."""

    SENTENCE = "sentence"  # after a sentence end or a paragraph break
    CLAUSE = "clause"  # after a clause end or a line break
    MAX_LENGTH = "max_length"  # the text ran past max_chars with no boundary taken
    FLUSH = "flush"  # the client asked for everything buffered
    IDLE = "idle"  # the text stream paused for idle_timeout_s
    FINISH = "finish"  # end of input


@dataclass(frozen=True, slots=True)
class TextSegment:
    text: str  # the exact slice of the input, whitespace included: all `text`s joined == all fed text
    spoken_text: str  # `text` stripped, for the TTS engine; "" when nothing in it can be spoken (then skip it)
    reason: Reason

    @classmethod
    def of(cls, text: str, reason: Reason) -> TextSegment:
        return cls(text, text.strip() if is_speakable(text) else "", reason)


@dataclass(frozen=True, slots=True)
class SegmenterConfig:
    """Segment sizes in spoken length (`text_units.spoken_length`; leading/trailing whitespace not counted)."""

    max_chars: int = FISH_CHUNK_LENGTH  # hard cap on a segment (Fish chunk_length)
    min_chars: int = FISH_MIN_CHUNK_LENGTH  # later segments: shortest cut at a sentence end (Fish min_chunk_length)
    clause_min_chars: int = 100  # later segments: shortest cut at a clause end (balanced: half of max_chars)
    first_min_chars: int = LATENCY_MODES[FISH_LATENCY].first_min_chars  # first segment: shortest cut at a clause end
    idle_timeout_s: float | None = LATENCY_MODES[FISH_LATENCY].idle_timeout_s  # None: never cut on a pause

    def __post_init__(self) -> None:
        if not 1 <= self.max_chars <= MAX_BUFFER_CHARS // 2:
            raise ValueError(f"max_chars={self.max_chars} must be in 1..{MAX_BUFFER_CHARS // 2}")
        for name in ("min_chars", "clause_min_chars", "first_min_chars"):
            value = getattr(self, name)
            if not 0 <= value <= self.max_chars:
                raise ValueError(f"{name}={value} must be in 0..{self.max_chars}; lower it or raise max_chars")
        if self.idle_timeout_s is not None and not self.idle_timeout_s > 0:
            raise ValueError(f"idle_timeout_s={self.idle_timeout_s} must be > 0 (use None to disable the idle cut)")

    @classmethod
    def from_fish(
        cls,
        chunk_length: int = FISH_CHUNK_LENGTH,
        min_chunk_length: int = FISH_MIN_CHUNK_LENGTH,
        latency: Latency | str = FISH_LATENCY,
    ) -> SegmenterConfig:
        """Config from a Fish TTSRequest's `chunk_length`, `min_chunk_length` and `latency` (see LATENCY_MODES)."""
        lo, hi = FISH_CHUNK_LENGTH_RANGE
        if not lo <= chunk_length <= hi:
            raise ValueError(f"chunk_length={chunk_length} must be in {lo}..{hi}")
        lo, hi = FISH_MIN_CHUNK_LENGTH_RANGE
        if not lo <= min_chunk_length <= hi:
            raise ValueError(f"min_chunk_length={min_chunk_length} must be in {lo}..{hi}")
        try:
            mode = LATENCY_MODES[Latency(latency)]
        except ValueError:
            choices = ", ".join(m.value for m in Latency)
            raise ValueError(f"latency={latency!r} must be one of {choices}") from None
        return cls(
            max_chars=chunk_length,
            min_chars=min_chunk_length,
            clause_min_chars=max(min_chunk_length, int(chunk_length * mode.clause_share_of_max)),
            first_min_chars=mode.first_min_chars,
            idle_timeout_s=mode.idle_timeout_s,
        )


class Segmenter:
    """Cuts a text stream into segments; one instance per utterance (`finish` ends it).

    - A unit end is only known once the next visible character arrives, so "3." waits for "14" and "Hello." for
      " World"; the whitespace after a unit stays with it (the next segment starts at a visible character). That costs
      one token when whitespace arrives alone, and spares a whitespace-only tail segment at `finish`.
    - "First" segments (the first one, and the first after a `flush` or an idle cut: the listener is waiting) cut at
      any sentence end and at a clause end of `first_min_chars`; later ones need `min_chars` / `clause_min_chars`.
    - A piece with nothing speakable (whitespace, punctuation, emoji) is never cut off alone: it stays buffered and
      joins the next segment. Only `finish` (the tail) and a max-length split of such text emit `spoken_text == ""`.
    - `flush` emits everything buffered as one segment, a trailing partial word included: Fish's flush means
      "synthesize all buffered text now", and a held-back word could wait indefinitely for text that never comes
      (a flush between the code points of one emoji splits it; nothing else does).
    - The idle cut emits up to the last unit end (sentence, clause or line end, "Hello." at the buffer end counts);
      text with no unit end ("Sure thing") is not spoken on a pause, only on flush/finish.
    """

    def __init__(self, config: SegmenterConfig | None = None) -> None:
        self.config = config if config is not None else SegmenterConfig()
        self._buf = ""  # CONTEXT_CHARS of emitted text, then the unspoken text from _start
        self._start = 0
        self._scan_pos = 0  # where the boundary scanner resumes
        self._bounds: list[Boundary] = []  # confirmed boundaries with cut > _start, in order
        self._judged = 0  # how many of _bounds were judged (and refused) for the segment starting at _start
        self._last_visible = 0  # index just past the last non-whitespace char in _buf
        self._first = True
        self._last_feed_s: float | None = None
        self._finished = False

    def feed(self, text: str, now_s: float) -> list[TextSegment]:
        """Append text received at `now_s` (it re-arms the idle timer); return the segments now complete."""
        if self._finished:
            raise RuntimeError("text fed after finish(); start a new Segmenter for the next utterance")
        buffered = len(self._buf) - self._start
        if buffered + len(text) > MAX_BUFFER_CHARS:
            raise SegmenterOverflow(
                f"text buffer limit of {MAX_BUFFER_CHARS} characters exceeded ({buffered} buffered + {len(text)} new); "
                "send text in smaller pieces, or flush before sending more"
            )
        if not text:
            return []
        base = len(self._buf)
        self._buf += text
        visible = text.rstrip()
        if visible:
            self._last_visible = base + len(visible)
        self._last_feed_s = now_s
        out = self._drain()
        self._compact()
        return out

    def flush(self) -> list[TextSegment]:
        """Emit everything buffered now (even mid-sentence); the next segment is treated as a first one again."""
        if self._finished:
            return []
        out = self._emit_rest(Reason.FLUSH, keep_unspeakable=True)
        self._first = True
        self._compact()
        return out

    def finish(self) -> list[TextSegment]:
        """End of input: emit the rest. Calling it again returns []; `feed` afterwards raises RuntimeError."""
        if self._finished:
            return []
        out = self._emit_rest(Reason.FINISH, keep_unspeakable=False)
        self._finished = True
        self._compact()
        return out

    def deadline_s(self) -> float | None:
        """When `poll` will cut on idle: last feed time + idle_timeout_s if a unit end is buffered, else None."""
        timeout_s = self.config.idle_timeout_s
        if self._finished or timeout_s is None or self._last_feed_s is None or self._idle_cut() is None:
            return None
        return self._last_feed_s + timeout_s

    def poll(self, now_s: float) -> list[TextSegment]:
        """Idle timer: at or after `deadline_s()`, emit the buffer up to its last unit end."""
        deadline_s = self.deadline_s()
        cut = self._idle_cut()
        if deadline_s is None or now_s < deadline_s or cut is None:
            return []
        out = [self._emit(cut, Reason.IDLE)]
        self._first = True
        self._compact()
        return out

    # -- internals -------------------------------------------------------------------------------------------------

    def _drain(self) -> list[TextSegment]:
        found, self._scan_pos = scan_boundaries(self._buf, self._scan_pos, final=False)
        self._bounds.extend(b for b in found if b.cut > self._start)
        out = []
        while (segment := self._next_segment()) is not None:
            out.append(segment)
        return out

    def _next_segment(self) -> TextSegment | None:
        start = self._start
        if self._last_visible <= start:
            return None  # only whitespace buffered
        first_visible, limit = self._limit()
        while self._judged < len(self._bounds):
            bound = self._bounds[self._judged]
            if bound.end > limit:
                break
            self._judged += 1
            piece = self._buf[start : bound.end]
            if spoken_length(piece.strip()) >= self._min_chars(bound.kind) and is_speakable(piece):
                return self._emit(bound.cut, Reason(bound.kind.value))
        if self._last_visible > limit:
            return self._emit(self._max_length_cut(first_visible, limit), Reason.MAX_LENGTH)
        return None

    def _limit(self) -> tuple[int, int]:
        """Index of the first visible unspoken char, and the index `max_chars` of spoken length after it."""
        match = _NON_SPACE.search(self._buf, self._start)
        first_visible = len(self._buf) if match is None else match.start()
        return first_visible, spoken_prefix(self._buf, first_visible, self.config.max_chars)

    def _min_chars(self, kind: BoundaryKind) -> int:
        if kind is BoundaryKind.SENTENCE:
            return 1 if self._first else self.config.min_chars
        return self.config.first_min_chars if self._first else self.config.clause_min_chars

    def _max_length_cut(self, first_visible: int, limit: int) -> int:
        """Where to split text that runs past `limit`: a unit end, else a space, else a CJK/grapheme boundary."""
        start = self._start
        best = None
        for bound in self._bounds:
            if bound.end <= limit and is_speakable(self._buf[start : bound.end]):
                best = bound
        if best is not None:
            share = spoken_length(self._buf[start : best.end].strip()) / self.config.max_chars
            if share >= MIN_BOUNDARY_SHARE_OF_MAX:
                return best.cut
        cut = space_cut(self._buf, first_visible, limit)
        if cut is not None:
            return cut
        if best is not None:
            return best.cut
        return char_cut(self._buf, first_visible, limit)

    def _idle_cut(self) -> int | None:
        if self._last_visible <= self._start:
            return None
        tail, _ = scan_boundaries(self._buf, self._scan_pos, final=True)
        for bound in reversed(self._bounds + tail):
            if bound.cut > self._start:
                return bound.cut if is_speakable(self._buf[self._start : bound.end]) else None
        return None

    def _emit_rest(self, reason: Reason, *, keep_unspeakable: bool) -> list[TextSegment]:
        out = self._drain()
        rest = self._buf[self._start :]
        if is_speakable(rest) or (rest and not keep_unspeakable):
            out.append(self._emit(len(self._buf), reason))
        return out

    def _emit(self, cut: int, reason: Reason) -> TextSegment:
        segment = TextSegment.of(self._buf[self._start : cut], reason)
        self._start = cut
        self._bounds = [b for b in self._bounds if b.cut > cut]
        self._judged = 0
        if segment.spoken_text:
            self._first = False
        return segment

    def _compact(self) -> None:
        """Drop emitted text, keeping CONTEXT_CHARS of it for look-back; shift every index."""
        drop = self._start - CONTEXT_CHARS
        if drop <= 0:
            return
        self._buf = self._buf[drop:]
        self._start -= drop
        self._scan_pos = max(0, self._scan_pos - drop)
        self._last_visible = max(0, self._last_visible - drop)
        self._bounds = [Boundary(max(0, b.end - drop), b.cut - drop, b.kind) for b in self._bounds]

"""One-shot synthesis through the streaming engine: text in, the whole utterance's float32 PCM out.

Runs exactly the path the live endpoint runs for text sent at once followed by `stop` (segmenter `feed` + `finish`,
one engine session, one utterance), so the same seed gives the same samples as the streamed path. Also turns an
uploaded reference recording into a Voice. Knows nothing about files, wire formats or the command line.
"""

from __future__ import annotations

import numpy as np

from .audio_in import decode_audio_file
from .engine_api import EngineHandle
from .errors import BadReferenceAudio, FishgateError
from .segmenter import Segmenter, SegmenterConfig
from .session import AudioChunk, SessionError, SynthesisSettings, UtteranceDone, Voice

# Reference recordings larger than this are refused before decoding (a voice prompt is seconds of speech).
MAX_REFERENCE_BYTES = 64 * 2**20


class SynthesisFailed(FishgateError):
    """The engine reported an error for the utterance; `code` is the engine's code."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


# slice size for feeding long texts: well under the segmenter's buffer limit (MAX_BUFFER_CHARS)
FEED_CHARS = 4000


def segment_text(text: str, config: SegmenterConfig) -> list[str]:
    """The segments the live endpoint speaks for `text` sent at once and then `stop` (empty ones dropped).

    Fed in slices below the segmenter's buffer limit; segments do not depend on how text is sliced (tested). Leading
    and trailing whitespace is dropped first (no segment speaks it; held, a long run would fill the buffer).
    """
    text = text.strip()
    segmenter = Segmenter(config)
    segments = []
    for start in range(0, len(text), FEED_CHARS):
        segments += segmenter.feed(text[start : start + FEED_CHARS], 0.0)
    segments += segmenter.finish()
    return [s.spoken_text for s in segments if s.spoken_text]


async def synthesize(
    engine: EngineHandle,
    text: str,
    voice: Voice | None = None,
    settings: SynthesisSettings | None = None,
    segmenter_config: SegmenterConfig | None = None,
) -> np.ndarray:
    """Speak `text` as one utterance of a fresh engine session; return its float32 mono PCM at the model's rate.

    Raises SynthesisFailed when the engine reports an error (a fatal session error or an utterance that ended
    with reason "error"); the engine's own exceptions (NotReady, Overloaded) pass through.
    """
    pieces = segment_text(text, segmenter_config or SegmenterConfig())
    session = await engine.admit(voice or Voice(), settings or SynthesisSettings())
    chunks: list[np.ndarray] = []
    errors: list[SessionError] = []
    try:
        for piece in pieces:
            session.speak(piece)
        session.end_utterance()
        while True:
            ev = await session.next_event()
            if isinstance(ev, AudioChunk):
                chunks.append(ev.pcm)
            elif isinstance(ev, SessionError):
                errors.append(ev)
                if ev.fatal:
                    raise SynthesisFailed(ev.code, ev.message)
            elif isinstance(ev, UtteranceDone):
                if ev.reason == "error":
                    first = errors[0] if errors else SessionError("internal_error", "the utterance failed")
                    raise SynthesisFailed(first.code, first.message)
                break
    finally:
        session.close()
    return np.concatenate(chunks).astype(np.float32, copy=False) if chunks else np.zeros(0, np.float32)


async def reference_voice(
    engine: EngineHandle, audio_file: bytes, transcript: str, *, min_duration_s: float, max_duration_s: float
) -> Voice:
    """A Voice from one reference recording (any file libsndfile reads) and its transcript, encoded by the engine."""
    if not transcript.strip():
        raise BadReferenceAudio("a reference recording needs its transcript (the words spoken in it)")
    try:
        samples, rate_hz = decode_audio_file(
            audio_file, max_bytes=MAX_REFERENCE_BYTES, min_duration_s=min_duration_s, max_duration_s=max_duration_s
        )
    except ValueError as e:  # ReferenceAudioError: the message names the fix
        raise BadReferenceAudio(str(e)) from None
    codes = await engine.encode_reference(samples, rate_hz)
    return Voice(((transcript, codes),))

"""Speak one whole text, yield encoded bytes: the runner behind both HTTP synthesis APIs.

text → Segmenter (the live WebSocket's segmenter and config, fed everything then finished, so a seeded request
cuts the text where `/v1/tts/live` would and gives the same audio) → one engine session (speak each segment,
end the utterance) → AudioOutput → bytes, each chunk as soon as the engine produced it. Engine errors come back
as the FishgateError they were (so `server.wire.to_wire` maps them); the session is closed whatever happens.
Knows nothing about HTTP or request fields.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass

from streaming.audio_out import FISH_SPEED_RANGE, AudioOutput, OutputFormat
from streaming.engine_api import EngineHandle
from streaming.errors import (
    BadReferenceAudio,
    EngineFault,
    EngineUnavailable,
    FishgateError,
    NotReady,
    Overloaded,
    PromptTooLong,
    SessionClosed,
    TextTooLong,
    UnknownVoice,
    UnsupportedLanguage,
    ValueOutOfRange,
)
from streaming.segmenter import SegmenterConfig
from streaming.session import (
    AudioChunk,
    SegmentDone,
    Session,
    SessionError,
    SynthesisSettings,
    UtteranceDone,
    Voice,
)
from streaming.synth import segment_text

from .gateway import Gateway
from .http_common import encode_audio
from .wire import INTERNAL_MESSAGE

log = logging.getLogger(__name__)

# engine error codes (SessionError.code) → the exception family `to_wire` maps; anything else is internal
_EVENT_ERRORS: dict[str, type[FishgateError]] = {
    cls.code: cls
    for cls in (
        TextTooLong, ValueOutOfRange, PromptTooLong, UnknownVoice, BadReferenceAudio, Overloaded, SessionClosed,
        NotReady, EngineUnavailable, UnsupportedLanguage,
    )
}  # fmt: skip


@dataclass(frozen=True, slots=True)
class SynthesisJob:
    """Everything one HTTP synthesis needs, validated."""

    text: str  # already normalized if the request asked for it
    voice: Voice
    settings: SynthesisSettings
    output: OutputFormat
    segmenter: SegmenterConfig
    speed_range: tuple[float, float] = FISH_SPEED_RANGE  # OpenAI allows 0.25–4.0


def error_from_event(ev: SessionError) -> FishgateError:
    cls = _EVENT_ERRORS.get(ev.code)
    return cls(ev.message) if cls is not None else EngineFault(INTERNAL_MESSAGE)


class Synthesis:
    """One running synthesis: an engine session speaking one utterance. Iterate `chunks()` once for the bytes.

    `open` validates the output format, refuses text with nothing to speak or that the model cannot read (every
    segment checked, so the refusal is an HTTP error and never a file cut short) and admits the session (waiting a
    moment while the real-time admission defers it; NotReady / Overloaded raise here, before any response is sent).
    """

    def __init__(self, session: Session, output: AudioOutput, segments: int) -> None:
        self.session = session
        self.output = output
        self.segments = segments
        self.frames = 0  # codec frames generated so far
        self.audio_samples = 0  # model-rate samples generated so far

    @classmethod
    async def open(cls, engine: EngineHandle, job: SynthesisJob) -> Synthesis:
        segments = segment_text(job.text, job.segmenter)
        if not segments:
            raise ValueOutOfRange("the text has nothing to speak (only spaces, punctuation or symbols); send words")
        try:  # every segment before any audio: a refusal is an HTTP error, never a cut-off file
            await engine.check_texts(segments)
        except UnsupportedLanguage as e:
            log.warning("HTTP synthesis refused: %s", e)
            raise
        rate_hz = engine.info.sample_rate_hz if engine.info is not None else 44_100
        output = AudioOutput(job.output, rate_hz, speed_range=job.speed_range)
        session = await engine.admit(job.voice, job.settings)
        try:
            for text in segments:
                session.speak(text)
            session.end_utterance()
        except BaseException:
            session.close()
            raise
        return cls(session, output, len(segments))

    @property
    def media_type(self) -> str:
        return self.output.media_type

    def close(self) -> None:
        self.session.close()

    async def chunks(self) -> AsyncGenerator[bytes, None]:
        """Encoded bytes as the engine produces them; ends after the utterance; raises the engine's errors."""
        try:
            while True:
                ev = await self.session.next_event()
                if isinstance(ev, AudioChunk):
                    self.audio_samples += len(ev.pcm)
                    data = await encode_audio(self.output, ev.pcm)
                    if data:
                        yield data
                elif isinstance(ev, SegmentDone):
                    self.frames += ev.frames
                elif isinstance(ev, UtteranceDone):
                    if ev.reason == "max_audio":
                        log.warning("HTTP synthesis reached the per-utterance audio cap; the audio is cut there")
                    tail = await asyncio.to_thread(self.output.finish)
                    if tail:
                        yield tail
                    return
                elif isinstance(ev, SessionError):
                    raise error_from_event(ev)
        finally:
            self.session.close()


async def primed(
    chunks: AsyncGenerator[bytes, None], on_first: Callable[[], None] | None = None
) -> AsyncIterator[bytes]:
    """Wait for the first chunk (so errors before any audio can still become an HTTP error status), then return an
    iterator over all chunks. `on_first` runs when the first chunk is there (time-to-first-audio metrics)."""
    try:
        first = await anext(chunks)
    except StopAsyncIteration:
        first = b""
    except BaseException:
        await chunks.aclose()
        raise
    if on_first is not None:
        on_first()
    return _prepend(first, chunks)


async def _prepend(first: bytes, rest: AsyncGenerator[bytes, None]) -> AsyncGenerator[bytes, None]:
    try:
        if first:
            yield first
        async for chunk in rest:
            yield chunk
    finally:
        await rest.aclose()


async def start_synthesis(
    gw: Gateway, job: SynthesisJob, api: str, request_start_s: float
) -> tuple[Synthesis, AsyncIterator[bytes]]:
    """Open the synthesis and wait for its first audio; count the request and its time to first audio."""
    gw.metrics.http_requests.labels(api=api).inc()
    synth = await Synthesis.open(gw.engine, job)
    chunks = await primed(synth.chunks(), lambda: gw.metrics.first_audio.observe(time.monotonic() - request_start_s))
    return synth, chunks

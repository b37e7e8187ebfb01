"""OpenAI's `POST /v1/audio/speech`: `model`, `input`, `voice`, `response_format`, `speed`, `stream_format`, + `seed`.

`model` may be anything (the loaded model serves). `voice` is a stored reference id (a string or `{"id": …}`);
"default" and OpenAI's built-in names (alloy, echo, …) mean the model's own voice unless a stored voice has that id.
Audio is 24 kHz (pcm = 24 kHz s16le mono; opus is encoded at 48 kHz) and always streamed: `stream_format=audio`
sends the encoded bytes as a chunked body, `sse` sends `speech.audio.delta` events then `speech.audio.done`.
Sampling and segmentation use Fish's defaults (the same as `/v1/tts` and `/v1/tts/live`), so a seeded request gives
the same samples through all three. `aac` is refused (400): no AAC encoder ships with fishgate.
"""

from __future__ import annotations

import base64
import json
import logging
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, replace
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from streaming.audio_out import OutputFormat, validate_output_format
from streaming.errors import UnknownVoice, ValueOutOfRange
from streaming.sampling_defaults import FISH_SAMPLING, SamplingDefaults
from streaming.session import Voice

from .gateway import Gateway
from .http_common import AudioStreamResponse, api_endpoint, decode_object, read_body
from .params import (
    OPENAI_SPEED,
    TTSParams,
    check_choice,
    check_range,
    check_text,
    parse_tts_request,
    require_field,
)
from .synthesis import Synthesis, SynthesisJob, start_synthesis
from .voices import DEFAULT_VOICE
from .wire import is_known, to_wire

log = logging.getLogger(__name__)

MAX_INPUT_CHARS = 4096  # OpenAI's limit on `input`
FORMATS = ("mp3", "opus", "aac", "flac", "wav", "pcm")
STREAM_FORMATS = ("audio", "sse")
SAMPLE_RATE_HZ = 24_000  # OpenAI's output rate (its pcm is documented as 24 kHz s16le mono)
OPUS_SAMPLE_RATE_HZ = 48_000  # Opus's native rate, as OpenAI's opus files
# OpenAI's built-in voice names: no such voices here, so they mean the model's own voice
BUILTIN_VOICES = (
    "alloy", "ash", "ballad", "coral", "echo", "fable", "nova", "onyx", "sage", "shimmer", "verse", "marin", "cedar",
)  # fmt: skip
# JSON bodies: `input` is at most 4096 characters, so anything near this size is not a speech request
MAX_BODY_BYTES = 256 * 1024


@dataclass(frozen=True, slots=True)
class SpeechRequest:
    text: str
    voice: str
    params: TTSParams  # Fish's defaults for everything OpenAI does not name; `output` is OpenAI's
    stream_format: str


def parse_speech_request(
    req: Mapping[str, Any], max_text_chars: int, sampling: SamplingDefaults = FISH_SAMPLING
) -> SpeechRequest:
    """Validate an OpenAI speech request; ranges come from `server.params`."""
    require_field(req, "input", "the text to speak (fish-speech's /v1/tts names it `text`)")
    text = check_text("input", req.get("input"), min(MAX_INPUT_CHARS, max_text_chars))
    voice = _voice_id(req.get("voice"))
    fmt = check_choice("response_format", _or(req.get("response_format"), "mp3"), FORMATS)
    speed = float(check_range("speed", _or(req.get("speed"), 1.0), OPENAI_SPEED))
    stream_format = check_choice("stream_format", _or(req.get("stream_format"), "audio"), STREAM_FORMATS)
    model = req.get("model")
    if model is not None and not isinstance(model, str):
        raise ValueOutOfRange(f"model must be a string (got {type(model).__name__}); any name is accepted")
    # Fish's parser supplies the defaults (sampling, segmentation) and checks `seed`; the output is OpenAI's
    base = parse_tts_request({"seed": req.get("seed"), "format": "pcm"}, max_text_chars=1, sampling=sampling)
    rate = OPUS_SAMPLE_RATE_HZ if fmt == "opus" else SAMPLE_RATE_HZ
    output = OutputFormat(fmt, rate, None, 0.0, speed)
    validate_output_format(output, OPENAI_SPEED)  # refuses aac with the reason and the fix
    return SpeechRequest(text, voice, replace(base, output=output), stream_format)


def _voice_id(voice: Any) -> str:
    if voice is None:
        return DEFAULT_VOICE
    if isinstance(voice, Mapping):
        voice = voice.get("id")
    if not isinstance(voice, str) or not voice:
        raise ValueOutOfRange(
            'voice must be a stored voice id (GET /v1/references), "default", or {"id": "<stored id>"}'
        )
    return voice


async def speech(request: Request, gw: Gateway) -> Response:
    started_s = time.monotonic()
    req = decode_object(request, await read_body(request, MAX_BODY_BYTES))
    sr = parse_speech_request(req, gw.settings.max_text_chars, gw.sampling_defaults())
    try:
        voice = await gw.voices.resolve(sr.voice, [])
    except UnknownVoice:
        if sr.voice not in BUILTIN_VOICES:
            raise
        voice = Voice()  # no stored voice of that name: the built-in names mean the model's own voice
    p = sr.params
    job = SynthesisJob(sr.text, voice, p.settings, p.output, p.segmenter, OPENAI_SPEED)
    synth, chunks = await start_synthesis(gw, job, "openai", started_s)
    timeout_s = gw.settings.send_timeout_s
    if sr.stream_format == "sse":
        events = sse_events(chunks, synth, len(sr.text))
        return AudioStreamResponse(events, "text/event-stream", timeout_s, {"X-Accel-Buffering": "no"})
    return AudioStreamResponse(chunks, synth.media_type, timeout_s, {})


async def sse_events(chunks: AsyncIterator[bytes], synth: Synthesis, input_chars: int) -> AsyncIterator[bytes]:
    """`speech.audio.delta` per chunk, then `speech.audio.done` with usage (input characters, output codec frames);
    an error after the first byte becomes an `error` event."""
    try:
        async for chunk in chunks:
            yield _event({"type": "speech.audio.delta", "audio": base64.b64encode(chunk).decode("ascii")})
    except Exception as e:  # after the status line: report it in-band, then end the stream cleanly
        if not is_known(e):
            log.error("speech SSE stream failed unexpectedly: %s", type(e).__name__, exc_info=e)
        w = to_wire(e)
        yield _event({"type": "error", "error": {"code": w.code, "message": w.message}})
        return
    usage = {"input_tokens": input_chars, "output_tokens": synth.frames, "total_tokens": input_chars + synth.frames}
    yield _event({"type": "speech.audio.done", "usage": usage})


def _event(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value


def routes() -> list[BaseRoute]:
    return [Route("/v1/audio/speech", api_endpoint(speech), methods=["POST"])]

"""fish-speech's HTTP API: `POST /v1/tts` (JSON or MessagePack body, whole file or chunked WAV) and `/v1/health`.

Fields are fish-speech's ServeTTSRequest, validated by `server.params.parse_tts_request` (the one range table), plus
what its deployment image documents: `reference_audio`, a server-side path, accepted only inside the references
directory (`VoiceStore.resolve_path`), with `reference_text` or a same-name `.lab` transcript beside it. In JSON,
`references[].audio` is base64 text. `use_memory_cache` is accepted and ignored: encoded voices are always cached.
Knows the fields; the synthesis itself is `server.synthesis`.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from streaming.audio_encoders import wav_header
from streaming.audio_out import validate_output_format
from streaming.errors import ValueOutOfRange

from .gateway import Gateway
from .http_common import (
    AudioStreamResponse,
    api_endpoint,
    collect,
    decode_object,
    is_msgpack,
    off_loop_if_large,
    read_body,
)
from .params import (
    HTTP_FORMATS,
    MAX_REFERENCES,
    check_bool,
    check_reference_text,
    parse_tts_request,
    require_field,
)
from .synthesis import SynthesisJob, start_synthesis

# fish-speech's /v1/tts answers WAV unless told otherwise (its live API defaults to mp3)
DEFAULT_FORMAT = "wav"
WAV_HEADER_BYTES = 44
# a server-side path longer than this is not a reference file name
MAX_PATH_CHARS = 1024
MEMORY_CACHE_VALUES = ("on", "off")


async def tts(request: Request, gw: Gateway) -> Response:
    started_s = time.monotonic()
    body = await read_body(request, gw.settings.max_frame_bytes)
    req = await off_loop_if_large(len(body), decode_tts_body, request, body)
    require_field(req, "text", "the text to speak (OpenAI's /v1/audio/speech names it `input`)")
    if req.get("format") is None:
        req["format"] = DEFAULT_FORMAT
    params = parse_tts_request(
        req, formats=HTTP_FORMATS, max_text_chars=gw.settings.max_text_chars, sampling=gw.sampling_defaults()
    )
    streaming = check_bool("streaming", _or(req.get("streaming"), False))
    cache = req.get("use_memory_cache")
    if cache is not None and not isinstance(cache, bool) and cache not in MEMORY_CACHE_VALUES:
        raise ValueOutOfRange(f"use_memory_cache must be 'on' or 'off' (got {cache!r}); voices are always cached")
    validate_output_format(params.output)

    inline = [(r.text, r.audio) for r in params.references]
    if req.get("reference_audio") is not None:
        inline.append(await read_server_reference(gw, req.get("reference_audio"), req.get("reference_text")))
        if len(inline) > MAX_REFERENCES:
            raise ValueOutOfRange(f"at most {MAX_REFERENCES} references are accepted, reference_audio included")
    voice = await gw.voices.resolve(params.reference_id, inline)
    job = SynthesisJob(params.text, voice, params.settings, params.output, params.segmenter)

    synth, chunks = await start_synthesis(gw, job, "fish", started_s)
    fmt = params.output.format
    headers = {"Content-Disposition": f"attachment; filename=audio.{fmt}"}
    if streaming:
        return AudioStreamResponse(chunks, synth.media_type, gw.settings.send_timeout_s, headers)
    data = await collect(request, chunks)
    if data is None:
        return Response(status_code=400)  # the client left; nobody reads this
    if fmt == "wav":
        data = complete_wav(data, synth.output.codec_sample_rate_hz)
    return Response(data, media_type=synth.media_type, headers=headers)


async def health(request: Request, gw: Gateway) -> Response:
    """fish-speech's health check: ok once the engine is ready (`/healthz` and `/readyz` need no key)."""
    ready = gw.engine.ready and not gw.draining.is_set()
    return JSONResponse({"status": "ok" if ready else "not_ready"}, status_code=200 if ready else 503)


def decode_tts_body(request: Request, body: bytes) -> dict[str, Any]:
    """The request object with its references' audio as bytes (base64 text in JSON bodies)."""
    req = dict(decode_object(request, body))
    req["references"] = decode_references(req.get("references"), base64_text=not is_msgpack(request))
    return req


def decode_references(refs: Any, *, base64_text: bool) -> Any:
    """JSON carries reference audio as base64 text: turn it into bytes (anything else is left to the parser)."""
    if refs is None:
        return []
    if not isinstance(refs, list) or not base64_text:
        return refs
    out = []
    for i, ref in enumerate(refs):
        if isinstance(ref, Mapping) and isinstance(ref.get("audio"), str):
            try:
                audio = base64.b64decode(ref["audio"], validate=True)
            except (binascii.Error, ValueError):
                raise ValueOutOfRange(
                    f"references[{i}].audio must be the audio file's bytes as base64 text (in JSON bodies)"
                ) from None
            out.append({**ref, "audio": audio})
        else:
            out.append(ref)
    return out


async def read_server_reference(gw: Gateway, raw: Any, text: Any) -> tuple[str, bytes]:
    """fish-speech's `reference_audio` path → (transcript, file bytes), only from inside the references directory."""
    if not isinstance(raw, str) or not raw or len(raw) > MAX_PATH_CHARS or "\x00" in raw:
        raise ValueOutOfRange(
            f"reference_audio must be a file name inside the server's references directory (a string of at most "
            f"{MAX_PATH_CHARS} characters); or upload the audio as references[].audio"
        )
    try:
        path = gw.voices.resolve_path(raw)
        size = path.stat().st_size
    except (OSError, RuntimeError, ValueError):  # symlink loops, odd names: the same refusal
        raise ValueOutOfRange(
            "reference_audio paths must name a file inside the server's references directory; upload the audio "
            "instead (references[].audio or POST /v1/references)"
        ) from None
    limit = gw.settings.max_reference_bytes
    if size > limit:
        raise ValueOutOfRange(f"reference_audio is {size} bytes; the limit is {limit} bytes — use a shorter clip")
    if text is None:
        text = await asyncio.to_thread(_read_transcript, gw, path)
    if not isinstance(text, str) or not text.strip():
        raise ValueOutOfRange(
            "reference_audio needs its transcript: send reference_text, or put a same-name .lab file beside it"
        )
    check_reference_text(text, "the reference transcript")
    return text, await asyncio.to_thread(path.read_bytes)


def _read_transcript(gw: Gateway, audio: Path) -> str | None:
    """The same-name `.lab` beside the audio (fish-speech's layout), if it too lies inside the directory."""
    try:
        lab = gw.voices.resolve_path(str(audio.with_suffix(".lab")))
        return lab.read_text(encoding="utf-8").strip()
    except (OSError, RuntimeError, ValueError, ValueOutOfRange):  # a .lab linked out of the directory is not read
        return None


def complete_wav(streamed: bytes, sample_rate_hz: int) -> bytes:
    """A streamed WAV (unknown-length header) → one file whose RIFF and data lengths are right."""
    data = streamed[WAV_HEADER_BYTES:]
    return wav_header(sample_rate_hz, len(data)) + data


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value


def routes() -> list[BaseRoute]:
    return [
        Route("/v1/tts", api_endpoint(tts), methods=["POST"]),
        Route("/v1/health", api_endpoint(health), methods=["GET", "POST"]),
    ]

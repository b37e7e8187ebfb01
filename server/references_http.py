"""Stored voices over HTTP: `GET /v1/references`, `GET|DELETE /v1/references/{id}`, `POST /v1/references`.

POST takes a multipart form (`id`, `text` = the transcript, `audio` = the file; `replace=true` to overwrite) and
answers 201 once the audio is decoded (on a thread) and encoded to codec codes (on the engine's worker thread);
the codes are cached on disk by `server.voices.VoiceStore`, which owns ids, layout and limits. An id in use is
409 unless `replace=true`; "default" is reserved for the model's own voice. Knows nothing about synthesis.
"""

from __future__ import annotations

import asyncio

from starlette.datastructures import UploadFile
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from streaming.errors import RequestError, UnknownVoice, ValueOutOfRange

from .gateway import Gateway
from .http_common import InvalidBody, api_endpoint, read_body, replay_request
from .params import check_reference_text
from .voices import DEFAULT_VOICE, check_voice_id

# form overhead allowed on top of the audio file (boundaries, part headers, id, transcript)
FORM_OVERHEAD_BYTES = 256 * 1024
MAX_FORM_FIELDS = 8
MAX_TEXT_FIELD_BYTES = 64 * 1024  # a transcript longer than this is not the transcript of a <= 60 s clip
TRUE_VALUES = ("1", "true", "yes", "on")


class VoiceExists(RequestError):
    code = "voice_exists"


async def list_references(request: Request, gw: Gateway) -> Response:
    voices = await asyncio.to_thread(gw.voices.list_voices)
    return JSONResponse({"references": voices, "default": DEFAULT_VOICE})


async def get_reference(request: Request, gw: Gateway) -> Response:
    voice_id = _path_id(request)
    for voice in await asyncio.to_thread(gw.voices.list_voices):
        if voice["id"] == voice_id:
            return JSONResponse(voice)
    raise UnknownVoice(f"no voice {voice_id!r}; GET /v1/references lists the stored ones")


async def add_reference(request: Request, gw: Gateway) -> Response:
    media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media_type != "multipart/form-data":
        raise InvalidBody("send a multipart/form-data body with fields id, text (the transcript) and audio (the file)")
    body = await read_body(request, gw.settings.max_reference_bytes + FORM_OVERHEAD_BYTES)
    form = await replay_request(request, body).form(
        max_files=1, max_fields=MAX_FORM_FIELDS, max_part_size=MAX_TEXT_FIELD_BYTES
    )
    try:
        voice_id, text, audio = form.get("id"), form.get("text"), form.get("audio")
        if not isinstance(voice_id, str):
            raise ValueOutOfRange("the form needs a text field 'id' (the voice id to store it under)")
        check_voice_id(voice_id)
        if voice_id == DEFAULT_VOICE:
            raise ValueOutOfRange(f"the id {DEFAULT_VOICE!r} is reserved for the model's own voice; pick another")
        if not isinstance(text, str) or not text.strip():
            raise ValueOutOfRange("the form needs a text field 'text': the transcript of the audio (non-empty)")
        check_reference_text(text, "text")
        if not isinstance(audio, UploadFile):
            raise ValueOutOfRange("the form needs a file field 'audio' (WAV, FLAC, MP3 or Ogg speech, 1–60 s)")
        replace = str(form.get("replace", "false")).strip().lower() in TRUE_VALUES
        if not replace and await asyncio.to_thread(gw.voices.exists, voice_id):
            raise VoiceExists(
                f"voice {voice_id!r} exists; DELETE /v1/references/{voice_id} first, or send replace=true"
            )
        data = await audio.read()
    finally:
        await form.close()
    summary = await gw.voices.add(voice_id, text.strip(), data)
    return JSONResponse(summary, status_code=201, headers={"Location": f"/v1/references/{voice_id}"})


async def delete_reference(request: Request, gw: Gateway) -> Response:
    voice_id = _path_id(request)
    if voice_id == DEFAULT_VOICE:
        raise ValueOutOfRange(f"{DEFAULT_VOICE!r} is the model's own voice; it cannot be deleted")
    await asyncio.to_thread(gw.voices.delete, voice_id)
    return JSONResponse({"id": voice_id, "deleted": True})


def _path_id(request: Request) -> str:
    return check_voice_id(request.path_params["voice_id"])


def routes() -> list[BaseRoute]:
    return [
        Route("/v1/references", api_endpoint(list_references), methods=["GET"], name="list_references"),
        Route("/v1/references", api_endpoint(add_reference), methods=["POST"], name="add_reference"),
        Route("/v1/references/{voice_id}", api_endpoint(get_reference), methods=["GET"], name="get_reference"),
        Route("/v1/references/{voice_id}", api_endpoint(delete_reference), methods=["DELETE"]),
    ]

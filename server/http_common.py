"""What every HTTP `/v1` endpoint shares: the auth + rate-limit guard, JSON errors, capped bodies, audio responses.

Errors leave as `{"error": {"code", "message"}}` with the status `server.wire.to_wire` gives (plus 413 for bodies over
their cap and 409 for a voice id in use); unexpected exceptions are logged and reported as "internal error".
Audio goes out either streamed (`AudioStreamResponse`: chunked, each engine chunk sent as soon as it is encoded, a
client that stops reading for `send_timeout_s` is dropped) or collected whole (`collect`, which stops the engine
work when the client disconnects). Knows nothing about the fields of any API.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any, TypeVar

import msgpack
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Message, Receive, Send

from streaming.audio_out import AudioOutput
from streaming.errors import RequestError

from .gateway import Gateway
from .wire import is_known, to_wire

log = logging.getLogger(__name__)

T = TypeVar("T")

MSGPACK_MEDIA_TYPES = ("application/msgpack", "application/x-msgpack", "application/vnd.msgpack")
# msgpack limits for request bodies: no container larger than this (the body cap bounds strings and bytes)
MAX_CONTAINER_ITEMS = 10_000
# statuses that `to_wire` (shared with the WebSocket side) has no family for
STATUS_OVERRIDES = {"payload_too_large": 413, "voice_exists": 409}
# refusals a client should retry after a pause: tell it when (seconds)
RETRY_AFTER_S = {429: "1", 503: "1"}
# Bodies and frames larger than this are decoded on a worker thread: parsing tens of MB of JSON, MessagePack or
# base64 on the event loop stalls every stream it serves (a 30 MB /v1/tts body: 147 ms)
OFF_LOOP_BYTES = 1 << 20
# An audio chunk this short whose output is `light` (raw or WAV at the vocoder's rate, speed 1) is encoded on the
# loop: ≤ ~60 µs, where a thread hand-off costs ~100 µs and, under load, keeps a pool of threads taking turns at
# the GIL the engine's worker needs (H200: ~20 encoder threads busy at 384 streams). The engine's largest
# chunk is 24 frames (49,152 samples).
INLINE_ENCODE_SAMPLES = 65_536

Handler = Callable[[Request, Gateway], Awaitable[Response]]


class PayloadTooLarge(RequestError):
    code = "payload_too_large"


class InvalidBody(RequestError):
    code = "invalid_body"


def error_response(gw: Gateway, exc: BaseException) -> JSONResponse:
    """A known exception → its code, message and status; anything else is logged and becomes "internal error"."""
    if not is_known(exc):
        log.error("HTTP request failed unexpectedly: %s", type(exc).__name__, exc_info=exc)
    w = to_wire(exc)
    status = STATUS_OVERRIDES.get(w.code, w.http_status)
    gw.metrics.errors.labels(code=w.code).inc()
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else {}
    if status in RETRY_AFTER_S:
        headers["Retry-After"] = RETRY_AFTER_S[status]
    return JSONResponse({"error": {"code": w.code, "message": w.message}}, status_code=status, headers=headers)


def api_endpoint(handler: Handler) -> Callable[[Request], Awaitable[Response]]:
    """Wrap a `/v1` handler: host, origin and API key first, then the rate limit; every exception becomes a JSON
    error."""

    async def endpoint(request: Request) -> Response:
        gw: Gateway = request.app.state.gateway
        try:
            gw.check_caller(request)
            gw.check_rate(request)
            return await handler(request, gw)
        except ClientDisconnect:
            return Response(status_code=400)  # nobody is listening any more
        except HTTPException as e:  # Starlette's own refusals (e.g. a malformed multipart body)
            return error_response(gw, InvalidBody(f"the request body could not be parsed: {e.detail}"))
        except Exception as e:
            return error_response(gw, e)

    endpoint.__name__ = handler.__name__
    return endpoint


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The whole request body, refusing (413) before reading more than max_bytes."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise PayloadTooLarge(f"the request body is {declared} bytes; this endpoint accepts at most {max_bytes}")
    chunks, total = [], 0
    async for chunk in request.stream():
        total += len(chunk)
        if total > max_bytes:
            raise PayloadTooLarge(f"the request body exceeds {max_bytes} bytes, the most this endpoint accepts")
        chunks.append(chunk)
    return b"".join(chunks)


async def encode_audio(output: AudioOutput, pcm: Any) -> bytes:
    """`output.push(pcm)`: right here on the loop when it is light and the chunk short, else on a worker thread."""
    if output.light and len(pcm) <= INLINE_ENCODE_SAMPLES:
        return output.push(pcm)
    return await asyncio.to_thread(output.push, pcm)


async def off_loop_if_large(size: int, fn: Callable[..., T], *args: Any) -> T:
    """fn(*args) on a worker thread when its input is over OFF_LOOP_BYTES, else right here on the loop."""
    if size > OFF_LOOP_BYTES:
        return await asyncio.to_thread(fn, *args)
    return fn(*args)


def is_msgpack(request: Request) -> bool:
    media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    return media_type in MSGPACK_MEDIA_TYPES


def decode_object(request: Request, body: bytes) -> Mapping[str, Any]:
    """A JSON body, or a MessagePack one when Content-Type says `application/msgpack`; it must be an object."""
    if is_msgpack(request):
        try:
            obj = msgpack.unpackb(
                body, raw=False, strict_map_key=True, max_array_len=MAX_CONTAINER_ITEMS,
                max_map_len=MAX_CONTAINER_ITEMS, max_ext_len=0,
            )  # fmt: skip
        except ValueError as e:
            raise InvalidBody(f"the body is not one valid MessagePack map ({type(e).__name__})") from None
    else:
        try:
            obj = json.loads(body)
        except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            raise InvalidBody(
                f"the body is not valid JSON ({type(e).__name__}); send a JSON object, "
                "or MessagePack with 'Content-Type: application/msgpack'"
            ) from None
    if not isinstance(obj, Mapping):
        raise InvalidBody(f"the body must be an object with named fields (got {type(obj).__name__})")
    return obj


def replay_request(request: Request, body: bytes) -> Request:
    """A Request over the same scope whose body is `body` (already read and size-checked)."""
    sent = False

    async def receive() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await request.receive()

    return Request(request.scope, receive)


async def wait_for_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def collect(request: Request, chunks: AsyncIterator[bytes]) -> bytes | None:
    """All chunks joined; None if the client disconnected first (the synthesis is then stopped)."""

    async def gather() -> bytes:
        parts = []
        try:
            async for chunk in chunks:
                parts.append(chunk)
        finally:
            await _aclose(chunks)
        return b"".join(parts)

    work = asyncio.ensure_future(gather())
    watch = asyncio.ensure_future(wait_for_disconnect(request.receive))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (work, watch):
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
    if work.cancelled():
        return None
    return work.result()


class AudioStreamResponse(StreamingResponse):
    """Chunked audio: each chunk is sent when produced. A send blocked for `send_timeout_s` (a client that does not
    read) ends the response; an error after the first byte can only end it early (it is logged)."""

    def __init__(
        self, chunks: AsyncIterator[bytes], media_type: str, send_timeout_s: float, headers: Mapping[str, str]
    ) -> None:
        super().__init__(chunks, media_type=media_type, headers={"Cache-Control": "no-store", **headers})
        self.send_timeout_s = send_timeout_s

    async def stream_response(self, send: Send) -> None:
        chunks = self.body_iterator
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for chunk in chunks:
                body = {"type": "http.response.body", "body": chunk, "more_body": True}
                await asyncio.wait_for(send(body), self.send_timeout_s)
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except TimeoutError:
            log.warning("HTTP audio stream: the client did not read for %.0f s; dropping it", self.send_timeout_s)
        except Exception as e:  # after the status line: all we can do is end the body early
            if is_known(e):
                log.warning("HTTP audio stream ended early: %s (%s)", to_wire(e).code, to_wire(e).message)
            else:
                log.error("HTTP audio stream failed unexpectedly: %s", type(e).__name__, exc_info=e)
        finally:
            await _aclose(chunks)


async def _aclose(chunks: Any) -> None:
    close = getattr(chunks, "aclose", None)
    if close is not None:
        await close()

"""Fish Audio live TTS protocol (`/v1/tts/live`), Sans-I/O: frames in → client events; server events → frames.

Client → server: `start {request}`, then `text {text}` / `flush` / `cancel` (fishgate extension), then `stop`.
Server → client: `audio {audio}` …, `finish {reason: stop|error}`; then the socket waits for the next `start` (a
turn) or the client's close. fishgate extensions that Fish's clients ignore: `started`, `error {code, message}`,
`cancelled`, `timing {first_audio_ms}`.
Two encodings, chosen by the client's first frame: binary → MessagePack maps (what the official SDKs speak);
text → JSON objects, with audio sent as raw binary frames (for browsers without a msgpack library).
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgpack

from .wire import CLOSE_INVALID_PAYLOAD, CLOSE_UNSUPPORTED_DATA, ProtocolViolation

CLIENT_EVENTS = ("start", "text", "flush", "stop", "cancel")
# msgpack limits: no container or string larger than a frame can hold; nesting is bounded by the C unpacker
MAX_CONTAINER_ITEMS = 10_000


class Encoding(enum.Enum):
    MSGPACK = "msgpack"
    JSON = "json"


@dataclass(frozen=True, slots=True)
class ClientEvent:
    kind: str  # one of CLIENT_EVENTS
    payload: Mapping[str, Any]


class RecoverableError(Exception):
    """A client mistake that leaves the session usable: answer with an error event and carry on."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class BadStart(RecoverableError):
    """A `start` that cannot begin a turn: the client waits for its `finish`, so it gets one (with reason error)."""


def encoding_of_first_frame(message: Mapping[str, Any]) -> Encoding:
    """ASGI websocket.receive message → the session's encoding."""
    return Encoding.MSGPACK if message.get("bytes") is not None else Encoding.JSON


def decode_frame(message: Mapping[str, Any], encoding: Encoding, max_bytes: int) -> ClientEvent:
    """One ASGI receive message → ClientEvent. ProtocolViolation for wrong frame types or undecodable payloads;
    RecoverableError for well-formed messages with unknown or malformed events."""
    data, text = message.get("bytes"), message.get("text")
    if encoding is Encoding.MSGPACK:
        if data is None:
            raise ProtocolViolation(
                "wrong_frame_type", "this session speaks MessagePack (binary frames); do not mix in text frames",
                CLOSE_UNSUPPORTED_DATA,
            )  # fmt: skip
        try:
            obj = msgpack.unpackb(
                data, raw=False, strict_map_key=True, max_bin_len=max_bytes, max_str_len=max_bytes,
                max_array_len=MAX_CONTAINER_ITEMS, max_map_len=MAX_CONTAINER_ITEMS, max_ext_len=0,
            )  # fmt: skip
        except ValueError as e:  # every msgpack decoding error (format, nesting, extra data, UTF-8) is one
            raise ProtocolViolation(
                "invalid_payload", f"a binary frame is not one valid MessagePack map ({type(e).__name__})",
                CLOSE_INVALID_PAYLOAD,
            ) from None  # fmt: skip
    else:
        if text is None:
            raise ProtocolViolation(
                "wrong_frame_type", "this session speaks JSON (text frames); do not mix in binary frames",
                CLOSE_UNSUPPORTED_DATA,
            )  # fmt: skip
        try:
            obj = json.loads(text)
        except (json.JSONDecodeError, RecursionError) as e:
            raise ProtocolViolation(
                "invalid_payload", f"a text frame is not valid JSON ({type(e).__name__})", CLOSE_INVALID_PAYLOAD
            ) from None
    if not isinstance(obj, Mapping):
        raise RecoverableError("bad_event", 'each frame must be an object like {"event": "text", "text": "…"}')
    kind = obj.get("event")
    if kind not in CLIENT_EVENTS:
        raise RecoverableError("unknown_event", f"unknown event {kind!r}; expected one of {', '.join(CLIENT_EVENTS)}")
    if kind == "text" and not isinstance(obj.get("text"), str):
        raise RecoverableError("bad_event", 'a text event needs a string field "text"')
    if kind == "start" and not isinstance(obj.get("request"), Mapping):
        raise BadStart("bad_event", 'a start event needs an object field "request" (a TTSRequest)')
    return ClientEvent(kind, obj)


def encode_event(event: Mapping[str, Any], encoding: Encoding) -> dict[str, Any]:
    """Server event → ASGI websocket.send message. In JSON mode audio goes out as a raw binary frame."""
    if encoding is Encoding.MSGPACK:
        return {"type": "websocket.send", "bytes": msgpack.packb(dict(event), use_bin_type=True)}
    if event.get("event") == "audio":
        return {"type": "websocket.send", "bytes": bytes(event["audio"])}
    return {"type": "websocket.send", "text": json.dumps(dict(event), separators=(",", ":"))}


# The largest audio payload one message carries. The official fish-audio-sdk's socket (httpx-ws) closes with 1009
# above 65,536 bytes by default, and a 24-frame chunk of 16-bit PCM is 98,304 bytes; larger chunks go out as several
# messages of whole samples (the margin holds msgpack's envelope).
MAX_AUDIO_MESSAGE_BYTES = 65_536 - 64


def audio(data: bytes) -> dict[str, Any]:
    return {"event": "audio", "audio": data}


def audio_events(data: bytes) -> list[dict[str, Any]]:
    """`audio` events carrying `data` in order, none over MAX_AUDIO_MESSAGE_BYTES."""
    step = MAX_AUDIO_MESSAGE_BYTES
    return [audio(data[i : i + step]) for i in range(0, len(data), step)]


def finish(reason: str) -> dict[str, Any]:
    return {"event": "finish", "reason": reason}


def error(code: str, message: str) -> dict[str, Any]:
    return {"event": "error", "code": code, "message": message}

"""The engine link's wire format, Sans-I/O: frames, message kinds, and the codecs of what crosses the link.

A frame is a 4-byte big-endian payload length, then one MessagePack array whose first item is an `Op`. Arrays cross
as (dtype, shape, raw bytes) and audio as raw float32 bytes (msgpack `bin`: no per-sample encoding). Errors cross as
the name of their class in `streaming.errors` and their message. Knows nothing about sockets, the engine or asyncio.

    gateway → engine    HELLO version name token · CALL id method args · SPEAK sid utt text · END sid utt ·
                        CANCEL sid utt · CLOSE sid · ACK [sid, samples, …] (audio the gateway's clients have read)
    engine → gateway    WELCOME version info capacity max_queued_chars state · REFUSED message (then it closes) ·
                        RESULT id value · FAILURE id error message · STATUS state headroom (every STATUS_INTERVAL_S) ·
                        INFO info · STATS dict · AUDIO sid utt pcm · SEGMENT … · DONE … · CANCELLED sid utt ·
                        ERROR sid code message utt fatal

Nothing but HELLO is read before the engine has welcomed a connection; WELCOME's layout is the same in every version,
so gateway and engine of different versions can still tell each other so.
"""

from __future__ import annotations

import dataclasses
import enum
import struct
from typing import Any

import msgpack
import numpy as np

from .. import errors
from ..chunking import Latency
from ..engine_api import ModelInfo
from ..sampling_defaults import SamplingDefaults
from ..session import AudioChunk, Cancelled, Event, SegmentDone, SessionError, SynthesisSettings, UtteranceDone, Voice

# Bumped on any change to a message's layout; a gateway and an engine of different versions refuse each other.
# 2: HELLO carries a token, REFUSED, STATUS carries the engine's headroom.
PROTOCOL_VERSION = 2
# The largest frame either side accepts: a reference recording's samples on their way to be encoded are the largest
# message (float32 mono of at most 60 s: 46 MB at 192 kHz, 10.6 MB at 44.1 kHz); beyond, the link is broken.
MAX_FRAME_BYTES = 64 * 2**20
# The largest frame read before a connection is welcomed (its HELLO): an unauthenticated peer holds no more memory.
HELLO_MAX_FRAME_BYTES = 64 * 2**10
HEADER = struct.Struct(">I")
# How often the engine tells every gateway its state (a gateway that hears nothing for LINK_SILENCE_S gives up on it).
STATUS_INTERVAL_S = 0.25
# How often the engine sends its counters (Engine.stats) to every gateway: what a gateway's /metrics shows is this old.
STATS_INTERVAL_S = 1.0


class Op(enum.IntEnum):
    # gateway → engine
    HELLO = 1
    CALL = 2
    SPEAK = 3
    END = 4
    CANCEL = 5
    CLOSE = 6
    ACK = 7
    # engine → gateway
    WELCOME = 16
    RESULT = 17
    FAILURE = 18
    STATUS = 19
    INFO = 20
    STATS = 21
    REFUSED = 22
    AUDIO = 32
    SEGMENT = 33
    DONE = 34
    CANCELLED = 35
    ERROR = 36


class LinkBroken(Exception):
    """The peer broke the protocol (a frame too large or unreadable, an unknown message): the link is closed."""


class LinkRefused(LinkBroken):
    """The engine refused this gateway at its HELLO (REFUSED: a wrong or missing token); the message says why."""


# ---- frames ----------------------------------------------------------------------------------------------------------
def frame(message: list[Any]) -> bytes:
    """One message as a frame: length prefix + MessagePack."""
    payload = msgpack.packb(message, use_bin_type=True)
    if len(payload) > MAX_FRAME_BYTES:
        raise LinkBroken(f"a {len(payload)}-byte message exceeds the link's {MAX_FRAME_BYTES}-byte frame limit")
    return HEADER.pack(len(payload)) + payload


class FrameDecoder:
    """Bytes as they arrive → whole messages. Holds at most one partial frame (≤ max_frame_bytes + header)."""

    def __init__(self, max_frame_bytes: int = MAX_FRAME_BYTES) -> None:
        self.max_frame_bytes = max_frame_bytes
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[list[Any]]:
        buf = self._buffer
        buf += data
        messages: list[list[Any]] = []
        at = 0
        while len(buf) - at >= HEADER.size:
            (size,) = HEADER.unpack_from(buf, at)
            if size > self.max_frame_bytes:
                raise LinkBroken(f"a {size}-byte frame exceeds the link's {self.max_frame_bytes}-byte limit")
            end = at + HEADER.size + size
            if len(buf) < end:
                break
            try:
                message = msgpack.unpackb(memoryview(buf)[at + HEADER.size : end], raw=False)
            except Exception as e:  # msgpack raises several types for malformed input
                raise LinkBroken(f"an unreadable frame ({type(e).__name__})") from None
            if not isinstance(message, list) or not message or not isinstance(message[0], int):
                raise LinkBroken("a frame that is not a message")
            messages.append(message)
            at = end
        if at:
            del buf[:at]
        return messages


# ---- values ----------------------------------------------------------------------------------------------------------
def pack_array(a: np.ndarray) -> list[Any]:
    a = np.ascontiguousarray(a)
    return [a.dtype.str, list(a.shape), a.tobytes()]


def unpack_array(v: list[Any]) -> np.ndarray:
    """A writable copy (the engine's prompt code hands these to torch, which wants writable arrays)."""
    dtype, shape, data = v
    return np.frombuffer(data, dtype=np.dtype(dtype)).reshape(shape).copy()


def pack_voice(voice: Voice) -> list[Any]:
    return [[text, pack_array(codes)] for text, codes in voice.references]


def unpack_voice(v: list[Any]) -> Voice:
    return Voice(tuple((str(text), unpack_array(codes)) for text, codes in v))


def pack_settings(s: SynthesisSettings) -> dict[str, Any]:
    out = {f.name: getattr(s, f.name) for f in dataclasses.fields(s)}
    out["latency"] = s.latency.value
    return out


def unpack_settings(v: dict[str, Any]) -> SynthesisSettings:
    known = {f.name for f in dataclasses.fields(SynthesisSettings)}
    values = {k: val for k, val in v.items() if k in known}
    values["latency"] = Latency(values.get("latency", Latency.BALANCED.value))
    return SynthesisSettings(**values)


def pack_info(info: ModelInfo | None) -> dict[str, Any] | None:
    return None if info is None else dataclasses.asdict(info)


def unpack_info(v: dict[str, Any] | None) -> ModelInfo | None:
    if v is None:
        return None
    return ModelInfo(**{**v, "sampling": SamplingDefaults(**v["sampling"])})


# ---- errors ----------------------------------------------------------------------------------------------------------
ERRORS: dict[str, type[errors.FishgateError]] = {
    name: cls for name, cls in vars(errors).items() if isinstance(cls, type) and issubclass(cls, errors.FishgateError)
}
INTERNAL_MESSAGE = "internal error"


def failure(call_id: int, exc: BaseException) -> list[Any]:
    """A failed call's answer: the error's class and message for the engine's own errors, else "internal error"
    (the engine logs those; their text never leaves it)."""
    if isinstance(exc, errors.FishgateError) and ERRORS.get(type(exc).__name__) is type(exc):
        return [Op.FAILURE, call_id, type(exc).__name__, str(exc)]
    return [Op.FAILURE, call_id, "EngineFault", INTERNAL_MESSAGE]


def error_of(name: str, message: str) -> errors.FishgateError:
    cls = ERRORS.get(name)
    return cls(message) if cls is not None else errors.EngineFault(INTERNAL_MESSAGE)


# ---- session events --------------------------------------------------------------------------------------------------
def event_frame(sid: int, ev: Event) -> bytes:
    if isinstance(ev, AudioChunk):
        return frame([Op.AUDIO, sid, ev.utterance, np.ascontiguousarray(ev.pcm, dtype=np.float32).tobytes()])
    if isinstance(ev, SegmentDone):
        return frame([Op.SEGMENT, sid, ev.utterance, ev.text, ev.frames, ev.ended_by, pack_array(ev.codes)])
    if isinstance(ev, UtteranceDone):
        return frame([Op.DONE, sid, ev.utterance, ev.reason, ev.audio_samples])
    if isinstance(ev, Cancelled):
        return frame([Op.CANCELLED, sid, ev.utterance])
    return frame([Op.ERROR, sid, ev.code, ev.message, ev.utterance, ev.fatal])


def event_of(message: list[Any]) -> tuple[int, Event]:
    """An event message → (session id, event). Audio comes as a read-only view of the frame's bytes."""
    op, sid, *rest = message
    if op == Op.AUDIO:
        utt, pcm = rest
        return sid, AudioChunk(utt, np.frombuffer(pcm, dtype=np.float32))
    if op == Op.SEGMENT:
        utt, text, frames, ended_by, codes = rest
        return sid, SegmentDone(utt, text, frames, ended_by, unpack_array(codes))
    if op == Op.DONE:
        return sid, UtteranceDone(*rest)
    if op == Op.CANCELLED:
        return sid, Cancelled(*rest)
    if op == Op.ERROR:
        return sid, SessionError(*rest)
    raise LinkBroken(f"unknown session event {op!r}")


EVENT_OPS = frozenset((Op.AUDIO, Op.SEGMENT, Op.DONE, Op.CANCELLED, Op.ERROR))

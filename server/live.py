"""`/v1/tts/live`: one WebSocket = one engine session, driven by the Sans-I/O protocol in `live_protocol`.

States: AWAIT_START → STREAMING (text / flush / cancel) → STOPPING (after `stop`: the rest of the audio,
`finish(stop)`, close 1000). Two tasks per connection: the receiver (client frames, segmenter idle timer, idle and
wall-time limits) and the sender (engine events → encoded audio frames). A send blocked longer than
`send_timeout_s` (a client that does not read) closes the socket; a vanished client closes the engine session,
which frees its decode row before the next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
from collections.abc import MutableMapping
from dataclasses import dataclass, field
from typing import Any

from starlette.websockets import WebSocket, WebSocketDisconnect

from streaming.audio_out import AudioOutput, validate_output_format
from streaming.segmenter import Segmenter
from streaming.session import (
    AudioChunk,
    Cancelled,
    SegmentDone,
    Session,
    SessionError,
    UtteranceDone,
)

from . import live_protocol as proto
from .gateway import Gateway
from .http_common import encode_audio, off_loop_if_large
from .params import TTSParams, normalize_text, parse_tts_request
from .wire import (
    CLOSE_INTERNAL,
    CLOSE_NORMAL,
    CLOSE_POLICY,
    CLOSE_SERVICE_RESTART,
    CLOSE_TRY_AGAIN_LATER,
    ProtocolViolation,
    is_known,
    to_wire,
)

log = logging.getLogger(__name__)


class LiveState(enum.Enum):
    AWAIT_START = "await_start"
    STREAMING = "streaming"
    STOPPING = "stopping"
    CLOSED = "closed"


@dataclass
class _Utterance:
    output: AudioOutput
    first_text_s: float | None = None
    first_audio_sent: bool = False


@dataclass
class LiveConnection:
    ws: WebSocket
    gw: Gateway
    encoding: proto.Encoding = proto.Encoding.MSGPACK
    state: LiveState = LiveState.AWAIT_START
    params: TTSParams | None = None
    session: Session | None = None
    segmenter: Segmenter | None = None
    utterances: dict[int, _Utterance] = field(default_factory=dict)
    send_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    opened_s: float = field(default_factory=time.monotonic)
    last_client_s: float = field(default_factory=time.monotonic)
    close_code: int | None = None
    stopping_utterance: int | None = None  # the utterance `stop` ended (a later `cancel` still barges into it)
    _sender: asyncio.Task | None = None

    # ---- entry ----------------------------------------------------------------------------------------------------
    async def run(self) -> None:
        try:
            await self._receive_loop()
        except ProtocolViolation as e:
            await self._fail(e.code, e.message, e.close_code)
        except WebSocketDisconnect:
            pass
        except Exception as e:  # never leak internal text; log with the session id
            log.exception("live session %s: unexpected error", self.session.id if self.session else "-")
            w = to_wire(e)
            await self._fail(w.code, w.message, CLOSE_INTERNAL if not is_known(e) else CLOSE_POLICY)
        finally:
            if self.session is not None:
                self.session.close()
            sender = self._sender
            if sender is not None:
                if not sender.done():
                    sender.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await sender  # also takes what it ended with, so nothing is logged as never retrieved
            self.state = LiveState.CLOSED
            if self.session is not None:
                self.gw.metrics.live_sessions.dec()

    # ---- receiving ------------------------------------------------------------------------------------------------
    async def _receive_loop(self) -> None:
        first = True
        while self.state is not LiveState.CLOSED and not self._sender_done():
            message = await self._receive_with_deadline()
            # None: a deadline passed (segmenter idle cut, a limit closed the socket), or the sender ended
            if message is None:
                continue
            if message["type"] == "websocket.disconnect":
                raise WebSocketDisconnect(message.get("code", 1000))
            self.last_client_s = time.monotonic()
            if first:
                self.encoding = proto.encoding_of_first_frame(message)
                first = False
            try:
                size = len(message.get("bytes") or message.get("text") or "")
                event = await off_loop_if_large(
                    size, proto.decode_frame, message, self.encoding, self.gw.settings.max_frame_bytes
                )
                await self._handle(event)
            except proto.RecoverableError as e:
                await self._send(proto.error(e.code, e.message))
            except ProtocolViolation:
                raise
            except Exception as e:
                if not is_known(e):
                    raise
                w = to_wire(e)
                if w.code == "overloaded":
                    await self._fail(w.code, w.message, CLOSE_TRY_AGAIN_LATER)
                    break
                await self._send(proto.error(w.code, w.message))
            if self.session is not None and self._sender is None:
                self._sender = asyncio.create_task(self._send_loop())
        sender = self._sender
        if sender is not None and sender.done() and not sender.cancelled():
            sender.result()  # what ended the sender ends the connection (a send timeout is a WebSocketDisconnect)

    def _sender_done(self) -> bool:
        return self._sender is not None and self._sender.done()

    async def _receive_with_deadline(self) -> MutableMapping[str, Any] | None:
        now = time.monotonic()
        s = self.gw.settings
        deadlines = [self.last_client_s + s.idle_timeout_s, self.opened_s + s.max_session_s]
        seg_deadline = self.segmenter.deadline_s() if self.segmenter is not None else None
        if seg_deadline is not None:
            deadlines.append(seg_deadline)
        if self.gw.draining.is_set() and self.state is LiveState.AWAIT_START:
            await self._fail("shutting_down", "the server is shutting down; reconnect", CLOSE_SERVICE_RESTART)
            return None
        timeout = max(0.0, min(deadlines) - now)
        try:
            return await self._receive_unless_sender_ends(timeout)
        except TimeoutError:
            now = time.monotonic()
            if now >= self.opened_s + s.max_session_s:
                await self._fail(
                    "session_too_long", f"sessions are capped at {s.max_session_s:.0f} s; reconnect", CLOSE_POLICY
                )
            elif now >= self.last_client_s + s.idle_timeout_s and not self._busy():
                await self._fail("idle_timeout", f"no message for {s.idle_timeout_s:.0f} s; reconnect", CLOSE_NORMAL)
            elif self.segmenter is not None:
                self._speak(self.segmenter.poll(now))
                if now >= self.last_client_s + s.idle_timeout_s:
                    self.last_client_s = now  # busy speaking: the idle clock restarts
            return None

    async def _receive_unless_sender_ends(self, timeout: float) -> MutableMapping[str, Any] | None:
        """The client's next message, or None as soon as the sender task ends (it closed the connection, or failed):
        a client that stopped reading sends nothing either, and its session must not wait for its socket to go."""
        sender = self._sender
        if sender is None:
            return await asyncio.wait_for(self.ws.receive(), timeout)
        receive = asyncio.ensure_future(self.ws.receive())
        try:
            done, _ = await asyncio.wait((receive, sender), timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            receive.cancel()
        if receive in done:
            return receive.result()
        if sender in done:
            return None
        raise TimeoutError

    def _busy(self) -> bool:
        return (self.session is not None and self.session.undelivered_samples > 0) or self.state is LiveState.STOPPING

    async def _handle(self, event: proto.ClientEvent) -> None:
        kind = event.kind
        if self.state is LiveState.AWAIT_START:
            if kind != "start":
                raise proto.RecoverableError("not_started", f"send start first (got {kind!r} before start)")
            await self._start(event.payload["request"])
            return
        if kind == "start":
            raise proto.RecoverableError(
                "already_started", "this session has started; send text, flush, cancel or stop"
            )
        assert self.session is not None and self.segmenter is not None and self.params is not None
        if self.state is LiveState.STOPPING:
            if kind == "cancel" and self.stopping_utterance is not None:
                self.session.cancel(self.stopping_utterance)  # barge-in while the last audio is still coming
                return
            raise proto.RecoverableError("stopping", f"stop was received; {kind!r} is ignored while audio finishes")
        if kind == "text":
            text = event.payload["text"]
            if len(text) > self.gw.settings.max_text_chars:
                raise proto.RecoverableError(
                    "text_too_long",
                    f"a text event holds at most {self.gw.settings.max_text_chars} characters (--max-text-chars); "
                    "send it in parts",
                )
            self.session.check_room(len(text))  # whole, before the segmenter splits it: no part of it is queued
            self._note_text()
            self._speak(self.segmenter.feed(normalize_text(text) if self.params.normalize else text, time.monotonic()))
        elif kind == "flush":
            self._speak(self.segmenter.flush())
        elif kind == "cancel":
            self.session.cancel()
            self.segmenter = Segmenter(self.params.segmenter)
        elif kind == "stop":
            self._speak(self.segmenter.finish())
            self.stopping_utterance = self.session.end_utterance()
            self.state = LiveState.STOPPING

    async def _start(self, request: Any) -> None:
        gw = self.gw
        params = parse_tts_request(request, max_text_chars=gw.settings.max_text_chars, sampling=gw.sampling_defaults())
        validate_output_format(params.output)
        gw.check_rate(self.ws)
        voice = await gw.voices.resolve(params.reference_id, [(r.text, r.audio) for r in params.references])
        self.session = await gw.engine.admit(voice, params.settings)
        gw.metrics.live_sessions.inc()
        self.params = params
        self.segmenter = Segmenter(params.segmenter)
        self.state = LiveState.STREAMING
        info = gw.engine.info
        await self._send(
            {
                "event": "started",
                "session": self.session.id,
                "model": gw.served_model_name(self.ws),
                "untrained_model": bool(info and info.untrained),
                "format": params.output.format,
                "sample_rate": params.output.sample_rate_hz,
            }
        )
        if params.text:
            self._note_text()
            text = normalize_text(params.text) if params.normalize else params.text
            self._speak(self.segmenter.feed(text, time.monotonic()))

    def _note_text(self) -> None:
        assert self.session is not None and self.params is not None
        utt = self.utterances.get(self.session.utterance)
        if utt is None:
            utt = self.utterances[self.session.utterance] = _Utterance(AudioOutput(self.params.output))
        if utt.first_text_s is None:
            utt.first_text_s = time.monotonic()

    def _speak(self, segments: list) -> None:
        assert self.session is not None
        for seg in segments:
            if seg.spoken_text:
                self._note_text()
                self.session.speak(seg.spoken_text)

    # ---- sending --------------------------------------------------------------------------------------------------
    async def _send_loop(self) -> None:
        assert self.session is not None and self.params is not None
        session = self.session
        while True:
            ev = await session.next_event()
            if isinstance(ev, AudioChunk):
                utt = self.utterances.get(ev.utterance)
                if utt is None:  # audio of an utterance the client cancelled
                    continue
                data = await encode_audio(utt.output, ev.pcm)
                if data:
                    await self._send(proto.audio(data))
                    if not utt.first_audio_sent:
                        utt.first_audio_sent = True
                        await self._timing(ev.utterance, utt)
            elif isinstance(ev, SegmentDone):
                continue
            elif isinstance(ev, Cancelled):
                self.utterances.pop(ev.utterance, None)
                await self._send({"event": "cancelled"})
                if self.state is LiveState.STOPPING and ev.utterance == self.stopping_utterance:
                    await self._send(proto.finish("stop"))  # the client had said stop: nothing more will come
                    await self._close(CLOSE_NORMAL)
                    return
            elif isinstance(ev, UtteranceDone):
                utt = self.utterances.pop(ev.utterance, None)
                tail = utt.output.finish() if utt is not None else b""
                if tail:
                    await self._send(proto.audio(tail))
                if ev.reason == "max_audio":
                    await self._fail("max_audio", "the utterance reached the audio length cap", CLOSE_POLICY)
                    return
                if self.state is LiveState.STOPPING:
                    await self._send(proto.finish("error" if ev.reason == "error" else "stop"))
                    await self._close(CLOSE_NORMAL)
                    return
            elif isinstance(ev, SessionError):
                await self._send(proto.error(ev.code, ev.message))
                if ev.fatal:
                    await self._send(proto.finish("error"))
                    await self._close(CLOSE_POLICY)
                    return

    async def _timing(self, utterance: int, utt: _Utterance) -> None:
        if utt.first_text_s is None:
            return
        ms = (time.monotonic() - utt.first_text_s) * 1000
        self.gw.metrics.first_audio.observe(ms / 1000)
        await self._send({"event": "timing", "utterance": utterance, "first_audio_ms": round(ms, 1)})

    async def _send(self, event: dict[str, Any]) -> None:
        if self.state is LiveState.CLOSED:
            return
        message = proto.encode_event(event, self.encoding)
        async with self.send_lock:
            if self.state is LiveState.CLOSED:  # closed while this send waited for the lock (a send timeout)
                return
            try:
                await asyncio.wait_for(self.ws.send(message), self.gw.settings.send_timeout_s)
            except TimeoutError:
                log.warning("live session %s: client not reading; closing", self.session.id if self.session else "-")
                if self.session is not None:
                    self.session.close()  # free the slot now, not once the close frame gets through
                self.state = LiveState.CLOSED
                await self._close_socket(CLOSE_POLICY)
                raise WebSocketDisconnect(CLOSE_POLICY) from None

    async def _fail(self, code: str, message: str, close_code: int) -> None:
        self.gw.metrics.errors.labels(code=code).inc()
        with contextlib.suppress(Exception):
            await self._send(proto.error(code, message))
            await self._send(proto.finish("error"))
        await self._close(close_code)

    async def _close(self, code: int) -> None:
        if self.state is not LiveState.CLOSED:
            self.state = LiveState.CLOSED
            self.close_code = code
            await self._close_socket(code)

    async def _close_socket(self, code: int) -> None:
        """Send the close frame, bounded: a client that stopped reading never takes it."""
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.ws.close(code), self.gw.settings.send_timeout_s)

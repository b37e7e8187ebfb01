"""`/v1/tts/live`: one WebSocket carries a conversation of turns, driven by the Sans-I/O protocol in `live_protocol`.

A turn is `start` … `stop` … `finish`, and owns one engine session from its `start` to its `finish`. States:
AWAIT_START (between turns: no engine session, nothing counted against --max-sessions) → STREAMING (text / flush /
cancel) → STOPPING (after `stop`: the rest of the audio, then `finish(stop)`) → AWAIT_START again, for the next
`start` on the same socket (LiveKit's pooled sockets; one-utterance clients simply close).

A turn that cannot be served ends at once in `error` (naming the fix) then `finish(error)`, the only failure signal
Fish's clients act on; the socket stays open for a new `start`, and what the client still sends for the failed turn
is dropped (a `flush` answers once more with `error` + `finish(error)`, so a client that never restarts, like
pipecat, hears of every utterance it loses). The connection ends on the client's close, the idle limit, the
optional wall-time cap, shutdown, or a protocol violation, each with its close code and a reason (docs/API.md).

Two tasks per connection: the receiver (client frames, segmenter idle timer, limits) and, during a turn, the sender
(engine events → encoded audio frames). A send blocked longer than `send_timeout_s` (a client that does not read)
closes the socket; a vanished client closes the engine session, which frees its decode row before the next step.
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
from .params import TTSParams, parse_tts_request
from .wire import (
    CLOSE_INTERNAL,
    CLOSE_NORMAL,
    CLOSE_POLICY,
    CLOSE_SERVICE_RESTART,
    ProtocolViolation,
    is_known,
    to_wire,
)

log = logging.getLogger(__name__)

CANCEL_RETRY_S = 0.05  # an abandoned turn's sender is cancelled again if it has not ended after this
MAX_CLOSE_REASON_BYTES = 123  # RFC 6455: a close frame's payload is 125 bytes, 2 of them the code


async def _cancel_until_done(task: asyncio.Task) -> None:
    """Cancel `task` and wait for it to end, cancelling again if a library swallowed the cancel (Python 3.11's
    wait_for does when the awaited call completes at the same moment)."""
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=CANCEL_RETRY_S)


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


class _TurnFailed(Exception):
    """A turn that cannot be served: `error` + `finish(error)`, the socket stays open."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass
class LiveConnection:
    ws: WebSocket
    gw: Gateway
    encoding: proto.Encoding = proto.Encoding.MSGPACK
    state: LiveState = LiveState.AWAIT_START
    params: TTSParams | None = None
    session: Session | None = None  # the current turn's engine session (None between turns)
    segmenter: Segmenter | None = None
    utterances: dict[int, _Utterance] = field(default_factory=dict)
    send_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    opened_s: float = field(default_factory=time.monotonic)
    last_client_s: float = field(default_factory=time.monotonic)
    close_code: int | None = None
    stopping_utterance: int | None = None  # the utterance `stop` ended (a later `cancel` still barges into it)
    turns: int = 0  # turns started on this connection
    failed_turn: bool = False  # the last `start` failed: the rest of that turn's messages are dropped
    # an utterance of the open turn failed (its finish(error) went out): its remaining text is dropped until the
    # client's next flush, stop or start, so one failure gets one finish
    failed_utterance: int | None = None
    warned: bool = False  # a failure is logged at WARNING once per connection
    _sender: asyncio.Task | None = None

    # ---- entry ----------------------------------------------------------------------------------------------------
    async def run(self) -> None:
        self.gw.metrics.live_connections.inc()
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
            sender = self._sender
            if sender is not None:
                await _cancel_until_done(sender)
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await sender  # also takes what it ended with, so nothing is logged as never retrieved
            self._end_turn()
            self.state = LiveState.CLOSED
            self.gw.metrics.live_connections.dec()

    # ---- receiving ------------------------------------------------------------------------------------------------
    async def _receive_loop(self) -> None:
        first = True
        while self.state is not LiveState.CLOSED:
            self._reap_sender()
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
            except (proto.BadStart, _TurnFailed) as e:
                await self._fail_turn(e.code, e.message)
            except proto.RecoverableError as e:
                await self._send(proto.error(e.code, e.message))
            except ProtocolViolation:
                raise
            except Exception as e:
                if not is_known(e):
                    raise
                w = to_wire(e)
                await self._fail_turn(w.code, w.message)
            if self.session is not None and self._sender is None:
                self._sender = asyncio.create_task(self._send_loop(self.session))
        self._reap_sender()

    def _reap_sender(self) -> None:
        """A sender that ended: a turn that finished (its session is already closed) or what ended the connection
        (a send timeout is a WebSocketDisconnect), raised here."""
        sender = self._sender
        if sender is None or not sender.done():
            return
        self._sender = None
        if not sender.cancelled():
            sender.result()

    async def _receive_with_deadline(self) -> MutableMapping[str, Any] | None:
        now = time.monotonic()
        s = self.gw.settings
        deadlines = [self.last_client_s + s.idle_timeout_s]
        if s.max_session_s:
            deadlines.append(self.opened_s + s.max_session_s)
        seg_deadline = self.segmenter.deadline_s() if self.segmenter is not None else None
        if seg_deadline is not None:
            deadlines.append(seg_deadline)
        if self.gw.draining.is_set() and self.state is LiveState.AWAIT_START and self._sender is None:
            await self._fail("shutting_down", "the server is shutting down; reconnect", CLOSE_SERVICE_RESTART)
            return None
        timeout = max(0.0, min(deadlines) - now)
        try:
            return await self._receive_unless_sender_ends(timeout)
        except TimeoutError:
            now = time.monotonic()
            if s.max_session_s and now >= self.opened_s + s.max_session_s:
                await self._fail(
                    "session_too_long",
                    f"connections are capped at {s.max_session_s:.0f} s (--max-session-s); reconnect",
                    CLOSE_POLICY,
                )
            elif now >= self.last_client_s + s.idle_timeout_s and not self._busy():
                message = f"no message for {s.idle_timeout_s:.0f} s (--idle-timeout-s); reconnect"
                if self.state is LiveState.AWAIT_START:  # between turns: nothing in flight, nothing to finish
                    await self._close(CLOSE_NORMAL, f"idle_timeout: {message}")
                else:
                    await self._fail("idle_timeout", message, CLOSE_NORMAL)
            elif self.segmenter is not None:
                self._speak(self.segmenter.poll(now))
                if now >= self.last_client_s + s.idle_timeout_s:
                    self.last_client_s = now  # busy speaking: the idle clock restarts
            return None

    async def _receive_unless_sender_ends(self, timeout: float) -> MutableMapping[str, Any] | None:
        """The client's next message, or None as soon as the sender task ends (its turn finished, it closed the
        connection, or it failed): a client that stopped reading sends nothing either, and its session must not wait
        for its socket to go. Between turns, None as soon as the gateway starts draining."""
        sender: asyncio.Future[Any] | None = self._sender
        if sender is None:
            if self.gw.draining.is_set() or self.state is not LiveState.AWAIT_START:
                return await asyncio.wait_for(self.ws.receive(), timeout)
            # between turns: a drain (SIGTERM, a rolling upgrade) closes this socket with its reason at once, not
            # when the server stops (uvicorn's close carries no reason)
            sender = asyncio.ensure_future(self.gw.draining.wait())
        receive = asyncio.ensure_future(self.ws.receive())
        try:
            done, _ = await asyncio.wait((receive, sender), timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            receive.cancel()
            if sender is not self._sender:
                sender.cancel()
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
            if kind == "start":
                await self._await_last_turn()
                self.failed_turn = False
                await self._start(event.payload["request"])
            elif kind == "cancel":
                pass  # a barge-in that crossed the turn's finish: nothing is left to cancel
            elif self.failed_turn:
                if kind == "flush":  # a client that never restarts (pipecat) hears of each utterance it loses; the
                    # failure itself was counted and logged once already
                    await self._send(proto.error("not_started", "the last start failed (see the error before it)"))
                    await self._send(proto.finish("error"))
            else:
                raise proto.RecoverableError("not_started", f"send start first (got {kind!r} before start)")
            return
        if self.failed_utterance is not None and self.state is LiveState.STREAMING:
            if kind in ("start", "stop"):  # the client ends the turn whose finish(error) it has had
                await self._abandon_turn()
                if kind == "start":
                    await self._handle(event)
                return
            if kind == "text":
                return  # the rest of the failed utterance
            self.failed_utterance = None  # flush or cancel: the failed utterance is over, speaking goes on
            if kind == "flush":
                return
        if kind == "start":
            raise proto.RecoverableError(
                "already_started", "this turn has started; send text, flush, cancel or stop, and start after finish"
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
                raise _TurnFailed(
                    "text_too_long",
                    f"a text event holds at most {self.gw.settings.max_text_chars} characters (--max-text-chars); "
                    "send it in parts",
                )
            self.session.check_room(len(text))  # whole, before the segmenter splits it: no part of it is queued
            self._note_text()
            self._speak(self.segmenter.feed(text, time.monotonic()))
        elif kind == "flush":
            self._speak(self.segmenter.flush())
        elif kind == "cancel":
            self.session.cancel()
            self.segmenter = Segmenter(self.params.segmenter)
        elif kind == "stop":
            self._speak(self.segmenter.finish())
            self.stopping_utterance = self.session.end_utterance()
            self.state = LiveState.STOPPING

    def _drop_utterance(self) -> None:
        """The current utterance cannot be served whole: stop it (its `finish(error)` follows), keep the session."""
        assert self.session is not None and self.params is not None
        utt = self.session.cancel()
        self.utterances.pop(utt, None)
        self.segmenter = Segmenter(self.params.segmenter)
        self.failed_utterance = utt

    async def _abandon_turn(self) -> None:
        """End the open turn without another `finish`: the client has had its finish(error)."""
        sender = self._sender
        self._end_turn()
        if sender is not None:
            await _cancel_until_done(sender)
        self._reap_sender()

    async def _await_last_turn(self) -> None:
        """A `start` that crossed the last turn's sender on its way out (it sent `finish` and is closing)."""
        sender = self._sender
        if sender is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait_for(asyncio.shield(sender), self.gw.settings.send_timeout_s)
            self._reap_sender()

    async def _start(self, request: Any) -> None:
        gw = self.gw
        if gw.draining.is_set():
            await self._fail("shutting_down", "the server is shutting down; reconnect", CLOSE_SERVICE_RESTART)
            return
        params = parse_tts_request(request, max_text_chars=gw.settings.max_text_chars, sampling=gw.sampling_defaults())
        validate_output_format(params.output)
        gw.check_rate(self.ws)
        voice = await gw.voices.resolve(params.reference_id, [(r.text, r.audio) for r in params.references])
        self.session = await gw.engine.admit(voice, params.settings)
        gw.metrics.live_sessions.inc()
        self.turns += 1
        self.params = params
        self.segmenter = Segmenter(params.segmenter)
        self.state = LiveState.STREAMING
        info = gw.engine.info
        await self._send(
            {
                "event": "started",
                "session": self.session.id,
                "turn": self.turns,
                "model": gw.served_model_name(self.ws),
                "untrained_model": bool(info and info.untrained),
                "format": params.output.format,
                "sample_rate": params.output.sample_rate_hz,
            }
        )
        if params.text:
            self._note_text()
            self._speak(self.segmenter.feed(params.text, time.monotonic()))

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

    def _end_turn(self) -> None:
        """The turn is over: its engine session closes (its row and its --max-sessions place are free at once)."""
        if self.session is None:
            return
        self.session.close()
        self.gw.metrics.live_sessions.dec()
        self.session = None
        self.params = None
        self.segmenter = None
        self.utterances.clear()
        self.stopping_utterance = None
        self.failed_utterance = None
        if self.state is not LiveState.CLOSED:
            self.state = LiveState.AWAIT_START

    # ---- sending --------------------------------------------------------------------------------------------------
    async def _send_loop(self, session: Session) -> None:
        """The turn's engine events → frames, until its `finish` (then the turn ends and this task returns)."""
        assert self.params is not None
        while True:
            ev = await session.next_event()
            if isinstance(ev, AudioChunk):
                utt = self.utterances.get(ev.utterance)
                if utt is None:  # audio of an utterance the client cancelled
                    continue
                data = await encode_audio(utt.output, ev.pcm)
                for event in proto.audio_events(data):
                    await self._send(event)
                if data and not utt.first_audio_sent:
                    utt.first_audio_sent = True
                    await self._timing(ev.utterance, utt)
            elif isinstance(ev, SegmentDone):
                continue
            elif isinstance(ev, Cancelled):
                self.utterances.pop(ev.utterance, None)
                await self._send({"event": "cancelled"})
                if self.state is LiveState.STOPPING and ev.utterance == self.stopping_utterance:
                    await self._finish_turn("stop")  # the client had said stop: nothing more will come
                    return
            elif isinstance(ev, UtteranceDone):
                utt = self.utterances.pop(ev.utterance, None)
                tail = utt.output.finish() if utt is not None else b""
                for event in proto.audio_events(tail):
                    await self._send(event)
                if ev.reason == "max_audio":
                    self._count_failure("max_audio", "the utterance reached the audio length cap")
                    await self._send(proto.error("max_audio", "the utterance reached the audio length cap"))
                stopped = self.state is LiveState.STOPPING and ev.utterance == self.stopping_utterance
                if stopped or ev.reason == "max_audio":
                    await self._finish_turn("stop" if ev.reason == "stop" else "error")
                    if stopped:
                        return
            elif isinstance(ev, SessionError):
                if (
                    not ev.fatal
                    and self.failed_utterance is not None
                    and ev.utterance is not None
                    and (ev.utterance >= self.failed_utterance)
                ):
                    continue  # more of an utterance whose failure went out already
                self._count_failure(ev.code, ev.message)
                await self._send(proto.error(ev.code, ev.message))
                if ev.fatal:  # the engine closed the session: the turn is over
                    await self._finish_turn("error")
                    return
                if self.state is LiveState.STREAMING and ev.utterance == session.utterance:
                    self._drop_utterance()  # the utterance failed: finish(error) now, not after a stop that
                    await self._send(proto.finish("error"))  # a client like pipecat never sends

    async def _finish_turn(self, reason: str) -> None:
        self._end_turn()  # first: a client that reads the finish may send its next start at once
        await self._send(proto.finish(reason))
        if self.gw.draining.is_set():
            await self._close(CLOSE_SERVICE_RESTART, "shutting_down: the server is shutting down; reconnect")

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
                # asyncio.timeout, not wait_for: on Python 3.11 wait_for swallows a cancel that lands as the send
                # completes, and the cancelled sender would then wait for events forever
                async with asyncio.timeout(self.gw.settings.send_timeout_s):
                    await self.ws.send(message)
            except TimeoutError:
                log.warning("live session %s: client not reading; closing", self.session.id if self.session else "-")
                if self.session is not None:
                    self.session.close()  # free the slot now, not once the close frame gets through
                self.state = LiveState.CLOSED
                await self._close_socket(CLOSE_POLICY, "send_timeout: the client stopped reading")
                raise WebSocketDisconnect(CLOSE_POLICY) from None

    def _count_failure(self, code: str, message: str) -> None:
        """Counted by code in /metrics; logged at WARNING once per connection (a client retrying in a loop would
        otherwise flood the log)."""
        self.gw.metrics.errors.labels(code=code).inc()
        if not self.warned:
            self.warned = True
            log.warning("live connection (turn %d): %s: %s", self.turns, code, message)

    async def _fail_turn(self, code: str, message: str) -> None:
        """This turn or its utterance cannot be served: `error` naming the fix, then `finish(error)`; the socket
        stays open. Mid-turn, the utterance is dropped with the rest of its text (one failure, one finish)."""
        if self.state is LiveState.STREAMING and self.failed_utterance is None:
            self._drop_utterance()
        self._count_failure(code, message)
        await self._send(proto.error(code, message))
        await self._send(proto.finish("error"))
        if self.state is LiveState.AWAIT_START:
            self.failed_turn = True  # what the client still sends for this turn is dropped until its next start

    async def _fail(self, code: str, message: str, close_code: int) -> None:
        """The connection ends: `error` + `finish(error)`, then the close with `code: message` as its reason."""
        self._count_failure(code, message)
        with contextlib.suppress(Exception):
            await self._send(proto.error(code, message))
            await self._send(proto.finish("error"))
        await self._close(close_code, f"{code}: {message}")

    async def _close(self, code: int, reason: str = "") -> None:
        if self.state is not LiveState.CLOSED:
            self.state = LiveState.CLOSED
            self.close_code = code
            await self._close_socket(code, reason)

    async def _close_socket(self, code: int, reason: str = "") -> None:
        """Send the close frame, bounded: a client that stopped reading never takes it. The reason is cut to the
        123 bytes a close frame can carry."""
        reason = reason.encode()[:MAX_CLOSE_REASON_BYTES].decode(errors="ignore")
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.ws.close(code, reason), self.gw.settings.send_timeout_s)

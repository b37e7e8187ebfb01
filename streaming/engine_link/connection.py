"""One connection from a gateway to the resident engine (`Link`): its frames, its calls in flight, the sessions it
carries (`RemoteSession`, a Session whose commands travel the link), and their end when the link is lost.

A call's answer is turned into its value as it arrives, before any later message is read: an admitted session is
registered before its first event. Audio the server reads from a session is acknowledged to the engine, batched per
loop pass. When the link ends, its calls fail with EngineUnavailable and every session it carried gets a fatal
`engine_unavailable` SessionError at once. Knows nothing about reconnecting (streaming.engine_link.client).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..engine_api import EngineState, ModelInfo
from ..errors import EngineUnavailable, Overloaded
from ..session import Cancel, Close, EndUtterance, Event, Session, SessionError, Speak
from .auth import REFUSED_FIX
from .protocol import (
    EVENT_OPS,
    PROTOCOL_VERSION,
    FrameDecoder,
    LinkBroken,
    LinkRefused,
    Op,
    error_of,
    event_of,
    frame,
    unpack_info,
)

log = logging.getLogger(__name__)

LINK_SILENCE_S = 5.0  # 20 missed STATUS messages: the engine is hung or gone
LINK_READ_BYTES = 256 * 2**10
# Commands waiting in this gateway's send buffer beyond this (the engine reads nothing): new sessions and new text
# are refused (Overloaded) instead of queueing; cancels, closes and acknowledgements always go.
LINK_SEND_LIMIT_BYTES = 16 * 2**20
UNAVAILABLE_MESSAGE = "the speech engine is unavailable (restarting or stopped); retry in a moment"


@dataclass(eq=False)
class RemoteSession(Session):
    """A Session of a remote engine: commands go over the link (`_send`), events come from it (`deliver`). Whenever
    audio counts as read here (next_event, a cancel, audio of a dropped utterance) the engine hears of it."""

    _acknowledge: Callable[[int, int], None] | None = None  # (session id, samples read)

    async def next_event(self) -> Event:
        before = self.consumed_samples
        ev = await super().next_event()
        self._read(before)
        return ev

    def cancel(self, utterance: int | None = None) -> int:
        before = self.consumed_samples
        utt = super().cancel(utterance)
        self._read(before)
        return utt

    def deliver(self, ev: Event) -> None:
        before = self.consumed_samples
        super().deliver(ev)
        self._read(before)

    def _read(self, before: int) -> None:
        if self.consumed_samples != before and self._acknowledge is not None:
            self._acknowledge(self.id, self.consumed_samples - before)


@dataclass
class EngineView:
    """What this gateway last heard of the engine; kept across links (the model's description stays known)."""

    info: ModelInfo | None = None
    capacity: int = 0
    max_queued_chars: int = 50_000
    stats: dict[str, Any] | None = None
    gpu_memory_bytes: int = 0


class Link:
    """One connection to the engine: its frames, its calls in flight, its sessions."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, view: EngineView) -> None:
        self.reader = reader
        self.writer = writer
        self.view = view
        self.loop = asyncio.get_running_loop()
        self.welcomed = False
        self.lost: str | None = None  # why the link ended
        self.remote_state = EngineState.STARTING
        # the engine's headroom (Engine.headroom) as of its last STATUS, and this gateway's admits it cannot have
        # counted yet: those in flight, and those answered since that STATUS (a STATUS after a RESULT counts it)
        self.reported_headroom = 0
        self.admits_in_flight = 0
        self.admits_unreported = 0
        self.sessions: dict[int, RemoteSession] = {}
        # call id → (future, what turns the result into the value, what undoes a result nobody awaits any more)
        self.calls: dict[int, tuple[asyncio.Future[Any], Callable[[Any], Any], Callable[[Any], None] | None]] = {}
        self._call_ids = itertools.count(1)
        self._acks: collections.Counter[int] = collections.Counter()
        self._acks_scheduled = False

    @property
    def headroom(self) -> int:
        """The engine's last reported headroom less this gateway's admits it has not counted yet."""
        return max(0, self.reported_headroom - self.admits_in_flight - self.admits_unreported)

    # ---- sending -----------------------------------------------------------------------------------------------------
    def send(self, data: bytes) -> None:
        if self.lost is None and not self.writer.transport.is_closing():
            self.writer.write(data)

    def check_room(self) -> None:
        if self.writer.transport.get_write_buffer_size() > LINK_SEND_LIMIT_BYTES:
            raise Overloaded("the speech engine is not keeping up with this gateway's commands; retry later")

    async def call(
        self,
        method: str,
        args: list[Any],
        convert: Callable[[Any], Any] = lambda v: v,
        discard: Callable[[Any], None] | None = None,
    ) -> Any:
        """The engine's answer to `method(*args)`; its errors raise here. `convert` runs as the answer arrives (before
        any later message is read); `discard` undoes a converted answer whose caller is gone."""
        if self.lost is not None:
            raise EngineUnavailable(UNAVAILABLE_MESSAGE)
        call_id = next(self._call_ids)
        future: asyncio.Future[Any] = self.loop.create_future()
        self.calls[call_id] = (future, convert, discard)
        self.send(frame([Op.CALL, call_id, method, args]))
        return await future

    def command(self, cmd: object) -> None:
        """A session's command (its `_send`)."""
        if isinstance(cmd, Speak):
            self.check_room()
            self.send(frame([Op.SPEAK, cmd.session, cmd.utterance, cmd.text]))
        elif isinstance(cmd, EndUtterance):
            self.send(frame([Op.END, cmd.session, cmd.utterance]))
        elif isinstance(cmd, Cancel):
            self.send(frame([Op.CANCEL, cmd.session, cmd.utterance]))
        elif isinstance(cmd, Close):
            self.sessions.pop(cmd.session, None)
            self._acks.pop(cmd.session, None)
            self.send(frame([Op.CLOSE, cmd.session]))

    def acknowledge(self, sid: int, samples: int) -> None:
        self._acks[sid] += samples
        if not self._acks_scheduled:
            self._acks_scheduled = True
            self.loop.call_soon(self._send_acks)

    def _send_acks(self) -> None:
        self._acks_scheduled = False
        pairs = [x for sid, n in self._acks.items() if sid in self.sessions for x in (sid, n)]
        self._acks.clear()
        if pairs:
            self.send(frame([Op.ACK, pairs]))

    # ---- receiving ---------------------------------------------------------------------------------------------------
    async def serve(self) -> None:
        """Read until the link is lost; then `fail` it (why in `lost`)."""
        decoder = FrameDecoder()
        why = "the engine closed the connection"
        try:
            while True:
                async with asyncio.timeout(LINK_SILENCE_S):
                    data = await self.reader.read(LINK_READ_BYTES)
                if not data:
                    break
                for message in decoder.feed(data):
                    self._dispatch(message)
        except TimeoutError:
            why = f"the engine sent nothing for {LINK_SILENCE_S:.0f} s"
        except LinkRefused as e:
            why = str(e)
        except LinkBroken as e:
            why = f"the engine broke the link's protocol ({e})"
        except ConnectionError as e:
            why = f"the connection failed ({type(e).__name__})"
        except Exception as e:  # a message of the wrong shape: this link is done, the next one may be sound
            log.error("engine link: reading a message failed", exc_info=e)
            why = f"a message could not be read ({type(e).__name__})"
        finally:
            self.fail(why)

    def _dispatch(self, m: list[Any]) -> None:
        op = m[0]
        if op in EVENT_OPS:
            sid, ev = event_of(m)
            session = self.sessions.get(sid)
            if session is not None:
                session.count_posted(ev)
                session.deliver(ev)
        elif op == Op.STATUS:
            self.remote_state = EngineState(m[1])
            self.reported_headroom = int(m[2])
            self.admits_unreported = 0
        elif op in (Op.RESULT, Op.FAILURE):
            self._answered(m)
        elif op == Op.STATS:
            self.view.stats, self.view.gpu_memory_bytes = m[1], m[2]
        elif op == Op.INFO:
            self.view.info = unpack_info(m[1])
        elif op == Op.WELCOME:
            if m[1] != PROTOCOL_VERSION:
                raise LinkBroken(f"the engine speaks protocol {m[1]}, this gateway {PROTOCOL_VERSION}: run one "
                                 "fishgate version on both sides")  # fmt: skip
            _, _, info, capacity, max_queued_chars, state = m
            self.view.info = unpack_info(info) or self.view.info
            self.view.capacity, self.view.max_queued_chars = capacity, max_queued_chars
            self.remote_state = EngineState(state)
            self.welcomed = True
        elif op == Op.REFUSED:
            raise LinkRefused(f"{m[1]}: {REFUSED_FIX}")
        else:
            raise LinkBroken(f"unknown message {op!r}")

    def _answered(self, m: list[Any]) -> None:
        entry = self.calls.pop(m[1], None)
        if entry is None:
            return
        future, convert, discard = entry
        if m[0] == Op.FAILURE:
            if not future.done():
                future.set_exception(error_of(m[2], m[3]))
            return
        value = convert(m[2])
        if future.done():  # its caller was cancelled meanwhile
            if discard is not None:
                discard(value)
        else:
            future.set_result(value)

    def fail(self, why: str) -> None:
        """The link is gone: its calls fail and its sessions end (fatal `engine_unavailable`) at once."""
        if self.lost is not None:
            return
        self.lost = why
        self.writer.close()
        for future, _, _ in self.calls.values():
            if not future.done():
                future.set_exception(EngineUnavailable(UNAVAILABLE_MESSAGE))
        self.calls.clear()
        for session in list(self.sessions.values()):
            session.deliver(SessionError(EngineUnavailable.code, UNAVAILABLE_MESSAGE, None, fatal=True))
        self.sessions.clear()

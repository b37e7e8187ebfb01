"""The engine side of the link: one `Engine` served to any number of gateway connections (`EngineHost`), on a Unix
socket or TCP.

A connection is read only for its HELLO (small frames, HELLO_TIMEOUT_S) until it is welcomed: a wrong protocol version
gets a WELCOME that says so and the connection closes; a wrong or missing token (when the host has one) gets REFUSED and
closes. Each connection (`_Connection`) owns the sessions its gateway opened. The gateway's commands become the same
Session calls an in-process server makes, on this event loop; each session's events go back through one pump task. The
engine's back-pressure stays meaningful: a pump takes audio off its session without counting it read
(`consumed_samples`), and the gateway's ACKs count it once the gateway's clients have read it, so the worker's
`undelivered_samples` limit sees those clients. Pumps wait while their connection's send buffer is above
LINK_HIGH_WATER_BYTES. A connection that ends (its gateway exited or was killed) closes every one of its sessions at
once: their Close commands reach the worker together and its next turn frees their rows.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import socket
from typing import TYPE_CHECKING, Any

from ..errors import FishgateError, Overloaded, SessionClosed
from ..session import AudioChunk, Session, SessionError
from .auth import REFUSED_TOKEN, RefusalLog, token_matches
from .protocol import (
    HELLO_MAX_FRAME_BYTES,
    MAX_FRAME_BYTES,
    PROTOCOL_VERSION,
    STATS_INTERVAL_S,
    STATUS_INTERVAL_S,
    FrameDecoder,
    LinkBroken,
    Op,
    event_frame,
    failure,
    frame,
    pack_array,
    pack_info,
    unpack_array,
    unpack_settings,
    unpack_voice,
)
from .sockets import address_of, tune

if TYPE_CHECKING:
    from ..engine import Engine  # torch: loaded by the CLI once the socket path is claimed

log = logging.getLogger(__name__)

LINK_READ_BYTES = 256 * 2**10
# A pump waits (StreamWriter.drain) while its connection holds more unsent bytes than this: ~1.5 s of one stream's
# float32 audio, so a gateway that stops reading stops its sessions' pumps instead of growing this process's memory.
LINK_HIGH_WATER_BYTES = 2**20
# Calls (admits, reference encodes, text checks) one gateway may have in flight; more are refused (Overloaded).
MAX_CALLS_IN_FLIGHT = 1024
# A connection that has not sent its HELLO after this long is closed (a port scanner, a stuck peer).
HELLO_TIMEOUT_S = 10.0
_gateway_numbers = itertools.count(1)


class EngineHost:
    """Serves `engine` to gateways: `await start_serving(sock)` (or pass `handle` to asyncio's start_server /
    start_unix_server) and run `tick_forever` beside it. With a `token`, only gateways that send it are served."""

    def __init__(self, engine: Engine, token: str | None = None) -> None:
        self.engine = engine
        self.token = token or None
        self.refusals = RefusalLog()
        self.bound_address: str | None = None  # `unix:PATH` or `tcp:HOST:PORT` (the real port), once serving
        self._connections: set[_Connection] = set()
        self._info_sent = False

    @property
    def gateways(self) -> int:
        return len([c for c in self._connections if c.welcomed])

    async def start_serving(self, sock: socket.socket) -> asyncio.Server:
        """Serve gateways on the listening `sock` (Unix or TCP); `bound_address` then names it."""
        if sock.family == socket.AF_UNIX:
            server = await asyncio.start_unix_server(self.handle, sock=sock)
        else:
            server = await asyncio.start_server(self.handle, sock=sock)
        self.bound_address = address_of(sock)
        return server

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        tune(writer.get_extra_info("socket"))
        conn = _Connection(self, reader, writer)
        self._connections.add(conn)
        try:
            await conn.run()
        finally:
            self._connections.discard(conn)

    async def tick_forever(self) -> None:
        """Every gateway hears the engine's state each STATUS_INTERVAL_S (their liveness check and readiness), its
        counters each STATS_INTERVAL_S (their /metrics), and the model's description once it is loaded."""
        every = max(1, round(STATS_INTERVAL_S / STATUS_INTERVAL_S))
        for tick in itertools.count():
            await asyncio.sleep(STATUS_INTERVAL_S)
            try:
                self.broadcast_status()
                if tick % every == 0 and self._connections:
                    stats = {k: v for k, v in self.engine.stats().items() if isinstance(v, int | float | str)}
                    self.broadcast(frame([Op.STATS, stats, self.engine.gpu_memory_bytes()]))
            except Exception:  # a tick that fails must not silence the engine (gateways would give it up)
                log.exception("engine link: the status tick failed")

    def broadcast_status(self) -> None:
        engine = self.engine
        if not self._info_sent and engine.info is not None:
            self._info_sent = True
            self.broadcast(frame([Op.INFO, pack_info(engine.info)]))
        self.broadcast(self.status_frame())

    def status_frame(self) -> bytes:
        engine = self.engine
        return frame([Op.STATUS, engine.state.value, engine.headroom()])

    def broadcast(self, data: bytes) -> None:
        for conn in self._connections:
            if conn.welcomed:
                conn.send(data)

    def close_all(self) -> None:
        """End every connection (shutdown): each closes its sessions; gateways see the engine go."""
        for conn in list(self._connections):
            conn.close()


class _Connection:
    """One gateway's connection: its sessions, their pumps, its calls in flight."""

    def __init__(self, host: EngineHost, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.host = host
        self.engine = host.engine
        self.reader = reader
        self.writer = writer
        self.name = f"gateway-{next(_gateway_numbers)}"
        self.welcomed = False
        self.closed = False
        self.sessions: dict[int, Session] = {}
        self.pumps: dict[int, asyncio.Task[None]] = {}
        self.calls: set[asyncio.Task[None]] = set()
        writer.transport.set_write_buffer_limits(high=LINK_HIGH_WATER_BYTES)

    async def run(self) -> None:
        decoder = FrameDecoder(HELLO_MAX_FRAME_BYTES)  # raised once welcomed
        hello_by = asyncio.get_running_loop().time() + HELLO_TIMEOUT_S
        try:
            while not self.closed:
                async with asyncio.timeout_at(None if self.welcomed else hello_by):
                    data = await self.reader.read(LINK_READ_BYTES)
                if not data:
                    break
                for message in decoder.feed(data):
                    if not self.welcomed and message[0] != Op.HELLO:
                        raise LinkBroken(f"message {message[0]!r} before HELLO")
                    self._dispatch(message)
                    if self.closed:
                        break
                    if self.welcomed:
                        decoder.max_frame_bytes = MAX_FRAME_BYTES
        except (LinkBroken, LookupError, TypeError, ValueError) as e:  # a message of the wrong shape
            log.warning("%s broke the engine link's protocol (%s: %s); closing its connection", self.name,
                        type(e).__name__, e)  # fmt: skip
        except TimeoutError:
            log.warning("%s sent no HELLO within %.0f s; closing its connection", self.name, HELLO_TIMEOUT_S)
        except ConnectionError:
            pass  # the gateway vanished: the same as its EOF
        finally:
            self.close()

    def send(self, data: bytes) -> None:
        if not self.closed and not self.writer.transport.is_closing():
            self.writer.write(data)

    def close(self) -> None:
        """The gateway is gone (or the engine is stopping): close all its sessions at once, end its tasks."""
        if self.closed:
            return
        self.closed = True
        for task in self.calls:
            task.cancel()
        sessions = list(self.sessions.values())
        for session in sessions:
            session.close()  # a Close is never refused: all of them reach the worker's next turn
        for pump in self.pumps.values():
            pump.cancel()
        self.sessions.clear()
        self.pumps.clear()
        self.writer.close()
        if self.welcomed:
            log.info("%s disconnected; its %d open sessions are closed", self.name, len(sessions))

    # ---- the gateway's messages ----------------------------------------------------------------------------------
    def _dispatch(self, m: list[Any]) -> None:
        op = m[0]
        if op == Op.ACK:
            pairs = m[1]
            for i in range(0, len(pairs) - 1, 2):
                session = self.sessions.get(pairs[i])
                if session is not None:  # its clients have read this much more of the audio sent to them
                    session.consumed_samples += pairs[i + 1]
            return
        if op == Op.CALL:
            self._call(m[1], m[2], m[3])
            return
        if op == Op.HELLO:
            if not self.welcomed:
                self._hello(m[1], m[2] if len(m) > 2 else "", m[3] if len(m) > 3 else None)
            return
        session = self.sessions.get(m[1])
        if op == Op.CLOSE:
            if session is not None:
                self.sessions.pop(session.id)
                session.close()
                pump = self.pumps.pop(session.id, None)
                if pump is not None:
                    pump.cancel()
            return
        if op not in (Op.SPEAK, Op.END, Op.CANCEL):
            raise LinkBroken(f"unknown message {op!r}")
        if session is None:
            return  # a session that ended meanwhile (a fatal error on its way to the gateway)
        utt = m[2]
        try:
            if op == Op.SPEAK:
                session.utterance = utt  # the gateway's numbering: its session made the same calls in this order
                session.speak(m[3])
            elif op == Op.END:
                session.utterance = utt
                session.end_utterance()
            else:
                session.utterance = max(session.utterance, utt)
                session.cancel(utt)
        except FishgateError as e:
            # in-process these raise to the caller; over the link the caller is gone, so its utterance hears of it
            session.deliver(SessionError(e.code, str(e), utt))

    def _hello(self, version: int, name: str, token: object) -> None:
        peer = self.writer.get_extra_info("peername")
        if name:
            self.name = f"{self.name} ({name})"
        engine = self.engine
        if version != PROTOCOL_VERSION:
            log.error("%s speaks engine-link protocol %s, this engine %d: run one fishgate version on both sides",
                      self.name, version, PROTOCOL_VERSION)  # fmt: skip
            # WELCOME's layout is every version's: the gateway reads this engine's version and says so; no more
            self.send(frame([Op.WELCOME, PROTOCOL_VERSION, None, 0, 0, engine.state.value]))
            self.close()
            return
        if not token_matches(self.host.token, token):
            self.host.refusals.note(f"{self.name} at {peer or 'a local socket'}")
            self.send(frame([Op.REFUSED, REFUSED_TOKEN]))
            self.close()
            return
        self.send(frame([Op.WELCOME, PROTOCOL_VERSION, pack_info(engine.info), engine.capacity,
                         engine.config.max_queued_chars, engine.state.value]))  # fmt: skip
        self.send(self.host.status_frame())  # its headroom now, not at the next tick
        self.welcomed = True
        log.info("%s attached (%d sessions open on the engine)", self.name, engine.open_sessions)

    def _call(self, call_id: int, method: str, args: list[Any]) -> None:
        if len(self.calls) >= MAX_CALLS_IN_FLIGHT:
            refused = Overloaded(f"{MAX_CALLS_IN_FLIGHT} engine calls of this gateway are in flight; retry later")
            self.send(frame(failure(call_id, refused)))
            return
        task = asyncio.get_running_loop().create_task(self._answer(call_id, method, args))
        self.calls.add(task)
        task.add_done_callback(self.calls.discard)

    async def _answer(self, call_id: int, method: str, args: list[Any]) -> None:
        try:
            value: Any = None
            if method == "admit":
                value = await self._admit(*args)
            elif method == "check_texts":
                await self.engine.check_texts(args[0])
            elif method == "encode_reference":
                value = pack_array(await self.engine.encode_reference(unpack_array(args[0]), int(args[1])))
            else:
                raise LinkBroken(f"unknown call {method!r}")
        except asyncio.CancelledError:
            raise
        except Exception as e:
            if not isinstance(e, FishgateError):
                log.error("%s: engine call %s failed", self.name, method, exc_info=e)
            self.send(frame(failure(call_id, e)))
            return
        self.send(frame([Op.RESULT, call_id, value]))

    async def _admit(self, voice: list[Any], settings: dict[str, Any], wait_s: float | None) -> int:
        session = await self.engine.admit(unpack_voice(voice), unpack_settings(settings), wait_s)
        if self.closed:  # the gateway went while this session waited for admission
            session.close()
            raise SessionClosed("the gateway disconnected")
        self.sessions[session.id] = session
        # no await until the RESULT is written (_answer): the gateway learns of the session before its first event
        self.pumps[session.id] = asyncio.get_running_loop().create_task(self._pump(session))
        return session.id

    # ---- the engine's events --------------------------------------------------------------------------------------
    async def _pump(self, session: Session) -> None:
        sid = session.id
        try:
            while True:
                ev = await session.next_event()
                if isinstance(ev, AudioChunk):
                    # next_event() counted it read; it is read when the gateway's ACK says its client has it
                    session.consumed_samples -= len(ev.pcm)
                self.send(event_frame(sid, ev))
                if isinstance(ev, SessionError) and ev.fatal:  # the engine has closed the session (Session.deliver)
                    self.pumps.pop(sid, None)
                    self.sessions.pop(sid, None)
                    return
                await self.writer.drain()  # waits only above the high-water mark
        except ConnectionError:
            pass  # the connection is going: close() closes the session

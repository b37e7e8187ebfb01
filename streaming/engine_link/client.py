"""The gateway side of the link: `RemoteEngine`, the gateway's engine interface (streaming.engine_api.EngineHandle)
served by a resident engine process at `unix:PATH` or `tcp:HOST:PORT`, keeping one connection
(streaming.engine_link.connection.Link) to it.

`start()` makes the connection and any loss remakes it (retries from RECONNECT_FIRST_S, doubling up to RECONNECT_MAX_S).
A refusal at the handshake (another protocol version, a wrong or missing token) is logged once with its fix and retried
at the same pace. While there is none the state is UNAVAILABLE: readiness is false, admits fail at once with
EngineUnavailable (HTTP 503), and every session the lost connection carried has ended with a fatal `engine_unavailable`
SessionError. Imports no torch.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..engine_api import EngineState, ModelInfo
from ..errors import EngineUnavailable, NotReady
from ..session import Session, SynthesisSettings, Voice
from .address import TcpAddress, UnixAddress, parse_address
from .connection import UNAVAILABLE_MESSAGE, EngineView, Link, RemoteSession
from .protocol import PROTOCOL_VERSION, Op, frame, pack_array, pack_settings, pack_voice, unpack_array
from .sockets import tune

log = logging.getLogger(__name__)

RECONNECT_FIRST_S = 0.05
RECONNECT_MAX_S = 1.0  # an engine that comes back is found within this
CONNECT_TIMEOUT_S = 2.0


class RemoteEngine:
    """The gateway's engine when it runs in another process, reached at `address` (`unix:PATH` or `tcp:HOST:PORT`);
    `token`: the engine's shared secret (FISHGATE_ENGINE_TOKEN), sent in the HELLO."""

    def __init__(self, address: str, *, token: str | None = None) -> None:
        self.address = address
        self.target: UnixAddress | TcpAddress = parse_address(address)
        self._token = token or None
        self.fault: str | None = None  # never set: a remote engine's fault is the engine process's to report
        self.config_error: str | None = None
        self._view = EngineView()
        self._link: Link | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None
        self._draining = False
        self._stopped = False
        self.reconnects = 0  # links made after the first
        self._refused: str | None = None

    # ---- state -------------------------------------------------------------------------------------------------------
    @property
    def state(self) -> EngineState:
        if self._stopped:
            return EngineState.STOPPED
        link = self._link
        if link is None or not link.welcomed or link.lost is not None:
            return EngineState.UNAVAILABLE
        remote = link.remote_state
        if remote in (EngineState.FAULTED, EngineState.STOPPED):
            return EngineState.UNAVAILABLE  # the engine process is going: a supervisor restarts it, we reconnect
        if self._draining and remote is EngineState.READY:
            return EngineState.DRAINING
        return remote

    @property
    def ready(self) -> bool:
        return self.state is EngineState.READY

    @property
    def info(self) -> ModelInfo | None:
        return self._view.info

    @property
    def capacity(self) -> int:
        return self._view.capacity

    @property
    def open_sessions(self) -> int:
        """This gateway's sessions (the engine's other gateways have their own)."""
        link = self._link
        return len(link.sessions) if link is not None else 0

    @property
    def refused(self) -> str | None:
        """Why the engine refused this gateway's last handshake (a wrong or missing token, another protocol version),
        with the fix; None once a link works."""
        link = self._link
        return None if link is not None and link.welcomed else self._refused

    @property
    def headroom(self) -> int:
        """How many more sessions the engine would take now (Engine.headroom, sent with every STATUS), less this
        gateway's admits since that STATUS; 0 unless ready."""
        link = self._link
        return link.headroom if link is not None and self.ready else 0

    # ---- lifecycle ---------------------------------------------------------------------------------------------------
    def start(self) -> None:
        if self._task is None:
            self._loop = asyncio.get_running_loop()
            self._task = self._loop.create_task(self._keep_linked())

    def drain(self) -> None:
        """This gateway admits no new sessions (the engine, shared with other gateways, goes on)."""
        self._draining = True

    def stop(self, timeout_s: float = 10.0) -> None:
        """Close the link (the engine then closes this gateway's sessions). Callable from any thread."""
        self._stopped = True
        loop, task = self._loop, self._task
        if loop is None or task is None or loop.is_closed():
            return

        done = threading.Event()

        def close() -> None:
            task.cancel()
            if self._link is not None:
                self._link.fail("this gateway is stopping")
            done.set()

        try:
            on_loop = asyncio.get_running_loop() is loop
        except RuntimeError:
            on_loop = False
        if on_loop or not loop.is_running():
            close()
        else:
            loop.call_soon_threadsafe(close)
            done.wait(timeout_s)

    async def _keep_linked(self) -> None:
        delay = RECONNECT_FIRST_S
        linked_before = False
        down_logged = False
        while not self._stopped:
            try:
                async with asyncio.timeout(CONNECT_TIMEOUT_S):
                    reader, writer = await self._connect()
            except (OSError, TimeoutError) as e:
                if not down_logged:
                    down_logged = True
                    log.warning("engine at %s unreachable (%s); retrying every %.0f s at most", self.address,
                                getattr(e, "strerror", None) or type(e).__name__, RECONNECT_MAX_S)  # fmt: skip
                await asyncio.sleep(delay)
                delay = min(2 * delay, RECONNECT_MAX_S)
                continue
            tune(writer.get_extra_info("socket"))
            link = Link(reader, writer, self._view)
            self._link = link
            link.send(frame([Op.HELLO, PROTOCOL_VERSION, f"pid {os.getpid()}", self._token]))
            self.reconnects += linked_before
            linked_before = True
            if self._refused is None:
                log.info("connected to the engine at %s", self.address)
            await link.serve()
            if link.welcomed:  # a link that worked: the next try comes at once, and its loss is news
                log.warning("engine link to %s lost: %s; reconnecting", self.address, link.lost)
                delay, down_logged, self._refused = RECONNECT_FIRST_S, False, None
            else:  # refused at the handshake (another version, the token): retried, backing off, said once
                if self._refused != link.lost:
                    log.error("engine at %s refused this gateway: %s", self.address, link.lost)
                self._refused = link.lost
                down_logged = True
                await asyncio.sleep(delay)
                delay = min(2 * delay, RECONNECT_MAX_S)

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        target = self.target
        if isinstance(target, UnixAddress):
            return await asyncio.open_unix_connection(target.path)
        return await asyncio.open_connection(target.host, target.port)

    def _linked(self) -> Link:
        link = self._link
        if link is None or not link.welcomed or link.lost is not None:
            raise EngineUnavailable(UNAVAILABLE_MESSAGE)
        return link

    # ---- sessions and calls ------------------------------------------------------------------------------------------
    async def admit(self, voice: Voice, settings: SynthesisSettings, wait_s: float | None = None) -> Session:
        if self._draining:
            raise NotReady("this gateway is shutting down; retry on another")
        link = self._linked()
        link.check_room()
        answered = False

        def opened(sid: int) -> RemoteSession:
            nonlocal answered
            answered = True  # as the RESULT is read: a STATUS read after it counts this session
            link.admits_in_flight -= 1
            link.admits_unreported += 1
            session = RemoteSession(
                voice, settings, link.command, link.loop, id=sid, max_queued_chars=self._view.max_queued_chars,
                _acknowledge=link.acknowledge,
            )  # fmt: skip
            link.sessions[sid] = session
            return session

        link.admits_in_flight += 1
        try:
            session: RemoteSession = await link.call(
                "admit", [pack_voice(voice), pack_settings(settings), wait_s], opened, lambda s: s.close()
            )
        finally:
            if not answered:
                link.admits_in_flight -= 1
        return session

    async def check_texts(self, texts: Sequence[str]) -> None:
        await self._linked().call("check_texts", [list(texts)])

    async def encode_reference(self, audio: np.ndarray, sample_rate_hz: int) -> np.ndarray:
        result: np.ndarray = await self._linked().call(
            "encode_reference", [pack_array(np.asarray(audio)), int(sample_rate_hz)], unpack_array
        )
        return result

    # ---- counters ----------------------------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """The engine's counters as of its last STATS (at most STATS_INTERVAL_S old), with this gateway's view."""
        out: dict[str, Any] = dict(self._view.stats or {})
        out["state"] = self.state.value
        out["link_up"] = int(self.state is not EngineState.UNAVAILABLE)
        out["link_reconnects"] = self.reconnects
        out["gateway_sessions"] = self.open_sessions
        out["headroom"] = self.headroom
        return out

    def gpu_memory_bytes(self) -> int:
        return self._view.gpu_memory_bytes

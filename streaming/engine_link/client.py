"""The gateway side of the link: `RemoteEngine`, the gateway's engine interface (streaming.engine_api.EngineHandle)
served by a resident engine process, keeping one connection (streaming.engine_link.connection.Link) to it.

`start()` makes the connection and any loss remakes it (retries from RECONNECT_FIRST_S, doubling up to
RECONNECT_MAX_S). While there is none the state is UNAVAILABLE: readiness is false, admits fail at once with
EngineUnavailable (HTTP 503), and every session the lost connection carried has ended with a fatal
`engine_unavailable` SessionError. Imports no torch.
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
from .connection import UNAVAILABLE_MESSAGE, EngineView, Link, RemoteSession
from .protocol import PROTOCOL_VERSION, Op, frame, pack_array, pack_settings, pack_voice, parse_address, unpack_array

log = logging.getLogger(__name__)

RECONNECT_FIRST_S = 0.05
RECONNECT_MAX_S = 1.0  # an engine that comes back is found within this
CONNECT_TIMEOUT_S = 2.0


class RemoteEngine:
    """The gateway's engine when it runs in another process, reached at `address` (`unix:PATH`)."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.path = parse_address(address)
        self.fault: str | None = None  # never set: a remote engine's fault is the engine process's to report
        self.config_error: str | None = None
        self._view = EngineView()
        self._link: Link | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None
        self._draining = False
        self._stopped = False
        self.reconnects = 0  # links made after the first

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
                    reader, writer = await asyncio.open_unix_connection(self.path)
            except (OSError, TimeoutError) as e:
                if not down_logged:
                    down_logged = True
                    log.warning("engine at %s unreachable (%s); retrying every %.0f s at most", self.address,
                                getattr(e, "strerror", None) or type(e).__name__, RECONNECT_MAX_S)  # fmt: skip
                await asyncio.sleep(delay)
                delay = min(2 * delay, RECONNECT_MAX_S)
                continue
            link = Link(reader, writer, self._view)
            self._link = link
            link.send(frame([Op.HELLO, PROTOCOL_VERSION, f"pid {os.getpid()}"]))
            self.reconnects += linked_before
            linked_before = True
            log.info("connected to the engine at %s", self.address)
            await link.serve()
            if link.welcomed:  # a link that worked: the next try comes at once, and its loss is news
                log.warning("engine link to %s lost: %s; reconnecting", self.address, link.lost)
                delay, down_logged = RECONNECT_FIRST_S, False
            else:  # refused at the handshake (another protocol version): retried, backing off, said once
                if not down_logged:
                    log.error("engine at %s refused: %s", self.address, link.lost)
                    down_logged = True
                await asyncio.sleep(delay)
                delay = min(2 * delay, RECONNECT_MAX_S)

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

        def opened(sid: int) -> RemoteSession:
            session = RemoteSession(
                voice, settings, link.command, link.loop, id=sid, max_queued_chars=self._view.max_queued_chars,
                _acknowledge=link.acknowledge,
            )  # fmt: skip
            link.sessions[sid] = session
            return session

        session: RemoteSession = await link.call(
            "admit", [pack_voice(voice), pack_settings(settings), wait_s], opened, lambda s: s.close()
        )
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
        return out

    def gpu_memory_bytes(self) -> int:
        return self._view.gpu_memory_bytes

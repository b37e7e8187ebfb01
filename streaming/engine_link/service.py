"""An engine's life on the link, shared by `fishgate engine` (process.py) and the Ray engine replica (server.ray_serve):
serve gateways on a listening socket and start the engine, drain (no new sessions, running utterances get a grace),
close. A fault closes the link at once, so gateways end its sessions now. Knows nothing of signals, socket paths or
who asks it to drain.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from typing import TYPE_CHECKING

from ..engine_api import EngineState
from .host import EngineHost

if TYPE_CHECKING:
    from ..engine import Engine  # torch: built by the caller once the socket is claimed

log = logging.getLogger(__name__)

WATCH_INTERVAL_S = 0.1  # how often a fault or the end of a drain is looked for
START_WATCH_INTERVAL_S = 0.01  # how often a starting engine is looked at: gateways hear `ready` this soon after it


class EngineService:
    """`engine` served to gateways: `await start(sock)`, then `drain(grace_s)` and `await until_done()` (or just
    `until_done()`: it returns on a fault), then `await close()`. With a `token`, only gateways that send it are
    served."""

    def __init__(self, engine: Engine, token: str | None = None) -> None:
        self.engine = engine
        self.host = EngineHost(engine, token=token)
        self._server: asyncio.Server | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._drain_deadline: float | None = None  # set by drain()

    @property
    def address(self) -> str | None:
        """Where gateways reach it (`unix:PATH`, or `tcp:HOST:PORT` with the kernel's port), once started."""
        return self.host.bound_address

    @property
    def faulted(self) -> bool:
        return self.engine.state is EngineState.FAULTED

    async def start(self, sock: socket.socket) -> None:
        """Serve gateways on the listening `sock` (they see `starting` until the engine is ready) and start it."""
        self._server = await self.host.start_serving(sock)
        self.engine.start()
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(t) for t in (self.host.tick_forever(), self._announce_start(),
                                                     self._close_link_on_fault())]  # fmt: skip

    def drain(self, grace_s: float) -> None:
        """No new sessions (gateways hear it now, not at the next tick); running utterances get `grace_s` to finish."""
        log.info("draining %s: no new sessions; running utterances have %.0f s to finish", self.address, grace_s)
        self._drain_deadline = time.monotonic() + grace_s
        self.engine.drain()
        self.host.broadcast_status()

    @property
    def done(self) -> bool:
        """Faulted, or draining with no session left or its grace over."""
        if self.faulted:
            return True
        deadline = self._drain_deadline
        return deadline is not None and (self.engine.open_sessions == 0 or time.monotonic() >= deadline)

    async def until_done(self) -> None:
        while not self.done:
            await asyncio.sleep(WATCH_INTERVAL_S)

    async def close(self) -> None:
        """Close every gateway's connection (their sessions end with engine_unavailable) and stop the engine."""
        for task in self._tasks:
            task.cancel()
        self._close_link()
        await asyncio.to_thread(self.engine.stop)

    async def _announce_start(self) -> None:
        """Gateways hear the start's end (ready, or a fault) at once, not at the next status tick: a restart ends
        that much sooner."""
        while self.engine.state is EngineState.STARTING:
            await asyncio.sleep(START_WATCH_INTERVAL_S)
        self.host.broadcast_status()

    async def _close_link_on_fault(self) -> None:
        while not self.faulted:
            await asyncio.sleep(WATCH_INTERVAL_S)
        log.critical("engine faulted (%s): closing %s", self.engine.fault, self.address)
        self._close_link()

    def _close_link(self) -> None:
        if self._server is not None:
            self._server.close()
        self.host.close_all()  # gateways see the engine go

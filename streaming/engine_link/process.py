"""The resident engine process (`fishgate engine --listen unix:PATH|tcp:HOST:PORT`): serve gateways on the socket
that streaming.engine_link.sockets claimed, start the engine, serve until a signal, drain, stop.

The socket listens before the engine has loaded, so gateways attach at once and report `starting` until it is ready; its
real address (a TCP port 0 becomes the kernel's pick) is logged and is `EngineHost.bound_address`. SIGTERM/SIGINT: the
engine admits no new sessions (gateways turn not ready), running utterances get `drain_grace_s` to finish, then every
connection closes and the engine stops; a second signal stops at once. A faulted engine (or one whose configuration was
refused) stops serving; the CLI turns the engine's `fault` / `config_error` into the exit status.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import stat
import time
from pathlib import Path
from typing import TYPE_CHECKING

from ..engine_api import EngineState
from .host import EngineHost

if TYPE_CHECKING:
    from ..engine import Engine  # torch: loaded by the CLI once the socket path is claimed

log = logging.getLogger(__name__)

WATCH_INTERVAL_S = 0.1  # how often the process checks for a fault, a finished drain, a stop


async def serve(engine: Engine, sock: socket.socket, drain_grace_s: float, token: str | None = None) -> None:
    """Start `engine` and serve it on `sock` (gateways must HELLO with `token` when one is given) until a signal
    (drained) or a fault; then stop it and remove a Unix socket's path."""
    unix_path = Path(sock.getsockname()) if sock.family == socket.AF_UNIX else None
    inode = unix_path.stat().st_ino if unix_path is not None else None
    host = EngineHost(engine, token=token)
    server = await host.start_serving(sock)
    engine.start()
    loop = asyncio.get_running_loop()
    signals = 0

    def on_signal() -> None:
        nonlocal signals
        signals += 1
        if signals == 1:
            log.info("draining: no new sessions; running utterances have %.0f s to finish", drain_grace_s)
            engine.drain()
            host.broadcast_status()  # gateways turn not ready now, not at the next tick

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    ticker = loop.create_task(host.tick_forever())
    log.info("fishgate engine listening on %s%s", host.bound_address, "" if token else " (no token)")
    drain_deadline: float | None = None
    try:
        while True:
            await asyncio.sleep(WATCH_INTERVAL_S)
            if engine.state is EngineState.FAULTED:
                log.critical("engine faulted (%s): closing %s", engine.fault, host.bound_address)
                break
            if signals > 1:
                break
            if signals == 1:
                drain_deadline = drain_deadline or time.monotonic() + drain_grace_s
                if engine.open_sessions == 0 or time.monotonic() >= drain_deadline:
                    break
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        ticker.cancel()
        server.close()
        host.close_all()  # gateways see the engine go; their sessions end with engine_unavailable
        await asyncio.to_thread(engine.stop)
        if unix_path is not None:
            with contextlib.suppress(OSError):
                if os.stat(unix_path).st_ino == inode and stat.S_ISSOCK(os.stat(unix_path).st_mode):
                    unix_path.unlink()  # ours still: a later engine must not find it stale

"""The resident engine process (`fishgate engine --listen unix:PATH|tcp:HOST:PORT`): serve gateways on the socket
that streaming.engine_link.sockets claimed, start the engine, serve until a signal, drain, stop (service.EngineService,
which the Ray engine replica shares).

The socket listens before the engine has loaded, so gateways attach at once and report `starting` until it is ready; its
real address (a TCP port 0 becomes the kernel's pick) is logged and is `EngineService.address`. SIGTERM/SIGINT: the
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
from pathlib import Path
from typing import TYPE_CHECKING

from .service import WATCH_INTERVAL_S, EngineService

if TYPE_CHECKING:
    from ..engine import Engine  # torch: loaded by the CLI once the socket path is claimed

log = logging.getLogger(__name__)


async def serve(engine: Engine, sock: socket.socket, drain_grace_s: float, token: str | None = None) -> None:
    """Start `engine` and serve it on `sock` (gateways must HELLO with `token` when one is given) until a signal
    (drained) or a fault; then stop it and remove a Unix socket's path."""
    unix_path = Path(sock.getsockname()) if sock.family == socket.AF_UNIX else None
    inode = unix_path.stat().st_ino if unix_path is not None else None
    service = EngineService(engine, token=token)
    await service.start(sock)
    loop = asyncio.get_running_loop()
    signals = 0

    def on_signal() -> None:
        nonlocal signals
        signals += 1
        if signals == 1:
            service.drain(drain_grace_s)

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    log.info("fishgate engine listening on %s%s", service.address, "" if token else " (no token)")
    try:
        while not (service.done or signals > 1):
            await asyncio.sleep(WATCH_INTERVAL_S)
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        await service.close()
        if unix_path is not None:
            with contextlib.suppress(OSError):
                if os.stat(unix_path).st_ino == inode and stat.S_ISSOCK(os.stat(unix_path).st_mode):
                    unix_path.unlink()  # ours still: a later engine must not find it stale

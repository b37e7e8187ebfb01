"""The resident engine process (`fishgate engine --listen unix:PATH`): claim the socket path, start the engine,
serve gateways until a signal, drain, stop.

The path: one where nobody accepts (a killed engine's leftover) is taken over; a live engine there, or a file that is
not a socket, is refused with `CannotListen` before any model loads. The socket listens before the engine has loaded,
so gateways attach at once and report `starting` until it is ready. SIGTERM/SIGINT: the engine admits no new sessions
(gateways turn not ready), running utterances get `drain_grace_s` to finish, then every connection closes and the
engine stops; a second signal stops at once. A faulted engine (or one whose configuration was refused) stops serving;
the CLI turns the engine's `fault` / `config_error` into the exit status.
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

PROBE_TIMEOUT_S = 1.0  # a live engine accepts at once; a full backlog this long also counts as live
LISTEN_BACKLOG = 128
WATCH_INTERVAL_S = 0.1  # how often the process checks for a fault, a finished drain, a stop


class CannotListen(Exception):
    """The socket path is in use by a live engine, is not a socket, or cannot be bound: the engine process does not
    start."""


def claim_socket(path: Path) -> socket.socket:
    """A listening Unix socket at `path`, taking over a stale one (nobody accepts there); CannotListen if a live engine
    answers there, the path is something else, or it cannot be bound."""
    if path.is_socket():
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.settimeout(PROBE_TIMEOUT_S)
        try:
            probe.connect(str(path))
        except (ConnectionRefusedError, FileNotFoundError):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()  # stale: the engine that bound it is gone
            log.info("took over the stale socket unix:%s (nobody accepted there)", path)
        except OSError as e:
            raise CannotListen(f"unix:{path} is in use and does not answer ({e.strerror or e}); stop what holds it or "
                               "pass another --listen") from None  # fmt: skip
        else:
            raise CannotListen(f"an engine is already listening on unix:{path}; stop it first or pass another --listen")
        finally:
            probe.close()
    elif path.exists() or path.is_symlink():
        raise CannotListen(f"{path} exists and is not a socket; remove it or pass another --listen")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(str(path))
    except OSError as e:
        sock.close()
        raise CannotListen(f"cannot listen on unix:{path}: {e.strerror or e}") from None
    sock.listen(LISTEN_BACKLOG)
    return sock


async def serve(engine: Engine, sock: socket.socket, drain_grace_s: float) -> None:
    """Start `engine` and serve it on `sock` until a signal (drained) or a fault; then stop it and remove the
    socket's path."""
    path = Path(sock.getsockname())
    inode = path.stat().st_ino
    host = EngineHost(engine)
    server = await asyncio.start_unix_server(host.handle, sock=sock)
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
    log.info("fishgate engine listening on unix:%s", path)
    drain_deadline: float | None = None
    try:
        while True:
            await asyncio.sleep(WATCH_INTERVAL_S)
            if engine.state is EngineState.FAULTED:
                log.critical("engine faulted (%s): closing unix:%s", engine.fault, path)
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
        with contextlib.suppress(OSError):
            if os.stat(path).st_ino == inode and stat.S_ISSOCK(os.stat(path).st_mode):
                path.unlink()  # ours still: a later engine must not find it stale

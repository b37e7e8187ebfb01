"""The engine link's sockets: claiming an address to listen on (a Unix socket path, taking over a stale one, or a TCP
port), the address a listening socket is bound to (port 0 → the kernel's pick), and the options every link socket
gets (TCP_NODELAY: audio chunks are latency-critical; keepalive: a vanished peer host is noticed).

Refusals raise `CannotListen` before any model loads. A TCP listener beyond loopback needs a token
(FISHGATE_ENGINE_TOKEN): without one anyone who reaches the port could drive the GPU.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import socket
from pathlib import Path

from .address import Address, TcpAddress, UnixAddress, is_loopback
from .auth import TOKEN_VARIABLE

log = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 1.0  # a live engine accepts at once; a full backlog this long also counts as live
LISTEN_BACKLOG = 128
# TCP keepalive of a link: probes after 10 s of silence, 5 s apart, 3 unanswered: a peer host that vanished without a
# goodbye (power, network) is given up in ~25 s instead of the kernel's two hours. Gateways also watch STATUS.
KEEPALIVE_IDLE_S = 10
KEEPALIVE_INTERVAL_S = 5
KEEPALIVE_PROBES = 3


class CannotListen(Exception):
    """The address is in use (a live engine on the socket path, a taken port), is not a socket, cannot be bound, or
    needs a token it lacks: the engine process does not start."""


def listen(address: Address, token: str | None = None) -> socket.socket:
    """A listening socket at `address`; CannotListen (naming the fix) otherwise."""
    if isinstance(address, UnixAddress):
        return claim_socket(address.path)
    if not token and not is_loopback(address):
        raise CannotListen(f"listening on {address} (beyond loopback) needs a token: set {TOKEN_VARIABLE} on the "
                           "engine and on its gateways, or listen on 127.0.0.1")  # fmt: skip
    return listen_tcp(address)


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


def listen_tcp(address: TcpAddress) -> socket.socket:
    """A listening TCP socket (SO_REUSEADDR: a restarted engine rebinds past TIME_WAIT); CannotListen when the port is
    taken or the host does not resolve to an address of this machine. There is no takeover: a port is live or free."""
    try:
        infos = socket.getaddrinfo(address.host, address.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as e:
        why = e.strerror or str(e)
        raise CannotListen(f"cannot listen on {address}: {address.host!r} does not resolve ({why})") from None
    family, kind, proto, _, sockaddr = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        sock.listen(LISTEN_BACKLOG)
    except OSError as e:
        sock.close()
        why = e.strerror or str(e)
        if e.errno == errno.EADDRINUSE:
            raise CannotListen(f"{address} is in use ({why}): stop what holds it or pass another --listen") from None
        raise CannotListen(f"cannot listen on {address}: {why}") from None
    return sock


def address_of(sock: socket.socket) -> str:
    """The address a bound socket serves, as gateways name it: `unix:PATH`, or `tcp:HOST:PORT` with the port the
    kernel picked for port 0."""
    if sock.family == socket.AF_UNIX:
        return str(UnixAddress(Path(sock.getsockname())))
    host, port = sock.getsockname()[:2]
    return str(TcpAddress(host, port))


def tune(sock: socket.socket | None) -> None:
    """A link socket's options (either side): TCP_NODELAY and a short keepalive on TCP; nothing on a Unix socket."""
    if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", KEEPALIVE_IDLE_S), ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
                        ("TCP_KEEPCNT", KEEPALIVE_PROBES)):  # fmt: skip
        if hasattr(socket, name):  # Linux; elsewhere the system's keepalive timing
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)

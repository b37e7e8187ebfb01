"""Engine addresses: `unix:PATH` (a Unix socket on this host) or `tcp:HOST:PORT` (`tcp:[V6]:PORT` for an IPv6
literal), parsed, written back, and judged loopback or not. Knows nothing about sockets beyond name resolution for
`is_loopback`; process.py binds them and client.py connects to them.
"""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass
from pathlib import Path

UNIX_PREFIX = "unix:"
TCP_PREFIX = "tcp:"
FORMS = "unix:PATH (a Unix socket's path) or tcp:HOST:PORT"
# Names that are loopback without asking the resolver.
LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost"})


@dataclass(frozen=True, slots=True)
class UnixAddress:
    path: Path

    def __str__(self) -> str:
        return f"{UNIX_PREFIX}{self.path}"


@dataclass(frozen=True, slots=True)
class TcpAddress:
    host: str  # a name, an IPv4 literal, or an IPv6 literal without brackets
    port: int  # 0 when listening: the kernel picks one (process.address_of says which)

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{TCP_PREFIX}{host}:{self.port}"


Address = UnixAddress | TcpAddress


def parse_address(text: str) -> Address:
    """`unix:PATH` or `tcp:HOST:PORT` → its Address; ValueError naming the forms otherwise."""
    if text.startswith(UNIX_PREFIX) and text[len(UNIX_PREFIX) :]:
        return UnixAddress(Path(text[len(UNIX_PREFIX) :]))
    if text.startswith(TCP_PREFIX):
        rest = text[len(TCP_PREFIX) :]
        if rest.startswith("["):
            host, sep, port = rest[1:].partition("]:")
        else:
            host, sep, port = rest.rpartition(":")
            if ":" in host:
                sep = ""  # an IPv6 literal needs its brackets
        if sep and host and port.isdigit() and int(port) <= 65535:
            return TcpAddress(host, int(port))
    raise ValueError(f"an engine address is {FORMS} (tcp:[V6]:PORT for IPv6), not {text!r}")


def parse_addresses(text: str) -> list[Address]:
    """A comma-separated list of addresses (`serve --engine A,B`), each parsed; ValueError on any bad one or none."""
    parts = [part.strip() for part in text.split(",") if part.strip()]
    if not parts:
        raise ValueError(f"an engine address is {FORMS}, not {text!r}")
    return [parse_address(part) for part in parts]


def is_loopback(address: Address) -> bool:
    """Whether only this host can reach `address`: a Unix socket, or a TCP host that is (or resolves only to)
    loopback. A name that does not resolve counts as not loopback. May block on the resolver (start-up only)."""
    if isinstance(address, UnixAddress):
        return True
    host = address.host
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(str(info[4][0]).split("%")[0]).is_loopback for info in infos)

"""`fishgate serve --workers N`: N gateway processes serving one host:port, attached to one resident engine.

Owns the parent process and its children: the private runtime folder (0700) holding the engine child's socket
(unless --engine names a running engine), the port, and starting, restarting, draining and stopping the children in
order. Each child runs server.worker_child: a gateway child is an ordinary `fishgate serve --engine` gateway
(server.cli.run_gateway), the engine child runs `fishgate engine`'s code (server.cli.run_engine). Knows nothing of
HTTP, WebSockets or the engine's link.

Each gateway listens on a socket of its own, bound with SO_REUSEPORT (Linux), and the parent holds the port with one
more such socket, bound but not listening, for the server's whole life. Why not one listening socket inherited by
every gateway (uvicorn's --workers): there, whichever idle event loop wakes first takes every pending connection, so
long-lived WebSockets pile up on a few gateways; here the kernel spreads connections over the listening gateways by a
hash of their addresses, and a gateway's socket closes with it, so the others take every new connection while it
restarts (only connections it had queued but not accepted are reset). No other user can bind the port meanwhile.

Children take their orders from a pipe, not from signals: when the parent closes its end (or dies), a gateway drains
and an engine child stops. Under systemd's default KillMode every process of the unit gets SIGTERM at once, and a
second SIGTERM from the parent would stop a gateway at once instead of draining it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import pickle
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from prometheus_client import multiprocess

from .gateway import MULTIPROCESS_DIR_ENV
from .settings import Settings

log = logging.getLogger(__name__)

LISTEN_BACKLOG = 2048  # uvicorn's default backlog
ENGINE_LISTEN_TIMEOUT_S = 120.0  # the engine child binds its socket before torch loads: seconds, not minutes
ENGINE_LISTEN_POLL_S = 0.05  # the gateways start this soon after the engine child listens
WATCH_POLL_S = 0.5  # otherwise the loop wakes for a signal or a child's exit (SIGCHLD), or this often
GATEWAY_STOP_EXTRA_S = 10.0  # past --drain-grace-s: uvicorn's graceful shutdown (5 s) and the lifespan's end
ENGINE_STOP_S = 60.0  # an engine with no gateway left has nothing to drain: it stops its worker and exits
# Restart back-off: a child that lived STABLE_S or longer is replaced at once; one that died sooner waits FIRST_S,
# doubling with each quick death up to MAX_S (a crash loop must not spin the CPU or flood the log).
GATEWAY_RESTART = (10.0, 0.5, 10.0)  # (stable_s, first_s, max_s)
ENGINE_RESTART = (60.0, 0.5, 30.0)
SOCKET_PATH_MAX_BYTES = 100  # a Unix socket path holds at most 107 bytes
EXIT_CONFIG_ERROR = 2  # as server.cli's: a child refused its configuration, a restart cannot help
EXIT_ENGINE_FAULT = 3


@dataclass
class _Child:
    role: str  # "engine" or "gateway"
    slot: int  # a gateway's number, 1..N (the engine's: 0)
    proc: subprocess.Popen[bytes]
    control_w: int | None  # the parent's end of the child's control pipe; closing it drains (or stops) the child
    started_s: float

    @property
    def name(self) -> str:
        number = f" {self.slot}" if self.role == "gateway" else ""
        return f"{self.role}{number} [pid {self.proc.pid}]"

    def release(self) -> None:
        """Close the control pipe: a gateway drains, an engine child drains and stops."""
        if self.control_w is not None:
            os.close(self.control_w)
            self.control_w = None


@dataclass
class _Backoff:
    stable_s: float
    first_s: float
    max_s: float
    delay_s: float = 0.0

    def after_death(self, lived_s: float) -> float:
        """Seconds to wait before restarting a child that lived `lived_s`."""
        self.delay_s = 0.0 if lived_s >= self.stable_s else min(self.max_s, max(self.first_s, 2 * self.delay_s))
        return self.delay_s


def run_workers(settings: Settings) -> int:
    """The parent of `fishgate serve --workers N`: returns the exit status once everything has stopped."""
    if not sys.platform.startswith("linux") or not hasattr(socket, "SO_REUSEPORT"):
        log.critical("fishgate could not start: --workers needs Linux (SO_REUSEPORT load balancing); pass --workers 1")
        return EXIT_CONFIG_ERROR
    try:
        reserve = _reserve_port(settings.host, settings.port)
    except OSError as e:
        log.critical("fishgate could not start: cannot bind %s:%d (%s)", settings.host, settings.port, e.strerror or e)
        return EXIT_CONFIG_ERROR
    runtime: Path | None = None
    metrics: Path | None = None
    try:
        address = settings.engine
        if address is None:
            try:
                runtime = Path(tempfile.mkdtemp(prefix="fishgate-", dir=_runtime_base()))  # 0700: ours alone
            except OSError as e:
                log.critical("fishgate could not start: no private folder for the engine's socket (%s); set TMPDIR "
                             "to a writable folder (systemd: RuntimeDirectory=fishgate)", e)  # fmt: skip
                return EXIT_CONFIG_ERROR
            address = f"unix:{runtime / 'engine.sock'}"
            if len(address.encode()) - len("unix:") > SOCKET_PATH_MAX_BYTES:
                log.critical("fishgate could not start: the engine socket's path %s is too long for a Unix socket; "
                             "set TMPDIR to a shorter folder", address[5:])  # fmt: skip
                return EXIT_CONFIG_ERROR
        port = reserve.getsockname()[1]  # --port 0: the one the kernel picked, for every gateway
        metrics = Path(tempfile.mkdtemp(prefix="fishgate-metrics-"))  # 0700: the gateways' shared metrics
        supervisor = _Supervisor(settings, address, port, own_engine=runtime is not None, metrics_dir=metrics)
        return supervisor.run()
    finally:
        reserve.close()
        for folder in (runtime, metrics):
            if folder is not None:
                shutil.rmtree(folder, ignore_errors=True)


def _runtime_base() -> str | None:
    """systemd's RuntimeDirectory= (the shipped unit's /run/fishgate), else the user's runtime folder, else TMPDIR."""
    base = os.environ.get("RUNTIME_DIRECTORY", "").split(":")[0] or os.environ.get("XDG_RUNTIME_DIR")
    return base if base and os.path.isdir(base) and os.access(base, os.W_OK) else None


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def _reserve_port(host: str, port: int) -> socket.socket:
    """The parent's hold on host:port: bound with SO_REUSEPORT, never listening (it takes no connections); only
    sockets of this user with SO_REUSEPORT can join it."""
    sock = socket.socket(_family(host), socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def gateway_listener(host: str, port: int) -> socket.socket:
    """A gateway's own listening socket on the shared port (in the gateway child, just before it serves)."""
    sock = socket.socket(_family(host), socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: rebind over TIME_WAIT connections
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(LISTEN_BACKLOG)
    return sock


def on_pipe_end(fd: int, action: Callable[[], None]) -> None:
    """Call `action` (on a thread of its own) once the other end of the pipe `fd` is closed: the parent let go or
    died."""

    def wait() -> None:
        with contextlib.suppress(OSError):
            while os.read(fd, 64):
                pass
        action()

    threading.Thread(target=wait, name="fishgate-control", daemon=True).start()


class _Supervisor:
    """The parent's loop: children started, watched (SIGCHLD wakes it), restarted, stopped in order."""

    def __init__(self, settings: Settings, address: str, port: int, own_engine: bool, metrics_dir: Path) -> None:
        n = settings.workers
        self.settings = settings
        self.metrics_dir = metrics_dir  # each gateway's metrics files (prometheus_client's multiprocess mode)
        self.address = address
        self.own_engine = own_engine
        # the limits are the whole server's: each gateway enforces its share (the hash spreads connections evenly).
        # In front of an engine of its own (`--engine` absent) the connection cap is known now; in front of another
        # one it follows that engine's sessions, each gateway its 1/`workers` share (server.connection_cap)
        self.gateway_settings = dataclasses.replace(
            settings, engine=address, port=port,
            max_connections=None if settings.connections_follow_engine
            else math.ceil(settings.resolved_max_connections / n),
            rate_limit_per_min=math.ceil(settings.rate_limit_per_min / n),
        )  # fmt: skip
        self.engine: _Child | None = None
        self.gateways: dict[int, _Child | None] = dict.fromkeys(range(1, n + 1))
        self.restart_at: dict[int, float] = {}  # slot (0: the engine) -> when to start it again
        self.backoff = {slot: _Backoff(*GATEWAY_RESTART) for slot in self.gateways} | {0: _Backoff(*ENGINE_RESTART)}
        self.status = 0
        self.stopping_since: float | None = None
        self.engine_released_s = 0.0
        self.signals_seen = 0
        self.signals_pending: list[int] = []  # recorded by the handler, acted on by the loop
        self.engine_listening = not own_engine
        self.announced = False

    # ---- the loop --------------------------------------------------------------------------------------------------
    def run(self) -> int:
        wake_r, wake_w = os.pipe()  # signals write their number here (set_wakeup_fd): select wakes at once
        os.set_blocking(wake_r, False)
        os.set_blocking(wake_w, False)
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD)}
        old_wakeup = signal.set_wakeup_fd(wake_w)
        try:
            if self.own_engine:
                self.engine = self._spawn("engine", 0)
            while not self._done():
                select.select([wake_r], [], [], self._timeout_s())
                with contextlib.suppress(BlockingIOError):
                    while os.read(wake_r, 4096):
                        pass
                self._step()
            return self.status
        finally:
            signal.set_wakeup_fd(old_wakeup)
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            os.close(wake_r)
            os.close(wake_w)
            self._kill_all()  # after an error in this loop: no child outlives its parent

    def _on_signal(self, sig: int, frame: FrameType | None) -> None:
        if sig != signal.SIGCHLD:  # SIGCHLD's wake-up byte is the whole message: _step looks at every child
            self.signals_pending.append(sig)

    def _handle_signals(self) -> None:
        while self.signals_pending:
            sig = self.signals_pending.pop(0)
            self.signals_seen += 1
            if self.signals_seen == 1:
                log.info("%s: draining the gateways; running utterances have %.0f s to finish",
                         signal.Signals(sig).name, self.settings.drain_grace_s)  # fmt: skip
                self._begin_stop(0)
                continue
            log.warning("%s again: stopping every process now", signal.Signals(sig).name)
            for child in self._children():
                if child.proc.poll() is None:
                    child.proc.send_signal(signal.SIGTERM)  # a draining gateway (or engine) stops at a second signal

    def _timeout_s(self) -> float:
        """How long the loop may sleep: the engine's socket and the stop deadlines are polled, restarts are due."""
        now = time.monotonic()
        poll_s = ENGINE_LISTEN_POLL_S if not self.engine_listening else WATCH_POLL_S
        return max(0.01, min([poll_s, *(t - now for t in self.restart_at.values())]))

    def _done(self) -> bool:
        return self.stopping_since is not None and not any(c.proc.poll() is None for c in self._children())

    def _children(self) -> list[_Child]:
        return [c for c in [self.engine, *self.gateways.values()] if c is not None]

    def _step(self) -> None:
        self._handle_signals()
        for child in self._children():
            if (code := child.proc.poll()) is not None:
                self._exited(child, code)
        if not self.engine_listening and self.engine is not None and self._engine_listens():
            self.engine_listening = True
            log.info("%s listening on %s", self.engine.name, self.address)
        if self.engine_listening and self.stopping_since is None:
            if not self.announced:
                self.announced = True
                log.info("fishgate serving on http://%s:%d with %d gateway processes on the engine at %s (demo page "
                         "at /, API under /v1)", self.settings.host, self.gateway_settings.port, len(self.gateways),
                         self.address)  # fmt: skip
            self._start_due()
        if self.stopping_since is not None:
            self._stop_in_order()
        elif self.engine is not None and not self.engine_listening and self._engine_late():
            log.critical("the engine child did not listen on %s within %.0f s; stopping", self.address,
                         ENGINE_LISTEN_TIMEOUT_S)  # fmt: skip
            self._begin_stop(EXIT_ENGINE_FAULT)

    def _start_due(self) -> None:
        now = time.monotonic()
        for slot, child in self.gateways.items():
            if child is None and self.restart_at.get(slot, now) <= now:
                self.restart_at.pop(slot, None)
                self.gateways[slot] = self._spawn("gateway", slot)
        if self.own_engine and self.engine is None and self.restart_at.get(0, now) <= now:
            self.restart_at.pop(0, None)
            self.engine = self._spawn("engine", 0)

    def _exited(self, child: _Child, code: int) -> None:
        child.release()
        if child.role == "gateway":
            self.gateways[child.slot] = None
            multiprocess.mark_process_dead(child.proc.pid, str(self.metrics_dir))  # its live gauges leave the sums
        else:
            self.engine = None
        how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with status {code}"
        if self.stopping_since is not None:
            log.info("%s %s", child.name, how)
            return
        lived_s = time.monotonic() - child.started_s
        if code == EXIT_CONFIG_ERROR:
            log.critical("%s refused its configuration (see its log above); stopping", child.name)
            self._begin_stop(EXIT_CONFIG_ERROR)
        elif child.role == "engine" and code == 0:
            log.warning("%s stopped (it was told to); stopping the gateways", child.name)
            self._begin_stop(0)
        elif child.role == "engine" and not self.engine_listening:
            log.critical("%s %s before it listened; stopping", child.name, how)
            self._begin_stop(EXIT_ENGINE_FAULT)
        else:
            delay = self.backoff[child.slot].after_death(lived_s)
            self.restart_at[child.slot] = time.monotonic() + delay
            also = "; gateways answer engine_unavailable until it is back" if child.role == "engine" else ""
            level = logging.INFO if code == 0 else logging.WARNING
            log.log(level, "%s %s after %.1f s; starting another in %.1f s%s", child.name, how, lived_s, delay, also)

    # ---- stopping --------------------------------------------------------------------------------------------------
    def _begin_stop(self, status: int) -> None:
        if self.stopping_since is not None:
            return
        self.status = status
        self.stopping_since = time.monotonic()
        self.restart_at.clear()
        for child in self.gateways.values():
            if child is not None:
                child.release()  # each drains: readiness false, running utterances finish, sockets close (1012)

    def _stop_in_order(self) -> None:
        """Gateways first (they drain); then the engine child, which then has nothing left to drain."""
        assert self.stopping_since is not None
        waited_s = time.monotonic() - self.stopping_since
        gateways = [c for c in self.gateways.values() if c is not None and c.proc.poll() is None]
        if gateways:
            if waited_s > self.settings.drain_grace_s + GATEWAY_STOP_EXTRA_S:
                for child in gateways:
                    log.warning("%s did not stop in time; killing it", child.name)
                    child.proc.kill()
                    child.proc.wait()
            return
        engine = self.engine
        if engine is None or engine.proc.poll() is not None:
            return
        if engine.control_w is not None:
            engine.release()
            self.engine_released_s = time.monotonic()
        elif time.monotonic() - self.engine_released_s > ENGINE_STOP_S:
            log.warning("%s did not stop in time; killing it", engine.name)
            engine.proc.kill()
            engine.proc.wait()

    def _kill_all(self) -> None:
        for child in self._children():
            if child.proc.poll() is None:
                child.proc.kill()
                child.proc.wait()
            child.release()

    # ---- children --------------------------------------------------------------------------------------------------
    def _spawn(self, role: str, slot: int) -> _Child:
        """A child `python -m server.worker_child ROLE SLOT`: its orders (pickled) on stdin, its control pipe by
        number."""
        control_r, control_w = os.pipe()
        try:
            command = [sys.executable, "-m", "server.worker_child", role, str(slot)]
            env = {**os.environ, MULTIPROCESS_DIR_ENV: str(self.metrics_dir)} if role == "gateway" else None
            proc = subprocess.Popen(command, stdin=subprocess.PIPE, pass_fds=(control_r,), env=env)
        except BaseException:
            os.close(control_w)
            raise
        finally:
            os.close(control_r)  # the child has its copy; its end closes only with the child
        settings = self.settings if role == "engine" else self.gateway_settings
        job = {"settings": settings, "address": self.address, "control_fd": control_r}
        assert proc.stdin is not None
        with contextlib.suppress(BrokenPipeError), proc.stdin:  # a child that died at once: handled as any exit
            proc.stdin.write(pickle.dumps(job))
        child = _Child(role, slot, proc, control_w, time.monotonic())
        log.info("%s started", child.name)
        return child

    def _engine_late(self) -> bool:
        return self.engine is not None and time.monotonic() - self.engine.started_s > ENGINE_LISTEN_TIMEOUT_S

    def _engine_listens(self) -> bool:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            try:
                probe.connect(self.address.removeprefix("unix:"))
            except OSError:
                return False
        return True

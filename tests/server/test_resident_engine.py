"""A resident engine process (`fishgate engine --listen unix:PATH`) with gateways attached (`fishgate serve --engine`):
stale socket takeover and refusal of a second engine, a gateway answering within 3 s of its launch, a killed gateway's
sessions closed on the engine, the engine's death seen by every client at once and recovery, SIGTERM's drain.

The engine and one gateway are real processes (killed with SIGKILL as a crash would); a second gateway runs in this
process (tests/server/conftest.start_server) so its engine view can be read directly. Tests run in file order on one
engine process per module (the death test restarts it, the drain test ends it)."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from streaming.engine_link.protocol import PROTOCOL_VERSION, FrameDecoder, Op, frame
from tests.server.conftest import ServerHandle, free_port, start_server
from tests.server.live_client import LiveClient, LiveResult, open_live

FISHGATE = [sys.executable, "-m", "server.cli"]
ENGINE_READY_S = 90.0
GATEWAY_ANSWERS_WITHIN_S = 3.0  # the figure: a gateway restart costs this much at most
NOT_READY_WITHIN_S = 2.0
LONG_TEXT = "A sentence that is long enough to keep the engine busy while something happens to it. " * 3
TTS = {"text": "Hello there.", "format": "wav"}


def engine_state(path: Path) -> str | None:
    """The engine's state as a gateway hears it on attaching; None when nobody answers at `path`."""
    try:
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(2.0)
            s.connect(str(path))
            s.sendall(frame([Op.HELLO, PROTOCOL_VERSION, "test probe"]))
            decoder = FrameDecoder()
            while data := s.recv(65536):
                for m in decoder.feed(data):
                    if m[0] == Op.WELCOME:
                        return m[5]
    except OSError:
        pass
    return None


@dataclass
class Resident:
    folder: Path
    procs: list[subprocess.Popen] = field(default_factory=list)

    @property
    def path(self) -> Path:
        return self.folder / "engine.sock"

    @property
    def address(self) -> str:
        return f"unix:{self.path}"

    @property
    def proc(self) -> subprocess.Popen:
        return self.procs[-1]

    def log(self, proc: subprocess.Popen | None = None) -> str:
        return (self.folder / f"engine-{(proc or self.proc).pid}.log").read_text()

    def start(self) -> subprocess.Popen:
        """A new engine process on the path; returns once it is ready."""
        log_file = open(self.folder / "engine.tmp.log", "wb")  # noqa: SIM115 - renamed once the pid is known
        proc = subprocess.Popen([*FISHGATE, "engine", "--listen", self.address], stdout=log_file, stderr=log_file)
        log_file.close()
        (self.folder / "engine.tmp.log").rename(self.folder / f"engine-{proc.pid}.log")
        self.procs.append(proc)
        deadline = time.monotonic() + ENGINE_READY_S
        while engine_state(self.path) != "ready":
            assert proc.poll() is None, self.log(proc)
            assert time.monotonic() < deadline, "the engine never became ready"
            time.sleep(0.05)
        return proc


@pytest.fixture(scope="module")
def resident() -> Iterator[Resident]:
    r = Resident(Path(tempfile.mkdtemp(prefix="fg-res-")))  # short: a Unix socket's path has at most 107 bytes
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(r.path))
    stale.close()  # bound and never removed: what a killed engine leaves behind
    try:
        r.start()
        yield r
    finally:
        for proc in r.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        shutil.rmtree(r.folder, ignore_errors=True)


@pytest.fixture(scope="module")
def observer(resident, tmp_path_factory) -> Iterator[ServerHandle]:
    """A gateway in this process attached to the resident engine."""
    with start_server(tmp_path_factory.mktemp("observer"), engine=resident.address) as handle:
        yield handle


def spawn_gateway(resident: Resident, folder: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "FISHGATE_REFERENCES_DIR": str(folder / "refs"), "FISHGATE_LOG_LEVEL": "warning"}
    proc = subprocess.Popen([*FISHGATE, "serve", "--engine", resident.address, "--port", str(port)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    return proc, f"http://127.0.0.1:{port}"


def test_a_gateway_with_an_engine_address_never_imports_torch() -> None:
    """What keeps its start short: torch's import alone takes ~1.5 s on a 2-core CPU."""
    code = (
        "import sys; sys.modules['torch'] = None\n"  # any `import torch` now fails
        "from server.app import build_gateway, create_app\n"
        "from server.settings import parse_settings\n"
        "gw = build_gateway(parse_settings(['--engine', 'unix:/nonexistent/engine.sock'], {}))\n"
        "create_app(gw.settings, gw)\n"
        "print(type(gw.engine).__name__, gw.engine.state.value)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["RemoteEngine", "engine_unavailable"]


def test_the_engine_took_over_a_stale_socket_and_a_second_engine_is_refused(resident) -> None:
    assert f"took over the stale socket unix:{resident.path}" in resident.log()
    t0 = time.monotonic()
    second = subprocess.run([*FISHGATE, "engine", "--listen", resident.address], check=False, capture_output=True,
                            text=True, timeout=60)  # fmt: skip
    last = (second.stdout + second.stderr).strip().splitlines()[-1]
    assert second.returncode == 2, last
    assert f"already listening on unix:{resident.path}" in last and "could not start" in last, last
    assert time.monotonic() - t0 < 10  # refused before any model loads
    assert engine_state(resident.path) == "ready"  # the first one is untouched


def test_a_gateway_answers_within_3_s_of_its_launch_and_its_death_frees_its_sessions(
    resident, observer, tmp_path
) -> None:
    launched = time.monotonic()
    gateway, base = spawn_gateway(resident, tmp_path)
    try:
        while True:
            try:
                answer = httpx.post(f"{base}/v1/tts", json=TTS, timeout=10)
                if answer.status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert gateway.poll() is None and time.monotonic() - launched < 30, "the gateway never answered"
            time.sleep(0.02)
        answered_s = time.monotonic() - launched
        assert answer.content[:4] == b"RIFF" and len(answer.content) > 44

        async def turn_then_kill():
            async with open_live(f"{base.replace('http', 'ws')}/v1/tts/live") as ws:
                client = LiveClient(ws)
                await client.start(seed=3)
                await client.send({"event": "text", "text": LONG_TEXT})
                await client.send({"event": "flush"})
                await client.read_until(LiveResult(), ("audio",))
                engine = observer.gateway.engine
                await until(lambda: engine.stats().get("sessions") == 1, "the engine never counted the session")
                gateway.kill()  # SIGKILL: no goodbye, the kernel closes its socket
                killed = time.monotonic()
                await until(lambda: engine.stats().get("sessions") == 0, "the dead gateway's session stayed open")
                await until(lambda: engine.stats().get("decoding") == 0, "its row still decodes")
                return time.monotonic() - killed

        freed_s = asyncio.run(turn_then_kill())
    finally:
        if gateway.poll() is None:
            gateway.kill()
        gateway.wait()
    assert answered_s < GATEWAY_ANSWERS_WITHIN_S, answered_s
    assert freed_s < 3.0, freed_s  # the engine's counters reach the observer once a second


async def until(check, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.02)


def test_engine_death_reaches_every_client_at_once_and_the_gateway_recovers(resident, observer) -> None:
    base = observer.base_url

    async def main():
        async with httpx.AsyncClient(base_url=base, timeout=10) as http, open_live(observer.ws_url) as ws:
            client = LiveClient(ws)
            await client.start(seed=4)
            await client.send({"event": "text", "text": LONG_TEXT})
            await client.send({"event": "flush"})
            result = await client.read_until(LiveResult(), ("audio",))
            resident.proc.kill()
            killed = time.monotonic()
            while (ready := await http.get("/readyz")).status_code == 200:
                assert time.monotonic() - killed < 5, "readiness never went false"
                await asyncio.sleep(0.02)
            not_ready_s = time.monotonic() - killed
            await client.read_until(result)  # the turn's finish
            t0 = time.monotonic()
            refused = await http.post("/v1/tts", json=TTS)
            refused_s = time.monotonic() - t0
            resident.start()  # takes over the dead engine's socket
            restarted = time.monotonic()
            await until(lambda: observer.gateway.engine.ready, "the gateway never found the engine again")
            found_s = time.monotonic() - restarted
            served = await http.post("/v1/tts", json=TTS)
            # the live socket stays open for the next turn, which the new engine serves
            await client.start(seed=4)
            await client.send({"event": "text", "text": "Back again."})
            await client.send({"event": "stop"})
            after = await client.read_until(LiveResult())
            return ready, not_ready_s, result, refused, refused_s, found_s, served, after

    ready, not_ready_s, result, refused, refused_s, found_s, served, after = asyncio.run(main())
    assert ready.status_code == 503 and ready.json() == {"ready": False, "state": "engine_unavailable"}
    assert not_ready_s < NOT_READY_WITHIN_S, not_ready_s
    assert result.error_codes == ["engine_unavailable"], result.events
    assert result.events[-2]["event"] == "error" and result.events[-1] == {"event": "finish", "reason": "error"}
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "engine_unavailable"
    assert refused_s < 0.5, refused_s
    assert found_s < 1.5, found_s  # retries at most a second apart
    assert served.status_code == 200 and served.content[:4] == b"RIFF"
    assert after.events[-1] == {"event": "finish", "reason": "stop"} and len(after.audio) > 0


def test_sigterm_drains_the_engine_then_it_exits_and_removes_its_socket(resident, observer) -> None:
    async def main():
        async with httpx.AsyncClient(base_url=observer.base_url, timeout=10) as http, open_live(observer.ws_url) as ws:
            client = LiveClient(ws)
            await client.start(seed=6)
            await client.send({"event": "text", "text": LONG_TEXT})
            await client.send({"event": "flush"})
            result = await client.read_until(LiveResult(), ("audio",))
            resident.proc.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            while (ready := await http.get("/readyz")).status_code == 200:
                assert time.monotonic() - signalled < 5, "readiness never went false"
                await asyncio.sleep(0.02)
            refused = await http.post("/v1/tts", json=TTS)  # no new sessions while it drains
            await client.send({"event": "stop"})
            await client.read_until(result)  # the running utterance finishes whole
            return ready, refused, result

    ready, refused, result = asyncio.run(main())
    assert ready.json() == {"ready": False, "state": "draining"}
    assert refused.status_code == 503
    assert result.events[-1] == {"event": "finish", "reason": "stop"} and not result.error_codes
    assert resident.proc.wait(timeout=30) == 0
    assert not resident.path.exists()

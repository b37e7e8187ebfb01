"""`fishgate serve --workers 2`: one engine child and two gateway processes on one port, as real processes.

Requests reach both gateways (each scrape's `fishgate_gateway_info` names the process that answered); a killed gateway
leaves the other's live stream untouched and is replaced; a killed engine child is restarted while the gateways say
engine_unavailable; SIGTERM drains, exits 0 and leaves no process behind. Tests run in file order on one server per
module (the last one stops it). Processes are found in /proc (Linux, as --workers itself).
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import free_port
from tests.server.live_client import LiveClient, LiveResult, open_live

READY_S = 90.0
LONG_TEXT = "A sentence that is long enough to keep the engine busy while something happens to it. " * 3
TTS = {"text": "Hello there.", "format": "wav"}
GATEWAY_PID = re.compile(r'fishgate_gateway_info\{pid="(\d+)"\}')

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="--workers needs Linux")


def children_of(pid: int) -> dict[int, str]:
    """{pid: command line} of the live processes whose parent is `pid`."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == pid and fields[0] != "Z":
                found[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, IndexError, ValueError):
            continue  # it exited while we looked
    return found


def alive(pid: int) -> bool:
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def socket_owner(server_port: int, client_port: int, pids: list[int]) -> int | None:
    """Which of `pids` holds the server side of the TCP connection 127.0.0.1:client_port → :server_port."""
    inode = None
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        parts = line.split()
        local, remote = int(parts[1].split(":")[1], 16), int(parts[2].split(":")[1], 16)
        if local == server_port and remote == client_port:
            inode = parts[9]
    for pid in pids:
        for fd in (Path("/proc") / str(pid) / "fd").iterdir():
            try:
                if os.readlink(fd) == f"socket:[{inode}]":
                    return pid
            except OSError:
                continue
    return None


@dataclass
class Workers:
    proc: subprocess.Popen[bytes]
    port: int
    log_path: Path

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/v1/tts/live"

    def log(self) -> str:
        return self.log_path.read_text()

    def children(self, role: str) -> list[int]:
        return sorted(pid for pid, cmd in children_of(self.proc.pid).items() if f"server.worker_child {role}" in cmd)

    def gateway_pids_answering(self, want: set[int], tries: int = 60) -> set[int]:
        """Scrape /metrics on fresh connections until every pid in `want` answered (or `tries` scrapes)."""
        seen: set[int] = set()
        for _ in range(tries):
            with httpx.Client(base_url=self.base, timeout=10) as http:  # a new connection each time
                seen.update(int(p) for p in GATEWAY_PID.findall(http.get("/metrics").text))
            if want <= seen:
                break
        return seen

    def wait_ready(self) -> None:
        deadline = time.monotonic() + READY_S
        while True:
            assert self.proc.poll() is None, self.log()
            assert time.monotonic() < deadline, "the server never became ready:\n" + self.log()
            try:
                if httpx.get(f"{self.base}/readyz", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)


@pytest.fixture(scope="module")
def workers() -> Iterator[Workers]:
    folder = Path(tempfile.mkdtemp(prefix="fg-wk-"))
    port = free_port()
    env = {**os.environ, "FISHGATE_REFERENCES_DIR": str(folder / "refs"), "FISHGATE_LOG_LEVEL": "info",
           "FISHGATE_DRAIN_GRACE_S": "20"}  # fmt: skip
    with open(folder / "serve.log", "wb") as log_file:
        proc = subprocess.Popen([sys.executable, "-m", "server.cli", "serve", "--workers", "2", "--port", str(port)],
                                env=env, stdout=log_file, stderr=log_file, start_new_session=True)  # fmt: skip
    w = Workers(proc, port, folder / "serve.log")
    try:
        w.wait_ready()
        yield w
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # the whole group: the parent and every child
        proc.wait()
        shutil.rmtree(folder, ignore_errors=True)


async def speak(client: LiveClient, seed: int, text: str = LONG_TEXT) -> LiveResult:
    """Start a turn and read up to its first audio."""
    await client.start(seed=seed)
    await client.send({"event": "text", "text": text})
    await client.send({"event": "flush"})
    return await client.read_until(LiveResult(), ("audio",))


def test_two_gateways_serve_http_and_live_turns_on_one_port(workers) -> None:
    engines, gateways = workers.children("engine"), workers.children("gateway")
    assert len(engines) == 1 and len(gateways) == 2, children_of(workers.proc.pid)
    address = re.search(r"listening on unix:(\S+)", workers.log())
    assert address is not None
    runtime = Path(address.group(1)).parent
    assert stat.S_IMODE(runtime.stat().st_mode) == 0o700  # the engine's socket is this user's alone

    assert workers.gateway_pids_answering(set(gateways)) == set(gateways)  # the kernel spreads connections
    answer = httpx.post(f"{workers.base}/v1/tts", json=TTS, timeout=60)
    assert answer.status_code == 200 and answer.content[:4] == b"RIFF"
    health = httpx.get(f"{workers.base}/healthz", timeout=10).json()
    assert health["engine"] == "ready" and health["max_sessions"] == 8  # the engine child's, shared

    async def turn() -> LiveResult:
        async with open_live(workers.ws_url) as ws:
            client = LiveClient(ws)
            result = await speak(client, seed=1, text="Hello from a gateway process.")
            await client.send({"event": "stop"})
            return await client.read_until(result)

    result = asyncio.run(turn())
    assert result.events[-1] == {"event": "finish", "reason": "stop"} and not result.error_codes
    assert len(result.audio) > 0


def test_any_gateway_scraped_reports_every_gateways_metrics(workers) -> None:
    def scrape() -> tuple[int, float, float]:
        with httpx.Client(base_url=workers.base, timeout=10) as http:  # a new connection: any gateway may answer
            text = http.get("/metrics").text
        pid = int(GATEWAY_PID.findall(text)[0])
        requests = sum(float(v) for v in re.findall(r'^fishgate_http_synthesis_total\{api="fish"\} (\S+)$', text, re.M))
        processes = float(re.search(r"^fishgate_gateway_processes (\S+)$", text, re.M).group(1))
        return pid, requests, processes

    _, before, _ = scrape()
    answered: set[int] = set()
    for _ in range(6):  # fresh connections: the kernel spreads them over both gateways
        with httpx.Client(base_url=workers.base, timeout=60) as http:
            assert http.post("/v1/tts", json={**TTS, "text": "One."}).status_code == 200
    for _ in range(40):
        pid, requests, processes = scrape()
        answered.add(pid)
        assert requests == before + 6 and processes == 2  # the same totals whichever gateway answers
        if len(answered) == 2:
            break
    assert len(answered) == 2


def test_a_killed_gateway_leaves_the_others_streams_alone_and_is_replaced(workers) -> None:
    gateways = workers.children("gateway")

    async def main() -> tuple[LiveResult, int, int]:
        async with open_live(workers.ws_url) as ws:
            client = LiveClient(ws)
            result = await speak(client, seed=2)
            serving = socket_owner(workers.port, ws.local_address[1], gateways)
            assert serving is not None, "no gateway holds the connection"
            (other,) = set(gateways) - {serving}
            os.kill(other, signal.SIGKILL)
            await client.send({"event": "stop"})
            return await client.read_until(result), serving, other

    result, serving, killed = asyncio.run(main())
    assert result.events[-1] == {"event": "finish", "reason": "stop"} and not result.error_codes, result.events
    assert len(result.audio) > 0 and alive(serving)
    deadline = time.monotonic() + 30
    while len(now := workers.children("gateway")) < 2 or killed in now:
        assert time.monotonic() < deadline, "the killed gateway was not replaced:\n" + workers.log()
        time.sleep(0.05)
    (replacement,) = set(now) - {serving}
    assert workers.gateway_pids_answering({replacement}) >= {replacement}  # and it serves
    assert f"[pid {killed}] was killed by SIGKILL" in workers.log()


def test_a_killed_engine_child_is_restarted_while_gateways_say_engine_unavailable(workers) -> None:
    (engine,) = workers.children("engine")
    os.kill(engine, signal.SIGKILL)
    killed = time.monotonic()
    while (ready := httpx.get(f"{workers.base}/readyz", timeout=10)).status_code == 200:
        assert time.monotonic() - killed < 5, "readiness never went false"
        time.sleep(0.02)
    assert ready.json() == {"ready": False, "state": "engine_unavailable"}
    workers.wait_ready()  # a new engine child, found by both gateways
    (restarted,) = workers.children("engine")
    assert restarted != engine
    answer = httpx.post(f"{workers.base}/v1/tts", json=TTS, timeout=60)
    assert answer.status_code == 200 and answer.content[:4] == b"RIFF"


async def readyz(http: httpx.AsyncClient) -> httpx.Response | None:
    """/readyz, or None where the gateway that held the kept-alive connection closed it unanswered: a gateway with no
    session open ends its drain at once, and a request it had not read yet is lost as on any HTTP server that exits
    (the next one goes to a gateway still listening)."""
    try:
        return await http.get("/readyz")
    except (httpx.RemoteProtocolError, httpx.ReadError):  # closed, or reset
        return None


def test_sigterm_drains_then_everything_exits_0(workers) -> None:
    children = list(children_of(workers.proc.pid))
    address = re.search(r"listening on unix:(\S+)", workers.log())
    assert address is not None and len(children) == 3, children

    async def main() -> tuple[httpx.Response, LiveResult]:
        async with httpx.AsyncClient(base_url=workers.base, timeout=10) as http, open_live(workers.ws_url) as ws:
            client = LiveClient(ws)
            result = await speak(client, seed=3)
            workers.proc.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            while (ready := await readyz(http)) is None or ready.status_code == 200:
                assert time.monotonic() - signalled < 5, "readiness never went false"
                await asyncio.sleep(0.02)
            await client.send({"event": "stop"})
            await client.read_until(result)  # the running utterance finishes whole
            await client.read_until(result)  # then the server closes the socket
            return ready, result

    ready, result = asyncio.run(main())
    assert ready.json() == {"ready": False, "state": "draining"}
    assert result.events[-1] == {"event": "finish", "reason": "stop"} and not result.error_codes
    assert result.close_code == 1012, (result.close_code, result.close_reason)
    assert workers.proc.wait(timeout=40) == 0, workers.log()
    assert not [pid for pid in children if alive(pid)]  # no orphan: the engine child and both gateways are gone
    assert not Path(address.group(1)).parent.exists()  # the runtime folder too

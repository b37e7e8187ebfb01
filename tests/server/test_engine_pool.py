"""Engines over TCP with a token, and a gateway's pool of them: two real `fishgate engine --listen tcp:127.0.0.1:0`
processes on the embedded default model (their ports read from their logs), a gateway in this process with
`--engine A,B` (tests/server/conftest.start_server), and EnginePool's `set_addresses` in this test's own loop.

Covers: the bound port logged, a wrong token refused with its fix, a non-loopback listen without a token and a taken
port refused (exit 2), sessions spread over both engines by headroom, an engine killed (SIGKILL) mid-turn — its
turns end `engine_unavailable`, the other's go on, /readyz stays 200 with one engine of two — and restarted (used
again), and engines added to and removed from a running pool. Tests run in file order on one pair of engine
processes per module (the death test kills and restarts one)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
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

from streaming.engine_link.client import RemoteEngine
from streaming.engine_link.pool import EnginePool
from streaming.engine_link.protocol import PROTOCOL_VERSION, FrameDecoder, Op, frame
from streaming.session import SynthesisSettings, Voice
from tests.server.conftest import start_server
from tests.server.live_client import LiveClient, LiveResult, open_live
from tests.streaming.engine_helpers import EVENT_TIMEOUT_S, collect

FISHGATE = [sys.executable, "-m", "server.cli"]
TOKEN = "pool-test-token"
ENGINE_READY_S = 90.0
LISTENING = re.compile(r"fishgate engine listening on tcp:127\.0\.0\.1:(\d+)")
LONG_TEXT = "A sentence that is long enough to keep the engine busy while something happens to it. " * 3
LONG = SynthesisSettings(seed=5, max_new_tokens=400)
TTS = {"text": "Hello there.", "format": "wav"}


def engine_state(port: int, token: str | None = TOKEN) -> str | None:
    """The engine's state as a gateway hears it on attaching over TCP; None when nobody answers or it refuses."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2.0) as s:
            s.sendall(frame([Op.HELLO, PROTOCOL_VERSION, "test probe", token]))
            decoder = FrameDecoder()
            while data := s.recv(65536):
                for m in decoder.feed(data):
                    if m[0] == Op.WELCOME:
                        return m[5]
                    if m[0] == Op.REFUSED:
                        return None
    except OSError:
        pass
    return None


@dataclass
class TcpEngine:
    folder: Path
    name: str
    port: int = 0  # 0 until the first start has logged the kernel's pick; restarts reuse it
    procs: list[subprocess.Popen] = field(default_factory=list)

    @property
    def address(self) -> str:
        return f"tcp:127.0.0.1:{self.port}"

    @property
    def proc(self) -> subprocess.Popen:
        return self.procs[-1]

    def log(self) -> str:
        return (self.folder / f"{self.name}-{len(self.procs)}.log").read_text()

    def launch(self) -> None:
        with open(self.folder / f"{self.name}-{len(self.procs) + 1}.log", "wb") as log_file:
            env = {**os.environ, "FISHGATE_ENGINE_TOKEN": TOKEN}
            self.procs.append(subprocess.Popen([*FISHGATE, "engine", "--listen", f"tcp:127.0.0.1:{self.port}"],
                                               env=env, stdout=log_file, stderr=log_file))  # fmt: skip

    def wait_ready(self) -> None:
        deadline = time.monotonic() + ENGINE_READY_S
        while not self.port and not (found := LISTENING.search(self.log())):
            assert self.proc.poll() is None and time.monotonic() < deadline, self.log()
            time.sleep(0.02)
        self.port = self.port or int(found.group(1))
        while engine_state(self.port) != "ready":
            assert self.proc.poll() is None and time.monotonic() < deadline, self.log()
            time.sleep(0.05)


@pytest.fixture(scope="module")
def engines() -> Iterator[tuple[TcpEngine, TcpEngine]]:
    folder = Path(tempfile.mkdtemp(prefix="fg-pool-"))
    pair = (TcpEngine(folder, "a"), TcpEngine(folder, "b"))
    try:
        for e in pair:
            e.launch()  # both load at once
        for e in pair:
            e.wait_ready()
        yield pair
    finally:
        for e in pair:
            for proc in e.procs:
                if proc.poll() is None:
                    proc.kill()
                proc.wait()
        shutil.rmtree(folder, ignore_errors=True)


async def until(check, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.02)


def test_a_tcp_engine_logs_its_port_and_refuses_a_wrong_token_with_the_fix(engines) -> None:
    a, _ = engines
    assert a.port > 0 and f"listening on {a.address}" in a.log()

    async def main():
        remote = RemoteEngine(a.address, token="not-the-token")
        remote.start()
        try:
            await until(lambda: remote.refused, "the engine never refused the wrong token")
            return remote.refused, remote.ready
        finally:
            remote.stop()

    refused, ready = asyncio.run(main())
    assert not ready and "set FISHGATE_ENGINE_TOKEN to the engine's token" in refused
    assert engine_state(a.port, token=None) is None  # no token: refused too
    assert "wrong or missing token" in a.log()


def test_listening_beyond_loopback_without_a_token_or_on_a_taken_port_exits_2(engines) -> None:
    a, _ = engines
    env = {k: v for k, v in os.environ.items() if k != "FISHGATE_ENGINE_TOKEN"}
    t0 = time.monotonic()
    out = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True}
    runs = [
        subprocess.Popen([*FISHGATE, "engine", "--listen", at], env=env, **out) for at in ("tcp:0.0.0.0:0", a.address)
    ]
    (open_code, open_out), (taken_code, taken_out) = [(p.wait(60), p.communicate()[0].strip()) for p in runs]
    assert time.monotonic() - t0 < 30  # refused before any model loads
    assert open_code == 2 and "needs a token: set FISHGATE_ENGINE_TOKEN" in open_out.splitlines()[-1], open_out
    assert taken_code == 2 and f"{a.address} is in use" in taken_out.splitlines()[-1], taken_out
    assert engine_state(a.port) == "ready"  # the engine holding the port is untouched


def test_set_addresses_links_new_engines_and_ends_the_sessions_of_dropped_ones(engines) -> None:
    a, b = engines

    async def main():
        pool = EnginePool([a.address], token=TOKEN)
        pool.start()
        try:
            await until(lambda: pool.ready, "the pool never became ready")
            session = await pool.admit(Voice(), LONG)
            session.speak(LONG_TEXT)
            await asyncio.wait_for(session.next_event(), EVENT_TIMEOUT_S)
            on_a = pool.engines[a.address].open_sessions
            pool.set_addresses([b.address])
            ended = await collect(session)  # at once: its engine left the pool
            members = list(pool.engines)
            await until(lambda: pool.ready, "the pool never linked the new engine")
            moved = await pool.admit(Voice(), LONG)
            on_b = pool.engines[b.address].open_sessions
            moved.close()
            pool.set_addresses([a.address, b.address])
            await until(lambda: pool.engines_ready == 2, "the pool never linked both engines")
            return on_a, ended, members, on_b, pool.stats()
        finally:
            pool.stop()

    on_a, ended, members, on_b, stats = asyncio.run(main())
    assert on_a == 1 and members == [b.address] and on_b == 1
    assert ended.errors and ended.errors[-1].code == "engine_unavailable" and ended.errors[-1].fatal
    assert stats["engines_ready"] == 2 and set(stats["engines"]) == {a.address, b.address}


async def open_turn(url: str, stack: contextlib.AsyncExitStack, seed: int) -> tuple[LiveClient, LiveResult]:
    """A live turn that is speaking (its first audio read)."""
    client = LiveClient(await stack.enter_async_context(open_live(url)))
    await client.start(seed=seed)
    await client.send({"event": "text", "text": LONG_TEXT})
    await client.send({"event": "flush"})
    return client, await client.read_until(LiveResult(), ("audio",))


def test_a_pool_spreads_sessions_by_headroom_and_outlives_an_engines_death(engines, tmp_path) -> None:
    a, b = engines
    with start_server(tmp_path, engine=f"{a.address},{b.address}", engine_token=TOKEN) as handle:
        pool = handle.gateway.engine
        assert isinstance(pool, EnginePool)

        def sessions_on(e: TcpEngine) -> int:
            return pool.engines[e.address].open_sessions

        async def main():
            async with contextlib.AsyncExitStack() as stack, httpx.AsyncClient(base_url=handle.base_url) as http:
                turns = await asyncio.gather(*(open_turn(handle.ws_url, stack, seed) for seed in range(4)))
                spread = (sessions_on(a), sessions_on(b))
                reading = [asyncio.create_task(c.read_until(r, ("finish",))) for c, r in turns]
                a.proc.kill()  # SIGKILL: the kernel resets its connections
                killed = time.monotonic()
                readiness = []
                while True:
                    ready = await http.get("/readyz")
                    readiness.append(ready.status_code)
                    if ready.json().get("engines") == {"ready": 1, "total": 2}:
                        break
                    assert time.monotonic() - killed < 5, ready.json()
                    await asyncio.sleep(0.02)
                # the dead engine's turns end; then each of the others speaks on
                await until(lambda: sum(t.done() for t in reading) >= spread[0], "the dead engine's turns went on")
                heard = [len(r.audio) for _, r in turns]
                await until(lambda: all(t.done() or len(r.audio) > n for t, (_, r), n in zip(reading, turns, heard)),
                            "the living engine's turns stopped speaking", timeout_s=30)  # fmt: skip
                ended = [t.done() for t in reading]
                for task in reading:
                    task.cancel()
                served = await http.post("/v1/tts", json=TTS, timeout=30)  # a new session: the living engine's
                for client, _ in turns:
                    await client.ws.close()
                await until(lambda: pool.open_sessions == 0, "the closed turns still hold sessions")
                a.launch()  # the same port again
                await asyncio.to_thread(a.wait_ready)
                await until(lambda: pool.engines_ready == 2, "the pool never found the restarted engine")
                again = [await open_turn(handle.ws_url, stack, seed) for seed in (7, 8)]  # one after the other
                used_again = (sessions_on(a), sessions_on(b))
                for client, _ in again:
                    await client.ws.close()
                return spread, readiness, ready.json(), [r for _, r in turns], ended, served, used_again

        spread, readiness, ready, results, ended, served, used_again = asyncio.run(main())
    assert spread[0] >= 1 and spread[1] >= 1 and sum(spread) == 4, spread  # both engines got sessions
    assert set(readiness) == {200} and ready == {"ready": True, "state": "ready", "engines": {"ready": 1, "total": 2}}
    assert sum(ended) == spread[0], [r.events[-2:] for r in results]  # exactly the dead engine's turns ended
    for result, done in zip(results, ended, strict=True):
        if done:
            assert result.error_codes == ["engine_unavailable"], result.events[-2:]
            assert result.events[-1] == {"event": "finish", "reason": "error"}
        else:
            assert not result.error_codes and result.events[-1]["event"] == "audio"
    assert served.status_code == 200 and served.content[:4] == b"RIFF"
    assert used_again == (1, 1)  # the second session went to the engine with more headroom: each holds one


def test_per_engine_metrics_are_labelled_by_address(engines, tmp_path) -> None:
    a, b = engines
    series = [f'fishgate_engine_replica{{engine="{e.address}",what="{what}"}}' for e in (a, b)
              for what in ("ready", "headroom", "sessions", "first_audio_utterances")]  # fmt: skip
    with start_server(tmp_path, engine=f"{a.address},{b.address}", engine_token=TOKEN) as handle:
        deadline = time.monotonic() + 10
        while not all(s in (text := httpx.get(f"{handle.base_url}/metrics", timeout=10).text) for s in series):
            assert time.monotonic() < deadline, [s for s in series if s not in text]  # counters: once a second
            time.sleep(0.1)
    assert 'fishgate_engine{what="engines_ready"} 2.0' in text
    assert f'fishgate_engine_replica{{engine="{a.address}",what="ready"}} 1.0' in text


def test_sigterm_drains_tcp_engines_and_they_exit_0(engines) -> None:
    for e in engines:
        e.proc.send_signal(signal.SIGTERM)
    for e in engines:
        assert e.proc.wait(timeout=30) == 0

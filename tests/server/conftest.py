"""A real `fishgate` server (uvicorn + the real engine on the embedded default model) on a free port, for tests.

`start_server(**overrides)` runs uvicorn in a background thread and waits for /readyz; module-scoped fixtures
share one server per test module. Clients in tests are the real ones: websockets, httpx, the official
fish-audio-sdk clients, the openai SDK, Chromium.
"""

from __future__ import annotations

import contextlib
import dataclasses
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import uvicorn

from server.app import build_gateway, create_app
from server.cli import uvicorn_config
from server.gateway import Gateway
from server.settings import Settings

READY_TIMEOUT_S = 120.0
SETTLE_TIMEOUT_S = 10.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerHandle:
    settings: Settings
    gateway: Gateway
    server: uvicorn.Server

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.settings.port}"

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.settings.port}/v1/tts/live"

    def vocoded_frames(self) -> int:
        """Code frames the engine has vocoded so far, read once no session is open (earlier work has settled).

        Tests compare the audio a client got with the difference of two readings: exact where a per-character
        bound on the random default model (which may sample its end token after a few frames) would be flaky.
        """
        engine = self.gateway.engine
        deadline = time.monotonic() + SETTLE_TIMEOUT_S
        while engine.stats()["sessions"] and time.monotonic() < deadline:
            time.sleep(0.01)
        return engine.stats()["vocoded_frames"]


@contextlib.contextmanager
def start_server(tmp_path: Path, **overrides) -> Iterator[ServerHandle]:
    settings = Settings(port=free_port(), references_dir=tmp_path / "references", **overrides)
    gateway = build_gateway(settings)
    app = create_app(settings, gateway)
    server = uvicorn.Server(uvicorn_config(gateway, app))
    thread = threading.Thread(target=server.run, name="uvicorn-test", daemon=True)
    thread.start()
    handle = ServerHandle(settings, gateway, server)
    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:
        try:
            if httpx.get(f"{handle.base_url}/readyz", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline or not thread.is_alive():
            server.should_exit = True
            raise RuntimeError(f"fishgate test server did not become ready: {gateway.engine.fault}")
        time.sleep(0.1)
    try:
        yield handle
    finally:
        server.should_exit = True
        thread.join(30)


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[ServerHandle]:
    with start_server(tmp_path_factory.mktemp("srv")) as handle:
        yield handle


API_KEY = "test-key-123"


@pytest.fixture(scope="module")
def secured_server(tmp_path_factory) -> Iterator[ServerHandle]:
    with start_server(tmp_path_factory.mktemp("sec"), api_key=(API_KEY,)) as handle:
        yield handle


def with_settings(handle: ServerHandle, **changes) -> Settings:
    return dataclasses.replace(handle.settings, **changes)

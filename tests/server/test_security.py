"""What a browser page on another site, a DNS-rebinding page, a key guesser and a log reader can do (nothing),
against real servers: origins on HTTP as well as WebSocket, `Origin: null`, the Host of a loopback-bound server,
rate limits that an unchecked key cannot reset, failed keys that spend the rate budget, keys kept out of the log,
and a key setting that holds no key."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import types
from pathlib import Path
from typing import Any

import httpx
import pytest

from server.cli import uvicorn_config
from server.connection_cap import UVICORN_BACKSTOP_EXTRA
from server.gateway import Gateway
from server.settings import Settings, parse_settings
from tests.server.conftest import API_KEY, ServerHandle, start_server
from tests.server.http_helpers import assert_error, clip
from tests.server.live_client import LiveClient, LiveResult, open_live

SHORT = "Hi there."


def tts(base: str, headers: dict[str, str] | None = None, **body) -> httpx.Response:
    return httpx.post(f"{base}/v1/tts", json={"text": SHORT, "format": "pcm", **body}, headers=headers, timeout=60)


def refused_live(url: str, **kwargs) -> LiveResult:
    async def main():
        async with open_live(url, **kwargs) as ws:
            return await LiveClient(ws).wait_closed(LiveResult())

    return asyncio.run(main())


def test_cross_site_http_requests_are_refused_not_only_hidden(server: ServerHandle) -> None:
    base = server.base_url
    evil = {"Origin": "https://evil.example"}
    # a "simple" request a foreign page can send without a preflight: refused before anything is done
    r = httpx.post(f"{base}/v1/tts", content=b'{"text": "hi"}', headers={**evil, "Content-Type": "text/plain"})
    assert_error(r, 403, "forbidden_origin", "--allowed-origins")
    files = {"audio": ("a.wav", clip(1.5), "audio/wav")}
    r = httpx.post(f"{base}/v1/references", data={"id": "victim", "text": "t"}, files=files, headers=evil)
    assert_error(r, 403, "forbidden_origin")
    assert not (server.settings.references_dir / "victim").exists()
    same_site = {"Origin": base}
    assert tts(base, same_site).status_code == 200  # the demo page's own requests
    assert tts(base, {"Origin": "http://localhost:5173"}).status_code == 200  # a local dev page


def test_origin_null_is_refused_unless_listed(server: ServerHandle, tmp_path) -> None:
    assert_error(tts(server.base_url, {"Origin": "null"}), 403, "forbidden_origin")
    r = refused_live(server.ws_url, origin="null")
    assert r.error_codes == ["forbidden_origin"] and r.close_code == 1008
    with start_server(tmp_path, allowed_origins=("null",)) as srv:
        assert tts(srv.base_url, {"Origin": "null"}).status_code == 200


def test_a_loopback_server_answers_only_requests_addressed_to_localhost(server: ServerHandle, tmp_path) -> None:
    rebound = {"Host": f"rebind.evil.example:{server.settings.port}"}
    assert_error(tts(server.base_url, rebound), 403, "forbidden_host", "--allowed-hosts")
    r = httpx.get(f"{server.base_url}/v1/references", headers=rebound)
    assert_error(r, 403, "forbidden_host")  # a same-origin GET sends no Origin: the Host is the only tell
    rebound_url = server.ws_url.replace("127.0.0.1", "rebind.evil.example")  # resolved to 127.0.0.1 below
    r = refused_live(rebound_url, host="127.0.0.1", port=server.settings.port, origin=f"http://{rebound['Host']}")
    assert r.error_codes == ["forbidden_host"] and r.close_code == 1008
    assert tts(server.base_url, {"Host": f"localhost:{server.settings.port}"}).status_code == 200
    with start_server(tmp_path, allowed_hosts=("tts.example.com",)) as srv:  # a reverse proxy's public name
        assert tts(srv.base_url, {"Host": "tts.example.com"}).status_code == 200
        assert_error(tts(srv.base_url, {"Host": "other.example.com"}), 403, "forbidden_host")


def test_an_unchecked_key_buys_no_fresh_rate_budget(tmp_path) -> None:
    with start_server(tmp_path, rate_limit_per_min=3) as srv:  # open: keys are not checked
        codes = [
            httpx.get(f"{srv.base_url}/v1/references", headers={"Authorization": f"Bearer k{i}"}).status_code
            for i in range(6)
        ]
        assert codes[:3] == [200] * 3 and codes[3:] == [429] * 3


def test_wrong_keys_spend_the_callers_rate_budget(tmp_path) -> None:
    with start_server(tmp_path, api_key=(API_KEY,), rate_limit_per_min=3) as srv:
        replies = [
            httpx.get(f"{srv.base_url}/v1/references", headers={"Authorization": f"Bearer guess{i}"}) for i in range(5)
        ]
        assert [r.status_code for r in replies] == [401, 401, 401, 429, 429]  # guessing is as slow as the rate limit
        assert_error(replies[-1], 429, "rate_limited")
        assert replies[-1].headers["retry-after"] == "1"  # a refusal to retry says when
        good = httpx.get(f"{srv.base_url}/v1/references", headers={"Authorization": f"Bearer {API_KEY}"})
        assert good.status_code == 200  # the right key has its own budget


def test_a_query_string_key_is_kept_out_of_the_log(secured_server: ServerHandle, caplog) -> None:
    with caplog.at_level(logging.INFO):
        assert httpx.get(f"{secured_server.base_url}/v1/references?api_key={API_KEY}").status_code == 200
        refused_live(f"{secured_server.ws_url}?api_key={API_KEY}&x=1", origin="https://evil.example")
    logged = [r.getMessage() for r in caplog.records if r.name.startswith("uvicorn")]
    assert any("api_key=***" in m for m in logged), logged
    assert not any(API_KEY in m for m in logged), logged


@pytest.mark.parametrize("value", [",", " ", " , "])
def test_a_key_setting_that_holds_no_key_is_refused(value: str) -> None:
    with pytest.raises(SystemExit, match="holds no key"):
        parse_settings(["--api-key", value])
    with pytest.raises(SystemExit, match="holds no key"):
        parse_settings([], {"FISHGATE_API_KEY": value})


def test_every_http_response_forbids_sniffing_framing_and_referrers(server: ServerHandle) -> None:
    for path in ("/", "/healthz", "/v1/references", "/no-such-page"):
        h = httpx.get(server.base_url + path).headers
        assert (h["x-content-type-options"], h["x-frame-options"], h["referrer-policy"]) == (
            "nosniff", "DENY", "no-referrer",
        ), path  # fmt: skip
        csp = h["content-security-policy"]
        assert "script-src 'self'" in csp and "connect-src 'self'" in csp and "'unsafe-inline'" not in csp, path


def test_a_refused_preflight_names_the_fix(server: ServerHandle) -> None:
    headers = {"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"}
    r = httpx.options(f"{server.base_url}/v1/tts", headers=headers)
    assert_error(r, 403, "forbidden_origin", "origin", "--allowed-origins")
    assert "access-control-allow-origin" not in r.headers


def test_connections_beyond_the_cap_get_503_and_the_server_recovers(tmp_path) -> None:
    """--max-connections: idle sockets cannot pile up without bound. With a cap of 3 and three open WebSockets that
    send nothing, a fourth socket and a plain HTTP request are answered 503 `overloaded` naming the flag, before
    any work; once one socket closes, requests are served again."""
    from websockets.exceptions import InvalidStatus
    from websockets.sync.client import connect

    with start_server(tmp_path, max_connections=3) as srv, contextlib.ExitStack() as stack:
        url = srv.ws_url
        sockets = [stack.enter_context(connect(url, open_timeout=10)) for _ in range(3)]
        refused_http = httpx.get(f"{srv.base_url}/healthz", timeout=10)
        assert_error(refused_http, 503, "overloaded", "--max-connections")
        assert refused_http.headers["retry-after"] == "1"
        with pytest.raises(InvalidStatus) as refused, connect(url, open_timeout=10):
            pass
        assert refused.value.response.status_code == 503 and b"--max-connections" in refused.value.response.body
        assert refused.value.response.headers["Retry-After"] == "1"
        sockets[0].close()
        for _ in range(50):  # the server notices the close within a moment
            if httpx.get(f"{srv.base_url}/healthz", timeout=10).status_code == 200:
                break
            time.sleep(0.1)
        else:
            pytest.fail("the server kept refusing after a connection closed")
        metrics = httpx.get(f"{srv.base_url}/metrics", timeout=10).text  # 2 sockets and this scrape
        assert 'fishgate_connections{what="open"} 3.0' in metrics and 'fishgate_connections{what="cap"} 3.0' in metrics


def test_idle_keep_alive_connections_meet_uvicorns_backstop_above_the_cap(tmp_path) -> None:
    """TCP connections that send no request are not counted by the app's cap; uvicorn's limit, the cap +
    UVICORN_BACKSTOP_EXTRA, bounds them: past it a request gets uvicorn's 503, and once they go, service returns."""
    import socket

    with start_server(tmp_path, max_connections=3) as srv:
        port = int(srv.base_url.rsplit(":", 1)[1])
        idle = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(3 + UVICORN_BACKSTOP_EXTRA)]
        try:
            time.sleep(0.3)  # the server has accepted them all
            assert httpx.get(f"{srv.base_url}/healthz", timeout=10).status_code == 503
        finally:
            for sock in idle:
                sock.close()
        for _ in range(50):
            if httpx.get(f"{srv.base_url}/healthz", timeout=10).status_code == 200:
                break
            time.sleep(0.1)
        else:
            pytest.fail("the server kept refusing after the idle connections closed")


def gateway_on(settings: Settings, engine: Any) -> Gateway:
    """A gateway over a stand-in engine that only says its sessions (`capacity`), which is all the cap reads."""
    return Gateway(settings, engine, voices=None)  # type: ignore[arg-type]  # the cap reads no voices


def test_the_connection_cap_defaults_to_the_session_cap_with_room_and_refuses_zero() -> None:
    assert parse_settings(["--max-sessions", "10"]).resolved_max_connections == 2 * 10 + 256
    assert parse_settings(["--max-connections", "40"]).resolved_max_connections == 40
    with pytest.raises(SystemExit, match="--max-connections must be at least 1"):
        parse_settings(["--max-connections", "0"])


def test_a_gateway_on_a_resident_engine_caps_connections_by_that_engines_sessions() -> None:
    """`serve --engine ADDR` alone: its own --max-sessions says nothing of the engine's (a 512-session engine behind
    a gateway capped at 2 x 8 + 256 refused every client past the 272nd); the cap follows what the engine says."""
    engine = types.SimpleNamespace(capacity=0)  # not attached yet
    gateway = gateway_on(parse_settings(["--engine", "unix:/tmp/fg-none.sock"]), engine)
    assert gateway.connection_cap == 2 * 8 + 256  # until the engine has said its sessions: the default profile's
    backstop = uvicorn_config(gateway, app=None)  # uvicorn's own limit, for idle keep-alive connections
    assert backstop.limit_concurrency == 2 * 8 + 256 + UVICORN_BACKSTOP_EXTRA
    engine.capacity = 512  # a throughput engine (or a pool's sum)
    assert gateway.connection_cap == 2 * 512 + 256
    assert backstop.limit_concurrency == 2 * 512 + 256 + UVICORN_BACKSTOP_EXTRA  # it follows, as the cap does
    fixed = gateway_on(parse_settings(["--engine", "unix:/tmp/fg-none.sock", "--max-connections", "40"]), engine)
    assert fixed.connection_cap == 40  # an explicit cap stands
    local = gateway_on(parse_settings(["--max-sessions", "10"]), engine)
    assert local.connection_cap == 2 * 10 + 256  # in-process engine


def test_workers_in_front_of_a_resident_engine_share_its_sessions_connection_cap() -> None:
    """`serve --workers 4 --engine ADDR`: each gateway follows the engine's sessions, its quarter of them, as `serve
    --engine` alone follows all of them; with its own engine child or an explicit cap, the cap is fixed up front."""
    from server.workers import _Supervisor

    def gateway_of(args: list[str]) -> Gateway:
        supervisor = _Supervisor(parse_settings(args), "unix:/tmp/fg-none.sock", 7860, own_engine=False,
                                 metrics_dir=Path("/tmp/fg-none"))  # fmt: skip
        return gateway_on(supervisor.gateway_settings, types.SimpleNamespace(capacity=512))

    attached = gateway_of(["--workers", "4", "--engine", "unix:/tmp/fg-none.sock"])
    assert attached.connection_cap == 2 * 128 + 256
    explicit = gateway_of(["--workers", "4", "--engine", "unix:/tmp/fg-none.sock", "--max-connections", "1000"])
    assert explicit.connection_cap == 250
    own = gateway_of(["--workers", "4", "--max-sessions", "10"])
    assert own.connection_cap == math.ceil((2 * 10 + 256) / 4)

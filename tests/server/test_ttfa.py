"""`fishgate ttfa`: playout/underrun accounting on known arrivals, byte counting, and full runs on a real server;
how it connects (deflate offered, one socket per worker across its requests, and both turned off)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
from matplotlib.image import imread
from websockets.asyncio.server import ServerConnection, serve

from server import ttfa
from server.cli import main
from server.ttfa import (
    CORPUS,
    ProbeConfig,
    RequestResult,
    SampleCounter,
    measure_request,
    run_level,
    simulate_playout,
    stream_tokens,
    unique_texts,
)
from server.ttfa_report import summarize
from streaming.audio_encoders import wav_header
from tests.server.conftest import ServerHandle, free_port
from tests.server.http_helpers import FRAME_SAMPLES

RATE_HZ = 44100
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
DEFLATE = "permessage-deflate"


@contextlib.contextmanager
def websocket_handshakes(handle: ServerHandle) -> Iterator[list[dict[str, str]]]:
    """The handshake headers of every WebSocket connection the running server takes meanwhile: a counting ASGI
    wrapper around its app (uvicorn reads `config.loaded_app` for each new connection)."""
    config = handle.server.config
    app = config.loaded_app
    seen: list[dict[str, str]] = []

    async def counting(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "websocket":
            seen.append({k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]})
        await app(scope, receive, send)

    config.loaded_app = counting
    try:
        yield seen
    finally:
        config.loaded_app = app


def offered_deflate(headers: dict[str, str]) -> bool:
    return DEFLATE in headers.get("sec-websocket-extensions", "")


# ---- accounting on synthetic arrivals -------------------------------------------------------------------------------
def test_playout_without_underruns() -> None:
    # 1000 Hz: chunks of 500 samples last 0.5 s; each arrives before the player needs it
    p = simulate_playout([(0.25, 500), (0.5, 500), (1.0, 500), (1.75, 500)], 1000)
    assert p.first_audio_s == 0.25 and p.audio_s == 2.0 and p.end_s == 2.25
    assert p.underruns == () and p.underrun_ms == 0.0
    assert p.chunk_gaps_ms == pytest.approx((250.0, 500.0, 750.0))


def test_playout_underruns_known_answers() -> None:
    # plays 1.0–1.5; chunk 2 arrives 2.0 (dry 0.5 s), plays 2.0–3.0; chunk 3 at 3.0 exactly (not an underrun),
    # plays 3.0–3.25; chunk 4 at 3.5 (dry 0.25 s); a header-only frame (0 samples) at 1.2 changes nothing
    arrivals = [(1.0, 500), (1.25, 0), (2.0, 1000), (3.0, 250), (3.5, 250)]
    p = simulate_playout(arrivals, 1000)
    assert p.first_audio_s == 1.0 and p.audio_s == 2.0 and p.end_s == 3.75
    assert [(u.at_s, u.gap_ms) for u in p.underruns] == [(1.5, 500.0), (3.25, 250.0)]
    assert p.underrun_ms == 750.0
    assert p.chunk_gaps_ms == (1000.0, 1000.0, 500.0)


def test_playout_no_audio() -> None:
    p = simulate_playout([(0.5, 0)], 1000)
    assert p.first_audio_s is None and p.end_s is None and p.audio_s == 0.0 and p.underruns == ()


def test_sample_counter_skips_wav_header_and_reads_its_rate() -> None:
    c = SampleCounter("wav", 44100)
    header = wav_header(24000)
    assert c.feed(header[:20]) == 0  # a header, even split across frames, is not audio
    assert c.feed(header[20:] + b"\x01") == 0  # half a sample
    assert c.feed(b"\x02" * 5) == 3
    assert c.sample_rate_hz == 24000
    pcm = SampleCounter("pcm", 16000)
    assert pcm.feed(b"\x00" * 7) == 3 and pcm.feed(b"\x00") == 1
    with pytest.raises(ValueError, match="pcm, wav"):
        SampleCounter("mp3", 44100)


def test_unique_texts_never_repeat() -> None:
    texts = unique_texts(CORPUS, 3 * len(CORPUS) ** 2, 0)
    assert len(set(texts)) == len(texts)
    assert unique_texts(CORPUS, 5, 10) == texts[10:15]
    assert unique_texts(["a", "b"], 6) == ["a", "b", "a b", "b a", "a Number 0.", "b Number 0."]


def test_stream_tokens_join_back() -> None:
    text = "  Hello there,  how are\nyou? "
    tokens = stream_tokens(text)
    assert "".join(tokens) == text and len(tokens) == 5


# ---- against the real server ----------------------------------------------------------------------------------------
def test_ttfa_cli_against_server(server: ServerHandle, tmp_path, capsys) -> None:
    before = server.vocoded_frames()
    out = tmp_path / "run"
    texts = tmp_path / "texts.txt"  # short texts keep the test fast; 5 lines for 8 requests exercises pairing
    texts.write_text("Good morning.\n\nSee you soon, Sam.\nIs it raining?\nTwo plus two is four.\nThanks a lot!\n")
    argv = ["ttfa", server.ws_url, "--concurrency", "1,4", "--requests", "4", "--texts", str(texts)]
    with websocket_handshakes(server) as handshakes:
        assert main([*argv, "--out", str(out), "--seed", "5"]) == 0
    captured = capsys.readouterr()
    assert "| conc |" in captured.out and captured.err.count("ttfa ") == 8  # one progress line per request
    negotiated = [DEFLATE] if server.server.config.ws_per_message_deflate else []  # `--ws-compression`
    assert ("deflate, reuse" if negotiated else "deflate refused, reuse") in captured.out  # how the client connected
    assert handshakes and all(offered_deflate(h) for h in handshakes)  # by default, as browsers and websockets do
    doc = json.loads((out / "ttfa.json").read_text())
    assert [lv["concurrency"] for lv in doc["levels"]] == [1, 4]
    requests = [r for lv in doc["levels"] for r in lv["requests"]]
    assert len(requests) == 8 and len({r["text"] for r in requests}) == 8
    for r in requests:
        assert r["error"] is None and r["finish_reason"] == "stop"
        assert 0 < r["ttfa_ms"] < 10_000
        # the player starts at the first audio byte and plays at least as long as the audio lasts
        assert r["playout_end_s"] >= r["ttfa_ms"] / 1000 + r["audio_s"] - 1e-9
        assert r["rtf"] > 0 and r["chunks"] >= 2 and r["arrivals"][0][0] * 1000 == pytest.approx(r["ttfa_ms"], abs=0.01)
        # cross-check with the server's own timing event (it starts at text receipt, ends after the audio send). The
        # server sends it between the first and the second audio frame, so it cannot exceed the second's arrival
        # (0.1 ms: its rounding); the client's figure adds the network and both loops' delays, bounded generously
        assert r["server_first_audio_ms"] <= r["arrivals"][1][0] * 1000 + 0.1
        assert r["ttfa_ms"] <= r["server_first_audio_ms"] + 5000
        # the untrained model speaks at most ~1.5 frames per character (it may sample its end token sooner)
        assert round(r["audio_s"] * RATE_HZ) % FRAME_SAMPLES == 0
        assert 4 <= r["audio_s"] * RATE_HZ / FRAME_SAMPLES <= 1.5 * len(r["text"]) + 8
    # every sample the engine vocoded arrived, and nothing else was counted as audio
    vocoded = server.vocoded_frames() - before
    assert sum(r["audio_s"] for r in requests) * RATE_HZ == pytest.approx(vocoded * FRAME_SAMPLES)
    for level in doc["levels"]:
        s = level["summary"]
        assert s["errors"] == 0 and s["ok"] == 4
        assert (s["compression"], s["sockets"], s["extensions"]) == ("deflate", "reuse", negotiated)
        assert s["connections"] == len([r for r in level["requests"] if r["fresh_connection"]]) >= level["concurrency"]
        assert s["ttfa_p50_ms"] <= s["ttfa_p95_ms"] <= s["ttfa_p99_ms"] <= s["ttfa_max_ms"]
    for name in ("ttfa_cdf.png", "underrun_timeline.png"):
        path = out / name
        assert path.read_bytes()[:8] == PNG_SIGNATURE
        image = imread(path)
        assert image.shape[0] > 200 and image.shape[1] > 400


def test_streamed_text_waits_for_the_sentence(server: ServerHandle) -> None:
    text = "The quick brown fox jumps over the lazy dog."  # one sentence: audio can start only after its last word
    config = ProbeConfig(url=server.ws_url, tokens_per_s=50.0, format="wav", sample_rate_hz=24000, seed=5)
    r = asyncio.run(measure_request(text, config))
    assert r.error is None and r.text_frames == len(stream_tokens(text)) == 9
    assert r.ttfa_ms is not None and r.ttfa_ms >= (r.text_frames - 1) / 50.0 * 1000
    assert r.sample_rate_hz == 24000 and r.audio_s > 0.1


def test_unreachable_server_is_an_error_not_a_hang() -> None:
    config = ProbeConfig(url=f"ws://127.0.0.1:{free_port()}/v1/tts/live", timeout_s=5.0)
    r = asyncio.run(measure_request("Hello.", config))
    assert r.error is not None and r.ttfa_ms is None and r.audio_s == 0.0


def test_ramp_spreads_the_first_requests_of_a_level(server: ServerHandle, monkeypatch) -> None:
    """--ramp-s: worker i starts i/N of the ramp after the first (a steady load instead of one burst). Each text goes
    out a word every 0.25 s, so no request ends (freeing its worker for the next text) before the ramp is over."""
    ramp_waits: dict[asyncio.Task, float] = {}  # each worker's first sleep (its own task) is its ramp wait

    class RecordingAsyncio:
        def __getattr__(self, name: str) -> Any:
            return getattr(asyncio, name)

        @staticmethod
        async def sleep(delay: float, *args: Any) -> Any:
            ramp_waits.setdefault(asyncio.current_task(), delay)
            return await asyncio.sleep(delay, *args)

    monkeypatch.setattr(ttfa, "asyncio", RecordingAsyncio())
    config = ProbeConfig(url=server.ws_url, seed=3, max_new_tokens=8, tokens_per_s=4.0, ramp_s=0.6)
    results = asyncio.run(run_level(["One two three.", "Four five six.", "Seven eight nine."], 3, config))
    assert [r.error for r in results] == [None, None, None]
    assert sorted(ramp_waits.values()) == pytest.approx([0.0, 0.2, 0.4])  # what was asked, not how long it took
    starts = sorted(r.started_s for r in results)  # results come in the order they end
    assert all(starts[i] >= 0.2 * i - 0.01 for i in range(3)), starts  # a sleep never ends early


def test_negative_ramp_is_refused(capsys) -> None:
    assert main(["ttfa", "--ramp-s", "-1"]) == 2
    assert "--ramp-s must be 0" in capsys.readouterr().err


# ---- how it connects ------------------------------------------------------------------------------------------------
def test_one_worker_runs_its_requests_on_one_socket(server: ServerHandle) -> None:
    """The default (LiveKit's pool): each worker's next `start` goes on the socket it read `finish` from; first audio
    is still timed from each request's first text frame. Fails while the server closes the socket after `finish`
    (then every request after the first is a reconnect)."""
    config = ProbeConfig(url=server.ws_url, seed=3, max_new_tokens=8)
    with websocket_handshakes(server) as handshakes:
        results = asyncio.run(run_level(["One two three.", "Four five six.", "Seven eight nine."], 1, config))
    assert [r.error for r in results] == [None, None, None]
    assert all(r.ttfa_ms is not None and r.audio_s > 0 for r in results)
    assert [r.reconnect for r in results] == [False, False, False]
    assert [r.fresh_connection for r in results] == [True, False, False]
    assert results[0].connect_ms is not None and results[1].connect_ms is None
    assert len(handshakes) == 1


def test_per_request_sockets_and_no_compression_from_the_command_line(server: ServerHandle, tmp_path, capsys) -> None:
    """`--compression off --sockets per-request`: the bare client (no extension offered, a connection per request)."""
    argv = ["ttfa", server.ws_url, "--requests", "3", "--max-new-tokens", "8", "--seed", "4", "--no-plots"]
    with websocket_handshakes(server) as handshakes:
        assert main([*argv, "--compression", "off", "--sockets", "per-request", "--out", str(tmp_path)]) == 0
    assert "off, per-request | 3 (0) |" in capsys.readouterr().out
    assert len(handshakes) == 3 and not any(offered_deflate(h) for h in handshakes)
    doc = json.loads((tmp_path / "ttfa.json").read_text())
    assert (doc["config"]["compression"], doc["config"]["sockets"]) == ("off", "per-request")
    s = doc["levels"][0]["summary"]
    assert (s["compression"], s["sockets"], s["extensions"], s["connections"], s["reconnects"]) == (
        "off", "per-request", [], 3, 0,
    )  # fmt: skip
    assert all(r["fresh_connection"] and r["connect_ms"] is not None for r in doc["levels"][0]["requests"])


def test_deflate_is_offered_by_default_and_not_when_off(server: ServerHandle) -> None:
    """What the websockets client negotiates (`ws.protocol.extensions`) with each setting."""
    negotiated = [DEFLATE] if server.server.config.ws_per_message_deflate else []
    with websocket_handshakes(server) as handshakes:
        on = asyncio.run(measure_request("Hello.", ProbeConfig(url=server.ws_url, seed=1, max_new_tokens=8)))
        off = asyncio.run(
            measure_request("Hello.", ProbeConfig(url=server.ws_url, seed=1, max_new_tokens=8, compression="off"))
        )
    assert on.error is None and off.error is None
    assert [offered_deflate(h) for h in handshakes] == [True, False]
    assert on.extensions == negotiated and off.extensions == []


class FakeFishServer:
    """A minimal Fish live server: for each `start` … `stop`, one audio frame and `finish`; then it closes the socket
    (`close_after_finish`, what fishgate did before sockets could be reused) or waits for the next `start`."""

    def __init__(self, close_after_finish: bool) -> None:
        self.close_after_finish = close_after_finish
        self.connections = 0

    async def handler(self, ws: ServerConnection) -> None:
        self.connections += 1
        async for raw in ws:
            if msgpack.unpackb(raw).get("event") != "stop":
                continue
            await ws.send(msgpack.packb({"event": "audio", "audio": b"\x00\x01" * 441}))
            await ws.send(msgpack.packb({"event": "finish", "reason": "stop"}))
            if self.close_after_finish:
                return

    async def run(self, texts: list[str], config: ProbeConfig) -> list[RequestResult]:
        port = free_port()
        async with serve(self.handler, "127.0.0.1", port):
            url = f"ws://127.0.0.1:{port}/v1/tts/live"
            return await run_level(texts, 1, dataclasses.replace(config, url=url))


@pytest.mark.parametrize("close_after_finish", [False, True])
def test_a_pooled_socket_the_server_closed_is_replaced_and_counted(close_after_finish: bool) -> None:
    fake = FakeFishServer(close_after_finish)
    results = asyncio.run(fake.run(["a", "b", "c", "d"], ProbeConfig(timeout_s=10.0)))
    assert [r.error for r in results] == [None] * 4 and all(r.audio_s == 441 / RATE_HZ for r in results)
    if close_after_finish:  # every request after the first finds its socket closed: a new one, counted
        assert fake.connections == 4
        assert [(r.fresh_connection, r.reconnect) for r in results] == [(True, False)] + [(True, True)] * 3
    else:
        assert fake.connections == 1
        assert [(r.fresh_connection, r.reconnect) for r in results] == [(True, False)] + [(False, False)] * 3
    summary = summarize(1, results)
    assert (summary["connections"], summary["reconnects"]) == (fake.connections, fake.connections - 1)

"""`/v1/tts/live` with a raw client: the protocol, its extensions, and every kind of bad input.

Each bad input gets a clear error (event or close code) naming the fix; the session or the server keeps serving;
after the abuse nothing leaks (sessions, decode rows, live-session gauge).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import socket
import time

import msgpack
import numpy as np
import pytest
import soundfile as sf
from websockets.exceptions import ConnectionClosed

from tests.server.conftest import API_KEY, ServerHandle, start_server
from tests.server.http_helpers import FRAME_SAMPLES
from tests.server.live_client import LiveClient, LiveResult, open_live, speak
from tests.streaming.engine_helpers import RANDOM_TINY_MODEL

TEXT = "Hello there. This is a test of the live protocol."


def run(coro):
    return asyncio.run(coro)


def wav_bytes(seconds: float, rate: int = 44100) -> bytes:
    t = np.arange(int(seconds * rate)) / rate
    buf = io.BytesIO()
    sf.write(buf, (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32), rate, format="WAV")
    return buf.getvalue()


async def session_with(server: ServerHandle, frames: list, json_mode: bool = False) -> LiveResult:
    """Send raw frames (bytes/str) or events (dicts), then read until the socket closes or 3 s of silence."""
    async with open_live(server.ws_url) as ws:
        client = LiveClient(ws, json_mode)
        with contextlib.suppress(ConnectionClosed):  # the server may close before every frame is sent
            for f in frames:
                if isinstance(f, dict):
                    await client.send(f)
                else:
                    await ws.send(f)
        result = LiveResult()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(client.wait_closed(result), 3.0)
        return result


# ---- the happy paths -----------------------------------------------------------------------------------------------
def test_msgpack_session_streams_audio_then_finishes(server: ServerHandle) -> None:
    before = server.vocoded_frames()
    r = run(speak(server.ws_url, ["Hello there, ", "this is a test. ", "Another sentence."]))
    kinds = [e["event"] for e in r.events]
    assert kinds[0] == "started" and kinds[-1] == "finish" and r.events[-1]["reason"] == "stop"
    assert "timing" in kinds and r.of("timing")[0]["first_audio_ms"] > 0
    assert r.close_code == 1000
    pcm = np.frombuffer(bytes(r.audio), dtype="<i2")
    # every sample the vocoder made arrived, nothing else (44.1 kHz pcm: no resampling)
    assert len(pcm) == (server.vocoded_frames() - before) * FRAME_SAMPLES > 0 and np.abs(pcm).max() > 100


def vocoded_seconds(server: ServerHandle, before: int) -> float:
    return (server.vocoded_frames() - before) * FRAME_SAMPLES / 44100


def test_json_session_gets_binary_audio_frames(server: ServerHandle) -> None:
    before = server.vocoded_frames()
    r = run(speak(server.ws_url, [TEXT], json_mode=True, format="wav", sample_rate=16000))
    assert r.events[-1] == {"event": "finish", "reason": "stop"}
    pcm, rate = sf.read(io.BytesIO(bytes(r.audio)), dtype="int16")
    assert rate == 16000 and len(pcm) > 0
    assert len(pcm) / rate == pytest.approx(vocoded_seconds(server, before), abs=0.01)  # the resampler's edge


@pytest.mark.parametrize("fmt", ["mp3", "opus", "wav"])
def test_each_format_decodes(server: ServerHandle, fmt: str) -> None:
    before = server.vocoded_frames()
    r = run(speak(server.ws_url, [TEXT], format=fmt))
    audio, rate = sf.read(io.BytesIO(bytes(r.audio)))
    assert rate == (48000 if fmt == "opus" else 44100) and len(audio) > 0
    # the decoded length is the vocoded audio's, give or take the codec's frame padding
    assert len(audio) / rate == pytest.approx(vocoded_seconds(server, before), abs=0.08)


def test_flush_speaks_buffered_text_before_stop(server: ServerHandle) -> None:
    async def main():
        async with open_live(server.ws_url) as ws:
            c = LiveClient(ws)
            await c.start()
            await c.send({"event": "text", "text": "no sentence end here"})
            await c.send({"event": "flush"})
            r = LiveResult()
            await c.read_until(r, ("timing",))  # audio arrives without stop
            await c.send({"event": "stop"})
            await c.wait_closed(r)
            return r

    r = run(main())
    assert r.of("timing") and r.events[-1]["reason"] == "stop"


def test_cancel_stops_audio_and_the_session_goes_on(server: ServerHandle) -> None:
    async def main():
        async with open_live(server.ws_url) as ws:
            c = LiveClient(ws)
            await c.start(max_new_tokens=2000)
            await c.send({"event": "text", "text": "A very long utterance that keeps going and going. " * 10})
            await c.send({"event": "flush"})
            first = LiveResult()
            await c.read_until(first, ("audio",))
            await c.send({"event": "cancel"})
            cancelled = LiveResult()
            await c.read_until(cancelled, ("cancelled",))
            at_cancel = server.gateway.engine.stats()
            await c.send({"event": "text", "text": "Short one after the cancel."})
            await c.send({"event": "stop"})
            after = LiveResult()
            await c.wait_closed(after)
            return cancelled, at_cancel, after

    cancelled, at_cancel, after = run(main())
    assert cancelled.of("cancelled")
    assert at_cancel["decoding"] == 0  # the engine stopped generating, not only the socket stopped getting audio
    assert after.events[-1]["reason"] == "stop" and len(after.audio) > 0
    # the cancelled utterance's audio stopped: far less than the ~750 frames it would have made
    assert len(cancelled.audio) < 200 * 2048 * 2


# ---- bad input -----------------------------------------------------------------------------------------------------
def test_non_msgpack_binary_closes_1007(server: ServerHandle) -> None:
    r = run(session_with(server, [b"\xc1\xc1 not msgpack"]))
    assert r.error_codes == ["invalid_payload"] and r.of("finish")[0]["reason"] == "error"
    assert r.close_code == 1007


def test_invalid_json_closes_1007(server: ServerHandle) -> None:
    r = run(session_with(server, ["{not json"], json_mode=True))
    assert r.error_codes == ["invalid_payload"] and r.close_code == 1007


def test_invalid_utf8_text_frame_closes_1007(server: ServerHandle) -> None:
    async def main():
        async with open_live(server.ws_url) as ws:
            await ws.send(b'{"event": "\xff\xfe"}', text=True)  # a text frame whose bytes are not UTF-8
            r = LiveResult()
            await LiveClient(ws, True).wait_closed(r)
            return r

    assert run(main()).close_code == 1007


def test_mixing_frame_types_closes_1003(server: ServerHandle) -> None:
    r = run(session_with(server, [msgpack.packb({"event": "start", "request": {"text": ""}}), '{"event":"stop"}']))
    assert "wrong_frame_type" in r.error_codes and r.close_code == 1003


def test_recoverable_mistakes_get_error_events_and_the_session_continues(server: ServerHandle) -> None:
    frames = [
        {"event": "text", "text": "before start"},  # text before start
        {"event": "dance"},  # unknown event
        {"event": "start"},  # start without request
        {"event": "start", "request": {"temperature": "hot"}},  # mistyped
        {"event": "start", "request": {"temperature": 3.0}},  # out of range
        {"event": "start", "request": {"format": "pcm", "sample_rate": 12345}},
        {"event": "start", "request": {"format": "aac"}},
        {"event": "start", "request": {"reference_id": "../../etc/passwd"}},  # path traversal
        {"event": "start", "request": {"reference_id": "nobody"}},  # unknown voice
        {"event": "start", "request": {"text": "", "format": "pcm"}},  # finally a good start
        {"event": "start", "request": {"text": "", "format": "pcm"}},  # start twice
        {"event": "text", "text": 42},  # mistyped text
        {"event": "text", "text": "x" * 20_001},  # over the text limit: its utterance fails...
        {"event": "text", "text": "This is dropped with it."},  # ...with the rest of its text,
        {"event": "flush"},  # until the client's next flush
        {"event": "text", "text": "And it still speaks."},
        {"event": "stop"},
    ]
    r = run(session_with(server, frames))
    codes = r.error_codes
    assert codes == [
        "not_started", "unknown_event", "bad_event", "value_out_of_range", "value_out_of_range",
        "value_out_of_range", "value_out_of_range", "value_out_of_range", "unknown_voice", "already_started",
        "bad_event", "text_too_long",
    ]  # fmt: skip
    # each failed start and the refused text ended its turn or utterance in finish(error), what Fish's clients act
    # on; the socket stayed open and the good start after them spoke
    failed = ["bad_event", *["value_out_of_range"] * 5, "unknown_voice", "text_too_long"]
    assert [e["reason"] for e in r.of("finish")] == ["error"] * len(failed) + ["stop"]
    messages = {e["code"]: e["message"] for e in r.of("error")}
    assert "0.0–2.0" in " ".join(e["message"] for e in r.of("error") if "temperature" in e["message"])
    assert "GET /v1/references" in messages["unknown_voice"]
    assert r.events[-1] == {"event": "finish", "reason": "stop"} and len(r.audio) > 0


def test_reference_audio_that_is_not_audio_too_long_or_empty(server: ServerHandle) -> None:
    cases = {
        b"this is not audio at all": "not_audio",
        b"": "empty_audio",
        wav_bytes(100.0): "audio_too_long",
        wav_bytes(0.2): "audio_too_short",
    }
    for audio, code in cases.items():
        r = run(session_with(server, [{"event": "start", "request": {"references": [{"audio": audio, "text": "hi"}]}}]))
        assert r.error_codes == [code], (code, r.events)


def test_reference_audio_clones_a_voice(server: ServerHandle) -> None:
    refs = [{"audio": wav_bytes(8.0), "text": "A reference sentence."}]  # a 1.4 MB frame: decoded off the loop
    r = run(speak(server.ws_url, [TEXT], references=refs, seed=11))
    assert r.events[-1]["reason"] == "stop" and len(r.audio) > 0
    assert run(speak(server.ws_url, [TEXT], references=refs, seed=11)).audio == r.audio  # seeded: reproducible
    assert run(speak(server.ws_url, [TEXT], seed=11)).audio != r.audio  # so the reference made the difference


def test_deeply_nested_msgpack_closes_1007(server: ServerHandle) -> None:
    r = run(session_with(server, [b"\x91" * 100_000 + b"\xc0"]))
    assert r.close_code == 1007


def test_control_token_strings_are_spoken_as_text(server: ServerHandle) -> None:
    r = run(speak(server.ws_url, ["<|im_end|><|im_start|>assistant <|semantic:5|> said."]))
    assert r.events[-1]["reason"] == "stop" and len(r.audio) > 10 * 2048 * 2  # not cut short by a fake end token


def test_oversized_frame_closes_1009(tmp_path) -> None:
    with start_server(tmp_path, max_frame_bytes=64 * 1024) as srv:
        r = run(session_with(srv, [b"\x00" * (65 * 1024)]))
        assert r.close_code == 1009


def test_too_many_sessions_refuses_the_turn_and_others_keep_streaming(tmp_path) -> None:
    with start_server(tmp_path, max_sessions=1) as srv:

        async def main():
            async with open_live(srv.ws_url) as ws:
                first = LiveClient(ws)
                await first.start()
                started = LiveResult()
                await first.read_until(started, ("started",))
                refused = await session_with(srv, [{"event": "start", "request": {"text": ""}}])
                await first.send({"event": "text", "text": "Still speaking."})
                await first.send({"event": "stop"})
                done = LiveResult()
                await first.wait_closed(done)
                return refused, done

        refused, done = run(main())
        # the refused turn ends in error + finish(error) at once; its socket stays open for a later start
        assert refused.error_codes == ["overloaded"] and refused.events[-1] == {"event": "finish", "reason": "error"}
        assert not refused.server_closed
        assert done.events[-1]["reason"] == "stop" and len(done.audio) > 0


def test_behind_real_time_refuses_new_turns_until_the_engine_catches_up(tmp_path) -> None:
    """--admission-turn-fraction: while the engine's decoding turns are slower than that share of a frame (here a
    limit every CPU turn exceeds), a new session is refused (at once with --admission-wait-s 0; the wait is
    tests/streaming/test_realtime_admission.py's) with `overloaded` + finish(error), its message naming the flag;
    the running stream finishes whole; once the engine idles, sessions are admitted again."""
    with start_server(tmp_path, max_sessions=4, admission_turn_fraction=0.001, admission_wait_s=0) as srv:

        async def main():
            async with open_live(srv.ws_url) as ws:
                first = LiveClient(ws)
                await first.start()
                await first.send({"event": "text", "text": " ".join([TEXT] * 6)})
                await first.send({"event": "flush"})
                heard = LiveResult()
                await first.read_until(heard, ("audio",))  # decoding turns are running now
                refused = await session_with(srv, [{"event": "start", "request": {"text": ""}}])
                await first.send({"event": "stop"})
                done = LiveResult()
                await first.wait_closed(done)
            await asyncio.sleep(1.5)  # no decoding turn for longer than the guard's STALE_S
            return refused, done, await speak(srv.ws_url, ["Admitted again."])

        refused, done, later = run(main())
        assert refused.error_codes == ["overloaded"] and refused.events[-1] == {"event": "finish", "reason": "error"}
        assert "--admission-turn-fraction" in refused.of("error")[0]["message"]
        assert done.events[-1]["reason"] == "stop" and len(done.audio) > 0
        assert later.events[-1]["reason"] == "stop" and len(later.audio) > 0


def test_wrong_api_key_is_refused_with_1008(secured_server: ServerHandle) -> None:
    r = run(session_with(secured_server, [{"event": "start", "request": {}}]))
    assert r.error_codes == ["unauthorized"] and r.close_code == 1008
    ok = run(speak(secured_server.ws_url + f"?api_key={API_KEY}", ["Authorised."]))
    assert ok.events[-1]["reason"] == "stop"

    async def with_header():
        headers = {"Authorization": f"Bearer {API_KEY}"}
        async with open_live(secured_server.ws_url, additional_headers=headers) as ws:
            c = LiveClient(ws)
            await c.start()
            await c.send({"event": "text", "text": "Header key."})
            await c.send({"event": "stop"})
            return await c.wait_closed(LiveResult())

    assert run(with_header()).events[-1]["reason"] == "stop"


def test_foreign_browser_origin_is_refused(server: ServerHandle) -> None:
    async def main():
        async with open_live(server.ws_url, origin="https://evil.example") as ws:
            return await LiveClient(ws).wait_closed(LiveResult())

    r = run(main())
    assert r.error_codes == ["forbidden_origin"] and r.close_code == 1008


def test_a_client_that_vanishes_or_never_reads_frees_everything(tmp_path) -> None:
    # the tiny random model fills the never-reading socket's kernel buffers (megabytes of PCM) in seconds; the trained
    # default, at ~2x real time on a 2-core CPU, needs most of the deadline for that
    with start_server(tmp_path, checkpoint=RANDOM_TINY_MODEL, send_timeout_s=2.0, max_sessions=2) as srv:
        engine = srv.gateway.engine

        async def vanish():
            async with open_live(srv.ws_url) as ws:
                c = LiveClient(ws)
                await c.start(max_new_tokens=4000)
                await c.send({"event": "text", "text": "Long text that is still being spoken. " * 30})
                await c.send({"event": "flush"})
                await c.read_until(LiveResult(), ("audio",))
            # leaving the block closes the socket mid-stream

        live_sessions = srv.gateway.metrics.live_sessions._value

        def freed(within_s: float) -> dict:
            deadline = time.monotonic() + within_s
            while time.monotonic() < deadline:
                stats = engine.stats()
                if engine.open_sessions == 0 and stats["decoding"] == 0 and live_sessions.get() == 0:
                    break
                time.sleep(0.1)
            return {"open": engine.open_sessions, "decoding": stats["decoding"], "gauge": live_sessions.get()}

        run(vanish())
        assert freed(within_s=5) == {"open": 0, "decoding": 0, "gauge": 0}
        # freed while the never-reading socket is still open: by the 2 s send timeout once its buffers are full (~7 s here),
        # not by the engine's 30 s stall fallback, nor by the client finally going away
        never_reads = _raw_socket_that_never_reads(srv)
        try:
            assert freed(within_s=25) == {"open": 0, "decoding": 0, "gauge": 0}
        finally:
            never_reads.close()
        ok = run(speak(srv.ws_url, ["Still serving."]))
        assert ok.events[-1]["reason"] == "stop"


def _raw_socket_that_never_reads(srv: ServerHandle) -> socket.socket:
    """Handshake by hand, start a session and read its `started` event, ask for a long utterance, then never read
    another byte."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting, so the window stays small
    sock.connect(("127.0.0.1", srv.settings.port))
    sock.settimeout(10)
    sock.sendall(
        b"GET /v1/tts/live HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
    )
    reply = b""
    while b"\r\n\r\n" not in reply:  # a client waits for the 101 before it sends frames (RFC 6455 4.1)
        reply += sock.recv(4096)
    assert reply.startswith(b"HTTP/1.1 101"), reply
    _send_masked(sock, {"event": "start", "request": {"text": "", "format": "pcm", "max_new_tokens": 4000}})
    frame = reply.split(b"\r\n\r\n", 1)[1]
    while len(frame) < 2 or len(frame) < 2 + (frame[1] & 0x7F):  # the `started` event is short (< 126 bytes)
        frame += sock.recv(4096)
    assert msgpack.unpackb(frame[2 : 2 + (frame[1] & 0x7F)])["event"] == "started", frame
    _send_masked(sock, {"event": "text", "text": "Never read. " * 200})
    _send_masked(sock, {"event": "flush"})
    return sock


def _send_masked(sock: socket.socket, event: dict) -> None:
    """One client frame, by hand: binary, masked, payload under 64 KiB."""
    payload = msgpack.packb(event)
    mask = b"\x01\x02\x03\x04"
    masked = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
    length = (
        bytes([0x80 | 126]) + len(payload).to_bytes(2, "big") if len(payload) >= 126 else bytes([0x80 | len(payload)])
    )
    sock.sendall(b"\x82" + length + mask + masked)


def test_text_sent_faster_than_it_is_spoken_is_refused_and_the_session_goes_on(tmp_path) -> None:
    with start_server(tmp_path, checkpoint=RANDOM_TINY_MODEL, max_text_chars=100, max_queued_chars=100) as srv:

        async def main():
            async with open_live(srv.ws_url) as ws:
                c = LiveClient(ws)
                await c.start(max_new_tokens=2000)
                sixty = "Sixty characters of text that take a while to be spoken ok."
                await c.send({"event": "text", "text": sixty})
                await c.send({"event": "flush"})  # handed to the engine: 60 queued
                await c.send({"event": "text", "text": sixty})  # 120 > 100
                refused = LiveResult()
                await c.read_until(refused, ("error",))
                await c.send({"event": "cancel"})
                await c.read_until(refused, ("cancelled",))
                tokens_at_cancel = srv.gateway.engine.stats()["prefill_tokens"]
                await c.send({"event": "text", "text": "Short after the cancel."})
                await c.send({"event": "stop"})
                after = LiveResult()
                await c.wait_closed(after)
                return refused, after, srv.gateway.engine.stats()["prefill_tokens"] - tokens_at_cancel

        refused, after, spoken_tokens = run(main())
        assert refused.error_codes == ["text_too_long"] and "--max-queued-chars" in refused.of("error")[0]["message"]
        # the text after the cancel reached the engine (prefilled) and the utterance finished. Not its audio: this
        # random model samples its end token as the very first frame now and then (a CI run hit it; this exact flow
        # in a loop: 2 of 450, the instrumented one with its prompt prefilled and no frame decoded), while a seeded
        # cancel during a chunked prefill followed by another text gives a fresh session's codes (40 of 40)
        assert after.events[-1]["reason"] == "stop" and spoken_tokens > 0


def test_cancel_after_stop_barges_into_the_finishing_utterance(server: ServerHandle) -> None:
    async def main():
        async with open_live(server.ws_url) as ws:
            c = LiveClient(ws)
            await c.start(max_new_tokens=2000)
            await c.send({"event": "text", "text": "A long closing answer that is still being spoken. " * 8})
            await c.send({"event": "stop"})
            r = LiveResult()
            await c.read_until(r, ("audio",))
            await c.send({"event": "cancel"})
            await c.read_until(r, ("cancelled",))
            at_cancel = server.gateway.engine.stats()
            await c.wait_closed(r)
            return r, at_cancel

    r, at_cancel = run(main())
    assert at_cancel["decoding"] == 0  # generation stopped at the cancel
    kinds = [e["event"] for e in r.events]
    assert kinds[-2:] == ["cancelled", "finish"] and r.events[-1]["reason"] == "stop" and r.close_code == 1000
    assert len(r.audio) < 300 * 2048 * 2  # far short of the whole utterance


def test_refusals_answer_in_the_clients_encoding(secured_server: ServerHandle) -> None:
    r = run(session_with(secured_server, [{"event": "start", "request": {}}], json_mode=True))
    assert r.error_codes == ["unauthorized"] and r.close_code == 1008  # parsed as JSON text frames


def test_per_key_rate_limit_refuses_then_recovers(tmp_path) -> None:
    with start_server(tmp_path, rate_limit_per_min=2) as srv:
        first = run(speak(srv.ws_url, ["One."]))
        second = run(speak(srv.ws_url, ["Two."]))
        third = run(session_with(srv, [{"event": "start", "request": {"text": ""}}]))
        assert first.events[-1]["reason"] == "stop" and second.events[-1]["reason"] == "stop"
        assert third.error_codes == ["rate_limited"] and "per minute" in third.of("error")[0]["message"]
        assert srv.gateway.engine.open_sessions == 0  # the refused start opened nothing


def test_audio_goes_out_in_messages_the_official_sdk_accepts() -> None:
    """A 24-frame chunk of 16-bit PCM (98,304 bytes) is more than the fish-audio-sdk's socket takes (65,536 bytes by
    default, then close 1009): it goes out as messages of whole samples under that, in order, nothing lost; msgpack's
    envelope fits too."""
    import msgpack

    from server import live_protocol as proto

    data = bytes(range(256)) * 384  # 98,304 bytes
    events = proto.audio_events(data)
    assert len(events) == 2 and b"".join(e["audio"] for e in events) == data
    for e in events:
        assert len(e["audio"]) % 2 == 0 and len(msgpack.packb(e, use_bin_type=True)) <= 65_536
    assert proto.audio_events(b"") == [] and proto.audio_events(b"ab") == [proto.audio(b"ab")]

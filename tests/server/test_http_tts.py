"""fish-speech's `POST /v1/tts` against a real server: every format decoded, streaming, references, bad input, auth."""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgpack
import openai
import pytest

from server.http_common import OFF_LOOP_BYTES
from streaming.segmenter import Segmenter, SegmenterConfig
from streaming.session import AudioChunk
from streaming.synth import segment_text as split_text
from tests.server.conftest import API_KEY, ServerHandle, start_server
from tests.server.http_helpers import (
    FRAME_SAMPLES,
    assert_error,
    assert_not_silent,
    clip,
    decode,
    raw_request,
    s16,
    wav_fields,
)
from tests.streaming.engine_helpers import RANDOM_TINY_MODEL

TEXT = "Hello there. This is a test."
SHORT = "Hi there."
# one segment (a clause end this early does not cut): vocoder chunks then never depend on timing, so the samples
# are bit-exact across requests; with several segments the engine's chunking may differ in the last bit
ONE_SEGMENT = "Hello there, this is a single segment test."


def tts(server: ServerHandle, **body) -> httpx.Response:
    return httpx.post(f"{server.base_url}/v1/tts", json=body, timeout=60)


def test_default_is_a_complete_wav_with_exact_lengths(server: ServerHandle) -> None:
    r = tts(server, text=TEXT, seed=1)
    assert r.status_code == 200 and r.headers["content-type"] == "audio/wav"
    assert r.headers["content-disposition"] == "attachment; filename=audio.wav"
    riff, rate, data_bytes = wav_fields(r.content)
    assert (riff, rate, data_bytes) == (len(r.content) - 8, 44100, len(r.content) - 44)
    samples, rate = decode(r.content)
    assert rate == 44100 and samples.ndim == 1
    assert len(samples) % FRAME_SAMPLES == 0 and len(samples) >= 10 * FRAME_SAMPLES  # whole codec frames
    assert_not_silent(samples)


@pytest.mark.parametrize(
    ("fmt", "rate", "decoded_rate", "media_type"),
    [("mp3", 22050, 22050, "audio/mpeg"), ("flac", 16000, 16000, "audio/flac"), ("opus", 48000, 48000, "audio/ogg")],
)
def test_compressed_formats_are_complete_files(server: ServerHandle, fmt, rate, decoded_rate, media_type) -> None:
    r = tts(server, text=SHORT, format=fmt, sample_rate=rate, seed=2)
    assert r.status_code == 200 and r.headers["content-type"].startswith(media_type)
    samples, got_rate = decode(r.content)
    assert got_rate == decoded_rate
    assert len(samples) > 0.2 * decoded_rate
    assert_not_silent(samples)


def test_msgpack_body_and_pcm_at_24k(server: ServerHandle) -> None:
    body = msgpack.packb({"text": SHORT, "format": "pcm", "sample_rate": 24000, "seed": 3}, use_bin_type=True)
    r = httpx.post(
        f"{server.base_url}/v1/tts", content=body, headers={"content-type": "application/msgpack"}, timeout=60
    )
    assert r.status_code == 200 and r.headers["content-type"] == "audio/pcm"
    pcm = s16(r.content)
    assert len(pcm) > 0.2 * 24000
    assert_not_silent(pcm)
    # the same request in JSON gives the same samples: the seed decides, not the encoding of the body
    again = tts(server, text=SHORT, format="pcm", sample_rate=24000, seed=3)
    assert again.content == r.content
    other = tts(server, text=SHORT, format="pcm", sample_rate=24000, seed=4)
    assert other.content != r.content


def test_streaming_sends_a_wav_header_then_pcm_as_it_is_made(server: ServerHandle) -> None:
    chunks = []
    body = {"text": ONE_SEGMENT, "streaming": True, "seed": 1}
    with httpx.stream("POST", f"{server.base_url}/v1/tts", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"] == "audio/wav"
        assert "content-length" not in r.headers and r.headers["transfer-encoding"] == "chunked"
        chunks = list(r.iter_raw())
    assert len(chunks) >= 3  # several engine chunks, not one body at the end
    data = b"".join(chunks)
    assert wav_fields(data) == (0xFFFFFFFF, 44100, 0xFFFFFFFF)  # length unknown when the header was sent
    samples, rate = decode(data)
    assert rate == 44100 and len(samples) % FRAME_SAMPLES == 0
    # streamed and whole-file responses carry the same samples
    whole = tts(server, text=ONE_SEGMENT, seed=1).content
    assert data[44:] == whole[44:]


def test_prosody_speed_scales_duration(server: ServerHandle) -> None:
    normal = s16(tts(server, text=SHORT, format="pcm", sample_rate=16000, seed=5).content)
    fast = s16(tts(server, text=SHORT, format="pcm", sample_rate=16000, seed=5, prosody={"speed": 2.0}).content)
    assert abs(len(fast) - len(normal) / 2) <= 2
    assert_error(tts(server, text=SHORT, prosody={"speed": 4.0}), 400, "value_out_of_range", "0.5–2.0")


def test_inline_references_json_base64_and_msgpack_bytes(server: ServerHandle) -> None:
    audio = clip(12.0, rate_hz=48000)  # 1.15 MB: both bodies are over OFF_LOOP_BYTES (decoded on a worker thread)
    assert len(audio) > OFF_LOOP_BYTES
    ref = {"audio": base64.b64encode(audio).decode(), "text": "A reference clip."}
    r = tts(server, text=SHORT, format="pcm", references=[ref], seed=6)
    assert r.status_code == 200, r.text
    assert_not_silent(s16(r.content))
    body = msgpack.packb(
        {"text": SHORT, "format": "pcm", "references": [{"audio": audio, "text": "A reference clip."}], "seed": 6},
        use_bin_type=True,
    )
    m = httpx.post(f"{server.base_url}/v1/tts", content=body, headers={"content-type": "application/msgpack"})
    assert m.status_code == 200 and m.content == r.content  # same voice, same seed, same samples
    plain = tts(server, text=SHORT, format="pcm", seed=6)
    assert plain.content != r.content  # the reference changed the prompt


def test_reference_audio_path_inside_the_directory(server: ServerHandle) -> None:
    root = server.settings.references_dir
    assert root is not None
    (root / "shared").mkdir(exist_ok=True)
    (root / "shared" / "clip.wav").write_bytes(clip(1.5))
    (root / "shared" / "clip.lab").write_text("A reference clip.")
    with_lab = tts(server, text=SHORT, format="pcm", reference_audio="shared/clip.wav", seed=7)
    assert with_lab.status_code == 200, with_lab.text
    given = tts(
        server, text=SHORT, format="pcm", reference_audio="shared/clip.wav", reference_text="A reference clip.", seed=7
    )
    assert given.content == with_lab.content
    assert tts(server, text=SHORT, format="pcm", seed=7).content != with_lab.content  # the clip was the voice


def test_reference_audio_outside_the_directory_is_refused(server: ServerHandle, tmp_path: Path) -> None:
    root = server.settings.references_dir
    assert root is not None
    outside = tmp_path / "secret.wav"
    outside.write_bytes(clip(1.5))
    (root / "leak.wav").unlink(missing_ok=True)
    os.symlink(outside, root / "leak.wav")
    (root / "leak.lab").write_text("transcript")
    for path in ("../../etc/passwd", "/etc/passwd", str(outside), "leak.wav", "../" * 20 + "etc/hosts", "a\x00b"):
        assert_error(tts(server, text=SHORT, reference_audio=path), 400, "value_out_of_range", "references directory")
    assert_error(tts(server, text=SHORT, reference_audio=["x"]), 400, "value_out_of_range", "reference_audio")
    (root / "nolab.wav").write_bytes(clip(1.5))
    assert_error(tts(server, text=SHORT, reference_audio="nolab.wav"), 400, None, "reference_text", ".lab")
    huge = tts(server, text=SHORT, reference_audio="nolab.wav", reference_text="word " * 401)
    assert_error(huge, 400, "text_too_long", "reference transcript is 2005 characters")


@pytest.mark.parametrize(
    ("body", "code", "needles"),
    [
        ({"text": 5}, "value_out_of_range", ("text must be a string",)),
        ({"input": "Hello there."}, "value_out_of_range", ("text is required", "`input`", "fields: input")),
        ({"text": SHORT, "streaming": "yes"}, "value_out_of_range", ("streaming must be true or false",)),
        ({"text": SHORT, "seed": "1"}, "value_out_of_range", ("seed must be an integer",)),
        ({"text": SHORT, "seed": -1}, "value_out_of_range", ("seed",)),
        ({"text": SHORT, "chunk_length": 50}, "value_out_of_range", ("chunk_length", "100–300")),
        ({"text": SHORT, "top_p": 1.5}, "value_out_of_range", ("top_p", "0.01–1.0")),
        ({"text": SHORT, "max_new_tokens": 0}, "value_out_of_range", ("max_new_tokens", "1–4096")),
        ({"text": SHORT, "format": "ogg"}, "value_out_of_range", ("format must be one of", "flac")),
        ({"text": SHORT, "format": "wav", "sample_rate": 11025}, "value_out_of_range", ("sample_rate", "44100")),
        ({"text": SHORT, "use_memory_cache": "maybe"}, "value_out_of_range", ("'on' or 'off'",)),
        ({"text": ""}, "value_out_of_range", ("nothing to speak",)),
        ({"text": " ... !!"}, "value_out_of_range", ("nothing to speak",)),
        ({"text": "x" * 20_001}, "value_out_of_range", ("20001 characters", "20000")),
        ({"text": SHORT, "reference_id": "../../etc/passwd"}, "value_out_of_range", ("voice id",)),
        ({"text": SHORT, "references": "x"}, "value_out_of_range", ("references must be a list",)),
        ({"text": SHORT, "references": [{"audio": "@@@", "text": "t"}]}, "value_out_of_range", ("base64",)),
        ({"text": SHORT, "references": [{"audio": "", "text": "t"}]}, "empty_audio", ("empty",)),
        (
            {"text": SHORT, "references": [{"audio": base64.b64encode(b"not audio at all").decode(), "text": "t"}]},
            "not_audio",
            ("not a readable audio file",),
        ),
        (
            {"text": SHORT, "references": [{"audio": base64.b64encode(clip(50.0, 8000)).decode(), "text": "t"}]},
            "audio_too_long",
            ("longer than",),
        ),
        ({"text": SHORT, "references": [{"audio": "", "text": ""}]}, "value_out_of_range", ("transcript",)),
        (
            {"text": SHORT, "references": [{"audio": base64.b64encode(clip(1.5)).decode(), "text": "word " * 401}]},
            "text_too_long",
            ("references[0].text is 2005 characters", "2000"),
        ),
    ],
)
def test_bad_requests_name_the_problem(server: ServerHandle, body, code, needles) -> None:
    assert_error(tts(server, **body), 400, code, *needles)


def test_unknown_reference_id_is_404_naming_the_list(server: ServerHandle) -> None:
    assert_error(tts(server, text=SHORT, reference_id="nobody"), 404, "unknown_voice", "GET /v1/references")


def test_undecodable_bodies(server: ServerHandle) -> None:
    url = f"{server.base_url}/v1/tts"
    assert_error(httpx.post(url, content=b'{"text": "hi"', headers={"content-type": "application/json"}), 400,
                 "invalid_body", "not valid JSON")  # fmt: skip
    assert_error(httpx.post(url, content=b"\xff\xfe", headers={"content-type": "application/json"}), 400,
                 "invalid_body")  # fmt: skip
    assert_error(httpx.post(url, json=["text"]), 400, "invalid_body", "object")
    assert_error(httpx.post(url, content=b"\xc1", headers={"content-type": "application/msgpack"}), 400,
                 "invalid_body", "MessagePack")  # fmt: skip
    status, body = raw_request(
        "127.0.0.1", server.settings.port, "/v1/tts", {"Content-Type": "application/json", "Content-Length": "10" * 9}
    )
    assert status == 413 and b"payload_too_large" in body


@contextlib.contextmanager
def worker_held_after_first_audio(engine) -> Iterator[threading.Event]:
    """Hold the engine's worker thread right after it hands its first audio chunk to a session, until the block
    exits. While held, no more audio is made and no utterance can end: what happens then is the client's doing, not
    a race with synthesis speed. The returned event is set once the worker is held."""
    worker = engine._worker
    outbox = worker.outbox
    post, flush = outbox.post, outbox.flush
    audio_posted, held, gate = threading.Event(), threading.Event(), threading.Event()

    def post_and_note(session, ev) -> None:
        if isinstance(ev, AudioChunk):
            audio_posted.set()
        post(session, ev)

    def flush_then_hold() -> None:
        flush()
        if audio_posted.is_set() and not held.is_set():
            held.set()
            gate.wait(60)

    outbox.post, outbox.flush = post_and_note, flush_then_hold  # the worker looks both up on every call
    try:
        yield held
    finally:
        del outbox.post, outbox.flush
        gate.set()


def wait_for(condition, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert condition()


def test_client_leaving_mid_stream_frees_the_session(server: ServerHandle) -> None:
    engine = server.gateway.engine
    long_text = " ".join(["This sentence keeps the engine busy for a while."] * 12)
    with worker_held_after_first_audio(engine) as held:
        with httpx.stream(
            "POST", f"{server.base_url}/v1/tts", json={"text": long_text, "streaming": True, "seed": 1}
        ) as r:
            assert r.status_code == 200
            chunks = r.iter_raw()  # keep the iterator: dropping it would close the connection
            next(chunks)
            wait_for(held.is_set)
            assert engine.open_sessions == 1  # the worker is held after its first audio: the utterance still runs
        # freed while the worker is still held, so by the client leaving, not by the utterance ending
        wait_until_no_sessions(engine)
    # a whole-file request is stopped too when its client gives up waiting: its file cannot be finished (nor a byte
    # of it sent) while the worker is held, so the 1 s read limit always runs out
    with worker_held_after_first_audio(engine) as held:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(
                f"{server.base_url}/v1/tts", json={"text": long_text, "seed": 1}, timeout=httpx.Timeout(30, read=1.0)
            )
        wait_for(held.is_set)  # its first audio may come after the client left: the server waits for it first
        wait_until_no_sessions(engine)
    wait_until_no_sessions(engine)


def test_a_stream_nobody_reads_is_dropped_and_frees_its_session(tmp_path: Path, caplog) -> None:
    # the tiny random model fills the socket's kernel buffers in seconds; the server then gives up after its 2 s
    # send timeout, while the client still holds the connection open (seeded: its audio is far more than they hold)
    caplog.set_level(logging.WARNING, logger="server.http_common")
    with start_server(tmp_path, checkpoint=RANDOM_TINY_MODEL, send_timeout_s=2.0) as srv:
        body = json.dumps(
            {"text": "Never read. " * 200, "streaming": True, "format": "pcm", "max_new_tokens": 4000, "seed": 1}
        )
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", srv.settings.port))
        try:
            sock.sendall(
                f"POST /v1/tts HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n{body}".encode()
            )
            wait_for(lambda: srv.gateway.engine.open_sessions == 1)
            wait_until_no_sessions(srv.gateway.engine, timeout_s=120)
            assert "did not read for 2 s; dropping it" in caplog.text  # dropped, not finished
        finally:
            sock.close()
        assert tts(srv, text=SHORT, format="pcm").status_code == 200


def wait_until_no_sessions(engine, timeout_s: float = 30.0) -> None:  # a generous guard against hangs only
    deadline = time.monotonic() + timeout_s
    while engine.open_sessions and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.open_sessions == 0


def test_health_and_metrics(server: ServerHandle) -> None:
    assert httpx.get(f"{server.base_url}/v1/health").json() == {"status": "ok"}
    assert httpx.post(f"{server.base_url}/v1/health").status_code == 200
    assert tts(server, text=SHORT, format="pcm", seed=8).status_code == 200
    assert tts(server, text=SHORT, top_p=7).status_code == 400
    metrics = httpx.get(f"{server.base_url}/metrics").text
    assert 'fishgate_http_synthesis_total{api="fish"}' in metrics
    assert 'fishgate_errors_total{code="value_out_of_range"}' in metrics
    count = next(line for line in metrics.splitlines() if line.startswith("fishgate_first_audio_seconds_count"))
    assert float(count.split()[-1]) >= 1


def test_split_text_matches_one_feed_and_takes_any_length() -> None:
    config = SegmenterConfig.from_fish()
    text = " ".join(f"Sentence number {i}, with a clause; and more words to read." for i in range(120))  # ~7 k
    one_feed = Segmenter(config)
    expected = [s.spoken_text for s in one_feed.feed(text, 0.0) + one_feed.finish() if s.spoken_text]
    assert split_text(text, config) == expected and len(expected) > 20
    long = split_text(text * 3, config)  # beyond the segmenter's 10 k buffer in one feed
    assert "".join(long).replace(" ", "") == (text * 3).replace(" ", "")


def test_wrong_api_key_is_refused_on_every_http_endpoint(secured_server: ServerHandle) -> None:
    base = secured_server.base_url
    calls = [
        ("POST", "/v1/tts", {"text": SHORT}),
        ("POST", "/v1/audio/speech", {"model": "tts-1", "input": SHORT, "voice": "alloy"}),
        ("GET", "/v1/references", None),
        ("DELETE", "/v1/references/someone", None),
        ("GET", "/v1/health", None),
    ]
    for method, path, body in calls:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            r = httpx.request(method, base + path, json=body, headers=headers)
            assert_error(r, 401, "unauthorized")
            assert r.headers["www-authenticate"] == "Bearer"
    files = {"audio": ("a.wav", clip(1.5), "audio/wav")}
    r = httpx.post(f"{base}/v1/references", data={"id": "v", "text": "t"}, files=files, headers={"Authorization": "x"})
    assert_error(r, 401, "unauthorized")
    client = openai.OpenAI(api_key="wrong", base_url=f"{base}/v1", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.audio.speech.create(model="tts-1", voice="alloy", input=SHORT)
    ok = httpx.post(
        f"{base}/v1/tts",
        json={"text": SHORT, "format": "pcm", "seed": 9},
        headers={"Authorization": f"Bearer {API_KEY}"},
    )
    assert ok.status_code == 200
    assert_not_silent(s16(ok.content))

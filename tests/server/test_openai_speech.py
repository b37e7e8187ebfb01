"""OpenAI's `POST /v1/audio/speech` through the official `openai` SDK against a real server: formats, SSE, speed."""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping

import httpx
import openai
import pytest

from tests.server.conftest import ServerHandle
from tests.server.http_helpers import assert_error, assert_not_silent, clip, decode, s16, wav_fields

TEXT = "Hello there, this is a single segment test."  # one segment: bit-exact across requests (see test_http_tts)


@pytest.fixture(scope="module")
def client(server: ServerHandle) -> openai.OpenAI:
    return openai.OpenAI(api_key="anything", base_url=f"{server.base_url}/v1", max_retries=0)


def speak(client: openai.OpenAI, **kwargs) -> tuple[bytes, Mapping[str, str]]:
    args = {"model": "tts-1", "voice": "alloy", "input": TEXT, **kwargs}
    with client.audio.speech.with_streaming_response.create(**args) as response:
        return b"".join(response.iter_bytes()), response.headers


def sse_events(body: bytes) -> list[dict]:
    events = []
    for block in body.decode().split("\n\n"):
        if block.strip():
            assert block.startswith("data: "), block
            events.append(json.loads(block[len("data: ") :]))
    return events


def test_pcm_is_24k_s16le_mono(client: openai.OpenAI) -> None:
    data, headers = speak(client, response_format="pcm", extra_body={"seed": 1})
    assert headers["content-type"] == "audio/pcm" and headers["transfer-encoding"] == "chunked"
    pcm = s16(data)
    frames = len(pcm) / (24000 * 2048 / 44100)  # 24 kHz samples per 44.1 kHz codec frame
    assert abs(frames - round(frames)) < 0.01 and frames >= 10
    assert_not_silent(pcm)


@pytest.mark.parametrize(
    ("fmt", "rate", "media_type"),
    [
        ("mp3", 24000, "audio/mpeg"),
        ("opus", 48000, "audio/ogg"),
        ("flac", 24000, "audio/flac"),
        ("wav", 24000, "audio/wav"),
    ],
)
def test_file_formats_decode(client: openai.OpenAI, fmt: str, rate: int, media_type: str) -> None:
    data, headers = speak(client, response_format=fmt, extra_body={"seed": 2})
    assert headers["content-type"].startswith(media_type)
    samples, got_rate = decode(data)
    assert got_rate == rate and len(samples) > 0.5 * rate
    assert_not_silent(samples)
    if fmt == "wav":
        assert wav_fields(data) == (0xFFFFFFFF, 24000, 0xFFFFFFFF)  # streamed: length unknown up front


def test_default_format_is_mp3(client: openai.OpenAI) -> None:
    data, headers = speak(client)
    assert headers["content-type"] == "audio/mpeg"
    assert decode(data)[1] == 24000


def test_sse_deltas_carry_the_same_audio(client: openai.OpenAI) -> None:
    plain, _ = speak(client, response_format="pcm", extra_body={"seed": 3})
    body, headers = speak(client, response_format="pcm", stream_format="sse", extra_body={"seed": 3})
    assert headers["content-type"].startswith("text/event-stream")
    events = sse_events(body)
    deltas, done = events[:-1], events[-1]
    assert len(deltas) >= 2 and all(e["type"] == "speech.audio.delta" for e in deltas)
    assert b"".join(base64.b64decode(e["audio"]) for e in deltas) == plain
    assert done["type"] == "speech.audio.done"
    usage = done["usage"]
    assert usage["input_tokens"] == len(TEXT) and usage["output_tokens"] > 10
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]


@pytest.mark.parametrize("speed", [0.25, 3.0, 4.0])
def test_speed_beyond_fish_range_scales_duration(client: openai.OpenAI, speed: float) -> None:
    normal = s16(speak(client, response_format="pcm", extra_body={"seed": 4})[0])
    stretched = s16(speak(client, response_format="pcm", speed=speed, extra_body={"seed": 4})[0])
    assert abs(len(stretched) - len(normal) / speed) <= 3
    assert_not_silent(stretched)


def test_seed_decides_and_voices(client: openai.OpenAI, server: ServerHandle) -> None:
    a = speak(client, response_format="pcm", extra_body={"seed": 5})[0]
    assert speak(client, response_format="pcm", voice="default", extra_body={"seed": 5})[0] == a
    assert speak(client, response_format="pcm", voice="nova", extra_body={"seed": 5})[0] == a
    assert speak(client, response_format="pcm", extra_body={"seed": 6})[0] != a
    files = {"audio": ("v.wav", clip(1.5), "audio/wav")}
    r = httpx.post(f"{server.base_url}/v1/references", data={"id": "alloy", "text": "A clip."}, files=files)
    assert r.status_code == 201, r.text
    try:  # a stored voice named like a built-in one wins; {"id": …} names it too
        cloned = speak(client, response_format="pcm", extra_body={"seed": 5})[0]
        assert cloned != a
        by_id = speak(client, response_format="pcm", voice={"id": "alloy"}, extra_body={"seed": 5})[0]
        assert by_id == cloned
    finally:
        httpx.delete(f"{server.base_url}/v1/references/alloy")


def test_sdk_errors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        speak(client, response_format="aac")
    assert "aac" in str(info.value) and "mp3 or opus" in str(info.value)
    with pytest.raises(openai.BadRequestError, match="4096"):
        speak(client, input="a" * 4097)
    with pytest.raises(openai.BadRequestError, match=r"0\.25–4\.0"):
        speak(client, speed=4.5)
    with pytest.raises(openai.NotFoundError, match="GET /v1/references"):
        speak(client, voice="nobody")


@pytest.mark.parametrize(
    ("body", "code", "needles"),
    [
        ({"input": 5, "voice": "alloy"}, "value_out_of_range", ("input must be a string",)),
        (
            {"voice": "alloy", "text": "Hi."},
            "value_out_of_range",
            ("input is required", "`text`", "model, text, voice"),
        ),
        ({"input": "", "voice": "alloy"}, "value_out_of_range", ("nothing to speak",)),
        ({"input": "Hi.", "voice": 3}, "value_out_of_range", ("voice must be",)),
        ({"input": "Hi.", "voice": "../../etc/passwd"}, "value_out_of_range", ("voice id",)),
        ({"input": "Hi.", "voice": "alloy", "response_format": "ogg"}, "value_out_of_range", ("mp3, opus, aac",)),
        ({"input": "Hi.", "voice": "alloy", "response_format": "aac"}, "unsupported_format", ("mp3 or opus",)),
        ({"input": "Hi.", "voice": "alloy", "speed": "fast"}, "value_out_of_range", ("speed", "0.25–4.0")),
        ({"input": "Hi.", "voice": "alloy", "speed": 0.1}, "value_out_of_range", ("0.25–4.0",)),
        ({"input": "Hi.", "voice": "alloy", "stream_format": "ws"}, "value_out_of_range", ("audio, sse",)),
        ({"input": "Hi.", "voice": "alloy", "seed": 1.5}, "value_out_of_range", ("seed must be an integer",)),
        ({"input": "Hi.", "voice": "alloy", "model": 7}, "value_out_of_range", ("model must be a string",)),
    ],
)
def test_bad_requests(server: ServerHandle, body, code, needles) -> None:
    r = httpx.post(f"{server.base_url}/v1/audio/speech", json={"model": "tts-1", **body})
    assert_error(r, 400, code, *needles)


def test_invalid_json(server: ServerHandle) -> None:
    r = httpx.post(f"{server.base_url}/v1/audio/speech", content=b"{", headers={"content-type": "application/json"})
    assert_error(r, 400, "invalid_body", "not valid JSON")

"""Edges of the HTTP APIs against a real server: limits that are inclusive, text normalization, bodies streamed past
their cap, reference files and transcripts that must stay inside the references directory, links between voice
folders, `replace=false`, the rate limiter's refill, API keys that are nearly right, fish-speech's health check while the
server drains, and Opus's default rate."""

from __future__ import annotations

import base64
import struct
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from server.gateway import TokenBucket
from server.openai_http import MAX_BODY_BYTES, MAX_INPUT_CHARS
from server.params import MAX_REFERENCES
from tests.server.conftest import API_KEY, ServerHandle
from tests.server.http_helpers import assert_error, assert_not_silent, clip, s16

SHORT = "Hi there."
ONE_SEGMENT = "Hello there, this is a single segment test."  # one segment: bit-exact across requests
TRANSCRIPT = "A reference clip."


def tts(server: ServerHandle, **body) -> httpx.Response:
    return httpx.post(f"{server.base_url}/v1/tts", json={"format": "pcm", **body}, timeout=60)


def full_width(text: str) -> str:
    """ASCII letters and punctuation as their full-width forms (what NFKC folds back)."""
    return "".join(chr(ord(c) + 0xFEE0) if "!" <= c <= "~" else c for c in text)


def test_text_of_exactly_the_limit_is_accepted(server: ServerHandle) -> None:
    limit = server.settings.max_text_chars
    at_limit = SHORT + " " * (limit - len(SHORT))  # the spaces collapse when normalized: quick to speak
    assert tts(server, text=at_limit, seed=1).status_code == 200
    assert_error(tts(server, text=at_limit + " "), 400, "value_out_of_range", f"{limit + 1} characters")
    client = openai.OpenAI(api_key="anything", base_url=f"{server.base_url}/v1", max_retries=0)
    text = SHORT + " " * (MAX_INPUT_CHARS - len(SHORT))
    with client.audio.speech.with_streaming_response.create(
        model="tts-1", voice="alloy", input=text, response_format="pcm"
    ) as response:
        assert_not_silent(s16(response.read()))


def test_as_many_references_as_allowed_are_accepted_and_one_more_is_refused(server: ServerHandle) -> None:
    root = server.settings.references_dir
    assert root is not None
    (root / "edge.wav").write_bytes(clip(1.0, seed=9))
    refs = [{"audio": base64.b64encode(clip(1.0, seed=i)).decode(), "text": TRANSCRIPT} for i in range(5)]
    assert tts(server, text=SHORT, references=refs[:MAX_REFERENCES], seed=2).status_code == 200
    assert_error(tts(server, text=SHORT, references=refs), 400, "value_out_of_range", f"at most {MAX_REFERENCES}")
    # a server-side reference_audio counts as one of them
    beside = {"reference_audio": "edge.wav", "reference_text": TRANSCRIPT}
    assert tts(server, text=SHORT, references=refs[: MAX_REFERENCES - 1], seed=2, **beside).status_code == 200
    full = tts(server, text=SHORT, references=refs[:MAX_REFERENCES], **beside)
    assert_error(full, 400, "value_out_of_range", "reference_audio included")


def test_the_default_voice_normalises_its_text_whatever_normalize_says(server: ServerHandle) -> None:
    """The English default voice's own normaliser folds full-width forms and drops format characters; `normalize`
    is accepted and changes nothing (fish-speech v1.5.1 ignores it; Fish Speech 1.5 reads text as sent)."""
    plain = tts(server, text=ONE_SEGMENT, seed=3).content
    assert tts(server, text=full_width(ONE_SEGMENT), seed=3).content == plain
    hidden = ONE_SEGMENT.replace("there", "the\u200bre")  # a zero-width space: a format character, dropped
    assert tts(server, text=hidden, seed=3).content == plain
    assert tts(server, text=hidden, seed=3, normalize=False).content == plain


def test_openai_input_is_normalized_by_the_default_voice(server: ServerHandle) -> None:
    client = openai.OpenAI(api_key="anything", base_url=f"{server.base_url}/v1", max_retries=0)

    def speak(text: str) -> bytes:
        with client.audio.speech.with_streaming_response.create(
            model="tts-1", voice="alloy", input=text, response_format="pcm", extra_body={"seed": 4}
        ) as response:
            return response.read()

    plain = speak(ONE_SEGMENT)
    assert speak(full_width(ONE_SEGMENT)) == plain
    assert speak(ONE_SEGMENT.replace("there", "the\u200bre")) == plain  # the zero-width space is dropped


def test_a_body_streamed_past_its_cap_is_refused(server: ServerHandle) -> None:
    """No Content-Length (chunked upload): the cap is enforced on the bytes as they arrive."""
    piece = 16 * 1024

    def chunks() -> Iterator[bytes]:
        yield b'{"input": "'
        for _ in range(MAX_BODY_BYTES // piece + 1):
            yield b"a" * piece

    r = httpx.post(f"{server.base_url}/v1/audio/speech", content=chunks(), headers={"content-type": "application/json"})
    assert "content-length" not in r.request.headers
    assert_error(r, 413, "payload_too_large", str(MAX_BODY_BYTES))


def test_a_reference_file_over_the_size_limit_is_refused_unread(server: ServerHandle) -> None:
    root = server.settings.references_dir
    assert root is not None
    limit = server.settings.max_reference_bytes
    with open(root / "huge.wav", "wb") as f:
        f.truncate(limit + 1)  # sparse: nothing is written
    r = tts(server, text=SHORT, reference_audio="huge.wav", reference_text=TRANSCRIPT)
    assert_error(r, 400, "value_out_of_range", f"reference_audio is {limit + 1} bytes", f"limit is {limit}")
    (root / "huge.wav").unlink()


def test_a_transcript_linked_from_outside_the_directory_is_not_read(server: ServerHandle, tmp_path) -> None:
    root = server.settings.references_dir
    assert root is not None
    (tmp_path / "secret.txt").write_text("Someone else's file.")
    (root / "linklab").mkdir()
    (root / "linklab" / "clip.wav").write_bytes(clip(1.5))
    (root / "linklab" / "clip.lab").symlink_to(tmp_path / "secret.txt")
    r = tts(server, text=SHORT, reference_audio="linklab/clip.wav")
    assert_error(r, 400, "value_out_of_range", "reference_text", ".lab")


def upload(server: ServerHandle, voice_id: str, seconds: float, **extra) -> httpx.Response:
    files = {"audio": ("clip.wav", clip(seconds), "audio/wav")}
    data = {"id": voice_id, "text": TRANSCRIPT, **extra}
    return httpx.post(f"{server.base_url}/v1/references", data=data, files=files)


def test_replace_false_keeps_the_stored_voice(server: ServerHandle) -> None:
    assert upload(server, "keeper", 1.5).status_code == 201
    try:
        assert_error(upload(server, "keeper", 2.5, replace="false"), 409, "voice_exists")
        assert httpx.get(f"{server.base_url}/v1/references/keeper").json()["duration_s"] == 1.5
    finally:
        httpx.delete(f"{server.base_url}/v1/references/keeper")


def test_a_link_between_voice_folders_is_no_voice(server: ServerHandle) -> None:
    """A folder link inside the directory is not a second name for a voice: not listed, not usable, and deleting
    it neither fails nor removes the voice it points at."""
    root = server.settings.references_dir
    assert root is not None
    assert upload(server, "original", 1.5).status_code == 201
    (root / "alias").symlink_to(root / "original", target_is_directory=True)
    base = server.base_url
    try:
        assert [v["id"] for v in httpx.get(f"{base}/v1/references").json()["references"]] == ["original"]
        assert_error(tts(server, text=SHORT, reference_id="alias"), 404, "unknown_voice")
        assert_error(httpx.delete(f"{base}/v1/references/alias"), 404, "unknown_voice")
        assert (root / "original" / "voice.json").is_file()
    finally:
        (root / "alias").unlink()
        httpx.delete(f"{base}/v1/references/original")


def test_the_rate_limit_refills_over_time() -> None:
    bucket = TokenBucket(per_minute=60_000)  # 1,000 requests a second
    spent = 0
    while bucket.take("key"):
        spent += 1
    assert spent >= 60_000
    time.sleep(0.02)
    assert bucket.take("key")  # ~20 requests' worth came back
    assert bucket.take("other key")  # each key has its own budget


@pytest.mark.parametrize(
    ("body", "needles"),
    [
        ({"temperature": 2.5}, ("temperature", "0.0–2.0")),
        ({"repetition_penalty": 0.5}, ("repetition_penalty", "0.9–2.0")),
        ({"prosody": {"volume": 21}}, ("prosody.volume", "-20.0–20.0")),
        ({"prosody": {"speed": True}}, ("prosody.speed must be a number",)),
        ({"temperature": True}, ("temperature must be a number",)),
    ],
)
def test_out_of_range_or_boolean_settings_are_refused(server: ServerHandle, body, needles) -> None:
    assert_error(tts(server, text=SHORT, **body), 400, "value_out_of_range", *needles)


def test_only_the_whole_key_is_accepted(secured_server: ServerHandle) -> None:
    url = f"{secured_server.base_url}/v1/references"
    for wrong in (API_KEY[:-1], API_KEY[:1], API_KEY + "4", API_KEY.upper()):
        assert_error(httpx.get(url, headers={"Authorization": f"Bearer {wrong}"}), 401, "unauthorized")
    assert httpx.get(url, headers={"Authorization": f"bearer {API_KEY}"}).status_code == 200  # the scheme's case
    assert httpx.get(url, params={"api_key": API_KEY}).status_code == 200


def test_fish_health_is_503_while_draining(server: ServerHandle) -> None:
    url = f"{server.base_url}/v1/health"
    server.gateway.draining.set()  # what SIGTERM does
    try:
        r = httpx.get(url)
        assert (r.status_code, r.json()) == (503, {"status": "not_ready"})
    finally:
        server.gateway.draining.clear()
    assert httpx.get(url).json() == {"status": "ok"}


def test_opus_defaults_to_48k(server: ServerHandle) -> None:
    """Fish's opus default rate is 48 kHz: the OpusHead says so (a 44.1 kHz request would be recorded there)."""
    r = tts(server, text=SHORT, format="opus")
    assert r.status_code == 200 and r.headers["content-type"].startswith("audio/ogg")
    head = r.content.index(b"OpusHead")
    assert struct.unpack("<I", r.content[head + 12 : head + 16])[0] == 48000

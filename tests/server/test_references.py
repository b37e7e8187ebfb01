"""Stored voices over HTTP (`/v1/references`) against a real server: upload, list, use, replace, delete, refusals."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.server.conftest import ServerHandle
from tests.server.http_helpers import assert_error, assert_not_silent, clip, raw_request, s16

TRANSCRIPT = "This is a reference clip."


def upload(server: ServerHandle, voice_id: str, audio: bytes, text: str = TRANSCRIPT, **extra) -> httpx.Response:
    files = {"audio": ("clip.wav", audio, "audio/wav")}
    return httpx.post(f"{server.base_url}/v1/references", data={"id": voice_id, "text": text, **extra}, files=files)


def test_upload_list_use_replace_delete(server: ServerHandle) -> None:
    base = server.base_url
    root = server.settings.references_dir
    assert root is not None
    r = upload(server, "narrator", clip(2.0))
    assert r.status_code == 201, r.text
    assert r.headers["location"] == "/v1/references/narrator"
    created = r.json()
    assert created["id"] == "narrator" and created["text"] == TRANSCRIPT and created["encoded"] is True
    assert abs(created["duration_s"] - 2.0) < 0.01
    meta = json.loads((root / "narrator" / "voice.json").read_text())  # cached on disk, codes included
    assert (root / "narrator" / meta["references"][0]["codes"]).is_file()

    listed = httpx.get(f"{base}/v1/references").json()
    assert listed["default"] == "default"
    assert [v["id"] for v in listed["references"]] == ["narrator"]
    assert httpx.get(f"{base}/v1/references/narrator").json()["duration_s"] == created["duration_s"]

    body = {"text": "Hi there.", "format": "pcm", "seed": 1}
    cloned = httpx.post(f"{base}/v1/tts", json={**body, "reference_id": "narrator"}, timeout=60)
    assert cloned.status_code == 200
    assert_not_silent(s16(cloned.content))
    plain = httpx.post(f"{base}/v1/tts", json=body, timeout=60)
    assert plain.content != cloned.content

    assert_error(upload(server, "narrator", clip(1.5)), 409, "voice_exists", "DELETE /v1/references/narrator")
    replaced = upload(server, "narrator", clip(3.0, seed=1), replace="true")
    assert replaced.status_code == 201 and abs(replaced.json()["duration_s"] - 3.0) < 0.01

    deleted = httpx.delete(f"{base}/v1/references/narrator")
    assert deleted.status_code == 200 and deleted.json() == {"id": "narrator", "deleted": True}
    assert not (root / "narrator").exists()
    assert_error(httpx.delete(f"{base}/v1/references/narrator"), 404, "unknown_voice")
    assert_error(httpx.get(f"{base}/v1/references/narrator"), 404, "unknown_voice", "GET /v1/references")
    assert_error(httpx.post(f"{base}/v1/tts", json={**body, "reference_id": "narrator"}), 404, "unknown_voice")


def test_unknown_voice_ids_leave_nothing_behind(server: ServerHandle) -> None:
    locks = server.gateway.voices._locks
    before = len(locks)
    for i in range(50):
        body = {"text": "Hi.", "format": "pcm", "reference_id": f"nobody-{i}"}
        assert_error(httpx.post(f"{server.base_url}/v1/tts", json=body), 404, "unknown_voice")
    assert len(locks) == before  # a lock only for folders that exist: unknown ids cannot grow the server's memory


def test_other_audio_containers_are_accepted(server: ServerHandle) -> None:
    r = upload(server, "flac-voice", clip(1.5, rate_hz=22050, fmt="FLAC"))
    assert r.status_code == 201, r.text
    assert abs(r.json()["duration_s"] - 1.5) < 0.01
    httpx.delete(f"{server.base_url}/v1/references/flac-voice")


@pytest.mark.parametrize(
    ("voice_id", "audio", "text", "status", "code", "needle"),
    [
        ("default", clip(1.5), TRANSCRIPT, 400, "value_out_of_range", "reserved"),
        ("../../etc", clip(1.5), TRANSCRIPT, 400, "value_out_of_range", "voice id"),
        (".hidden", clip(1.5), TRANSCRIPT, 400, "value_out_of_range", "voice id"),
        ("a" * 65, clip(1.5), TRANSCRIPT, 400, "value_out_of_range", "1–64"),
        ("v", b"", TRANSCRIPT, 400, "empty_audio", "empty"),
        ("v", b"RIFF this is not audio at all", TRANSCRIPT, 400, "not_audio", "not a readable audio file"),
        ("v", clip(0.5), TRANSCRIPT, 400, "audio_too_short", "at least 1 s"),
        ("v", clip(50.0, rate_hz=8000), TRANSCRIPT, 400, "audio_too_long", "longer than"),
        ("v", clip(1.5), "   ", 400, "value_out_of_range", "transcript"),
    ],
)
def test_bad_uploads(server: ServerHandle, voice_id, audio, text, status, code, needle) -> None:
    assert_error(upload(server, voice_id, audio, text), status, code, needle)
    assert httpx.get(f"{server.base_url}/v1/references").json()["references"] == []


def test_malformed_forms(server: ServerHandle) -> None:
    url = f"{server.base_url}/v1/references"
    assert_error(httpx.post(url, json={"id": "v", "text": "t"}), 400, "invalid_body", "multipart/form-data")
    assert_error(httpx.post(url, data={"id": "v", "text": "t"}, files={"x": ("a", b"1")}), 400, None, "'audio'")
    assert_error(httpx.post(url, files={"audio": ("a.wav", clip(1.5))}), 400, None, "'id'")
    broken = httpx.post(
        url, content=b"--xyz\r\nnonsense", headers={"content-type": "multipart/form-data; boundary=xyz"}
    )
    assert broken.status_code == 400 and "error" in broken.json()
    status, body = raw_request(
        "127.0.0.1", server.settings.port, "/v1/references",
        {"Content-Type": "multipart/form-data; boundary=xyz", "Content-Length": str(64 * 2**20)},
    )  # fmt: skip
    assert status == 413 and b"payload_too_large" in body


def test_delete_cannot_escape_the_directory(server: ServerHandle, tmp_path) -> None:
    victim = server.settings.references_dir.parent / "victim"  # type: ignore[union-attr]
    victim.mkdir(exist_ok=True)
    (victim / "keep.txt").write_text("still here")
    base = server.base_url
    assert_error(httpx.delete(f"{base}/v1/references/default"), 400, "value_out_of_range", "own voice")
    assert_error(httpx.delete(f"{base}/v1/references/a..b"), 400, "value_out_of_range", "voice id")
    port = server.settings.port
    status, body = raw_request("127.0.0.1", port, "/v1/references/..", {}, "DELETE")
    assert status == 400 and b"voice id" in body
    for raw in ("/v1/references/../victim", "/v1/references/..%2Fvictim", "/v1/references/%2E%2E%2Fvictim"):
        status, _ = raw_request("127.0.0.1", port, raw, {}, "DELETE")
        assert status in (400, 404, 405), (raw, status)
    assert (victim / "keep.txt").read_text() == "still here"


def test_symbolic_links_never_lead_a_voice_outside_the_directory(server: ServerHandle, tmp_path) -> None:
    root = server.settings.references_dir
    assert root is not None
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "s.wav").write_bytes(clip(1.5))
    (outside / "s.lab").write_text("A transcript that lives elsewhere.")
    (root / "linked").symlink_to(outside, target_is_directory=True)  # a folder link
    (root / "filelinks").mkdir()
    (root / "filelinks" / "s.wav").symlink_to(outside / "s.wav")  # file links in a real folder
    (root / "filelinks" / "s.lab").symlink_to(outside / "s.lab")
    base = server.base_url
    for voice_id in ("linked", "filelinks"):
        body = {"text": "Hi.", "format": "pcm", "reference_id": voice_id}
        assert_error(httpx.post(f"{base}/v1/tts", json=body), 404, "unknown_voice")
    assert {"linked", "filelinks"}.isdisjoint(v["id"] for v in httpx.get(f"{base}/v1/references").json()["references"])
    assert_error(httpx.delete(f"{base}/v1/references/linked"), 404, "unknown_voice")
    assert sorted(p.name for p in outside.iterdir()) == ["s.lab", "s.wav"]  # nothing written there, nothing deleted
    # an upload under a linked id replaces the link with a real folder, and writes nothing through it
    assert upload(server, "linked", clip(1.5)).status_code == 201
    assert not (root / "linked").is_symlink() and sorted(p.name for p in outside.iterdir()) == ["s.lab", "s.wav"]
    httpx.delete(f"{base}/v1/references/linked")


def test_a_voice_id_with_a_trailing_newline_is_refused(server: ServerHandle) -> None:
    assert_error(upload(server, "nl\n", clip(1.5)), 400, "value_out_of_range")


def test_a_transcript_longer_than_any_clip_says_is_refused(server: ServerHandle) -> None:
    assert_error(upload(server, "wordy", clip(1.5), text="word " * 401), 400, "text_too_long", "2000")

"""Languages end to end over every endpoint (issue 37).

The English default voice refuses text mostly in scripts its normaliser drops (HTTP 400 / `error` + `finish(error)`,
counted by code in /metrics) and speaks English with a foreign name in it. With Fish Speech 1.5's layout (the tiny
upstream fixture DualAR, official byte-level tokenizer, beside the test codec) every language reaches the model
intact: each segment's prompt tokens are upstream's `<|im_start|>user\\n{clean_text(segment)}<|im_end|>
<|im_start|>assistant\\n<|voice|>`, byte for byte, for text sent whole or streamed token by token.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from model.text_split import clean_text, split_text
from tests.model.fixture_sets import fixtures_root
from tests.server.conftest import ServerHandle, start_server
from tests.server.http_helpers import assert_error
from tests.server.live_client import LiveClient, LiveResult, open_live, speak

ASSETS = Path(__file__).resolve().parents[1] / "assets" / "random_tiny_model"
FIXTURE = "dual_ar_tiny_samefast"  # the official layout (fast dims == slow dims)

TEXTS = {
    "zh": "今天天气很好，我们去公园散步吧。你觉得怎么样？",
    "ja": "こんにちは、今日はいい天気ですね。散歩に行きませんか？",
    "ko": "안녕하세요, 오늘 날씨가 정말 좋네요. 산책하러 갈까요?",
    "ar": "مرحبا، الطقس جميل اليوم. هل تريد أن نتمشى؟",
    "ru": "Привет, сегодня отличная погода. Пойдём гулять?",
    "fr": "Bonjour, il fait très beau aujourd’hui. On va se promener à côté du café ?",
    "de": "Guten Tag, heute ist schönes Wetter. Gehen wir über die Straße spazieren?",
}


def metric(server: ServerHandle, code: str) -> float:
    text = httpx.get(f"{server.base_url}/metrics").text
    line = next((ln for ln in text.splitlines() if ln.startswith(f'fishgate_errors_total{{code="{code}"}}')), None)
    return 0.0 if line is None else float(line.split()[-1])


# ---- the English default voice -------------------------------------------------------------------------------------


def test_default_voice_refuses_other_scripts_over_http_naming_the_fix(server: ServerHandle) -> None:
    before = metric(server, "unsupported_language")
    for text in (TEXTS["zh"], TEXTS["ru"]):
        r = httpx.post(f"{server.base_url}/v1/tts", json={"text": text, "format": "pcm"}, timeout=60)
        assert_error(r, 400, "unsupported_language", "Fish Speech 1.5", "--checkpoint")
    r = httpx.post(f"{server.base_url}/v1/audio/speech", json={"input": TEXTS["ja"], "voice": "alloy"}, timeout=60)
    assert_error(r, 400, "unsupported_language", "Hiragana")
    # a refusal comes before any audio, even when the unreadable sentence is not the first one
    r = httpx.post(f"{server.base_url}/v1/tts", json={"text": "Hello there. " + TEXTS["ko"]}, timeout=60)
    assert_error(r, 400, "unsupported_language", "Hangul")
    assert metric(server, "unsupported_language") == before + 4


def test_default_voice_speaks_english_with_a_foreign_name_accents_numbers_and_symbols(server: ServerHandle) -> None:
    text = "Please call 王小明 tomorrow at 5 pm. Zoë paid €25 at the Café Müller — 50% off!"
    r = httpx.post(f"{server.base_url}/v1/tts", json={"text": text, "format": "pcm", "seed": 1}, timeout=60)
    assert r.status_code == 200 and len(r.content) > 0


def test_default_voice_refuses_on_the_live_socket_and_the_socket_stays_usable(server: ServerHandle) -> None:
    before = metric(server, "unsupported_language")

    async def main() -> tuple[LiveResult, LiveResult]:
        async with open_live(server.ws_url) as ws:
            client = LiveClient(ws)
            await client.start()
            for token in llm_tokens(TEXTS["zh"]):
                await client.send({"event": "text", "text": token})
            await client.send({"event": "stop"})
            failed = await client.read_until(LiveResult())
            # the refusal ends the utterance at once (one finish(error)); the rest of the turn is dropped, and the
            # next start opens a new turn on the same socket
            await client.start(text="Hello there.", seed=2)
            await client.send({"event": "stop"})
            return failed, await client.read_until(LiveResult())

    failed, spoken = asyncio.run(main())
    assert set(failed.error_codes) == {"unsupported_language"} and not failed.audio
    # one finish for the failed utterance, after its refusal: the refusal of each segment already queued when the
    # stop arrived may come first (one error each), but never a second finish
    kinds = [e["event"] for e in failed.events]
    assert kinds[0] == "started" and kinds[1] == "error" and set(kinds[2:-1]) <= {"error", "cancelled"}
    assert failed.events[-1] == {"event": "finish", "reason": "error"}
    assert "Fish Speech 1.5" in failed.of("error")[0]["message"]
    assert spoken.events[-1] == {"event": "finish", "reason": "stop"} and spoken.audio
    assert metric(server, "unsupported_language") >= before + 1


# ---- Fish Speech 1.5's layout: every language reaches the model intact -----------------------------------------------


def llm_tokens(text: str) -> list[str]:
    """Text as an LLM streams it: words with their leading space, other scripts one or two characters a token."""
    tokens = re.findall(r" ?[^\W\d_]{1,4}|\s+|.", text)
    assert "".join(tokens) == text
    return tokens


def upstream_segment_ids(segment: str, ids: dict) -> list[int]:
    """Upstream's prompt for one segment with the fixture's byte-level tokenizer (spec §2.1, §2.5, §3): one token a
    UTF-8 byte, the specials after the 256 byte ranks."""
    return [
        ids["im_start_id"], *b"user\n", *clean_text(segment).encode(), ids["im_end_id"],
        ids["im_start_id"], *b"assistant\n", ids["voice_id"],
    ]  # fmt: skip


@pytest.fixture(scope="module")
def fish_server(tmp_path_factory) -> Iterator[tuple[ServerHandle, list[tuple[str, list[int]]]]]:
    """A server on the fixture DualAR (official folder layout, no text normaliser) and the test codec; yields it with
    the (segment text, prompt ids) the engine prepared, in order."""
    src = fixtures_root() / FIXTURE
    if not src.exists():
        pytest.skip(f"fixture set {src} not found")
    folder = tmp_path_factory.mktemp("fish15")
    for name in ("config.json", "model.safetensors", "tokenizer.tiktoken", "special_tokens.json"):
        shutil.copy(src / name, folder / name)
    for name in ("codec_config.json", "generator.safetensors"):
        shutil.copy(ASSETS / name, folder / name)
    # no text_normalizer (as official folders); a short frame cap keeps the random weights' speech short
    (folder / "fishgate.json").write_text(json.dumps({"name": "fixture", "max_frames_per_char": 0.2}))
    with start_server(tmp_path_factory.mktemp("srv"), checkpoint=folder, device="cpu") as handle:
        backend = handle.gateway.engine._worker.b  # type: ignore[union-attr]
        seen: list[tuple[str, list[int]]] = []
        lock = threading.Lock()
        prepare = backend.prepare_segment

        def recording(text: str):  # a pass-through spy: what the model is given
            model_text, tokens = prepare(text)
            with lock:
                seen.append((text, tokens[0].tolist()))
            return model_text, tokens

        backend.prepare_segment = recording
        yield handle, seen


def check_intact(seen: list[tuple[str, list[int]]], text: str) -> None:
    ids = json.loads((fixtures_root() / FIXTURE / "fixtures_meta.json").read_text())["tokenizer"]
    segments = list(dict.fromkeys(t for t, _ in seen))  # a segment may be prepared twice (caller, then worker)
    assert "".join(segments).replace(" ", "") == text.replace(" ", ""), segments  # nothing dropped or changed
    for segment, tokens in seen:
        assert tokens == upstream_segment_ids(segment, ids), segment
    # upstream's own splitting keeps the same cleaned characters in the same order, as ours does
    cleaned = "".join(clean_text(segment) for segment in segments)
    assert "".join(split_text(text, 300)).replace(" ", "") == cleaned.replace(" ", "")


@pytest.mark.parametrize("lang", list(TEXTS))
def test_every_language_reaches_the_model_intact_over_every_endpoint(fish_server, lang: str) -> None:
    server, seen = fish_server
    text = TEXTS[lang]
    base = {"format": "pcm", "max_new_tokens": 8, "seed": 3}
    cases = {
        "fish /v1/tts": lambda: httpx.post(f"{server.base_url}/v1/tts", json={"text": text, **base}, timeout=120),
        "openai": lambda: httpx.post(
            f"{server.base_url}/v1/audio/speech",
            json={"input": text, "voice": "alloy", "response_format": "pcm"},
            timeout=120,
        ),
        "live, whole": lambda: asyncio.run(speak(server.ws_url, [], text=text, **base)),
        "live, token by token": lambda: asyncio.run(speak(server.ws_url, llm_tokens(text), **base)),
    }
    for name, send in cases.items():
        seen.clear()
        result = send()
        if isinstance(result, httpx.Response):
            assert result.status_code == 200, (name, result.text)
        else:
            assert result.events[-1] == {"event": "finish", "reason": "stop"}, (name, result.events)
        check_intact(seen, text)

"""A seeded request gives the same PCM through `/v1/tts/live`, `/v1/tts` and `/v1/audio/speech` (24 kHz s16le).

The live side is a raw `websockets` client speaking msgpack (whole text in one text event, then stop). The HTTP
runner cuts text with the live segmenter's config, and sampling defaults are shared, so the prompts, the seeds and
therefore the codes are equal; seeded streams also get clock-independent vocoder chunk boundaries, so the PCM is
byte-identical, one segment or several (on CPU, where the engine is batch-invariant).
"""

from __future__ import annotations

import asyncio

import httpx
import msgpack
import pytest
from websockets.asyncio.client import connect

from tests.server.conftest import ServerHandle
from tests.server.http_helpers import assert_not_silent, s16

ONE_SEGMENT = "Hello there, this is a single segment test."
SEGMENTS = "Good morning. A second sentence here."
RATE_HZ = 24000


async def _live(server: ServerHandle, text: str, seed: int, **fields: float) -> bytes:
    request = {"text": "", "format": "pcm", "sample_rate": RATE_HZ, "seed": seed, **fields}
    audio = []
    async with connect(server.ws_url, max_size=None) as ws:
        for event in ({"event": "start", "request": request}, {"event": "text", "text": text}, {"event": "stop"}):
            await ws.send(msgpack.packb(event, use_bin_type=True))
        async for frame in ws:
            event = msgpack.unpackb(frame, raw=False)
            assert event["event"] != "error", event
            if event["event"] == "audio":
                audio.append(event["audio"])
            elif event["event"] == "finish":
                assert event["reason"] == "stop"
                break
    return b"".join(audio)


def live_pcm(server: ServerHandle, text: str, seed: int, **fields: float) -> bytes:
    """One utterance over /v1/tts/live; `fields` go into the request (temperature=…)."""
    return asyncio.run(_live(server, text, seed, **fields))


def fish_pcm(server: ServerHandle, text: str, seed: int) -> bytes:
    body = {"text": text, "format": "pcm", "sample_rate": RATE_HZ, "seed": seed}
    r = httpx.post(f"{server.base_url}/v1/tts", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.content


def openai_pcm(server: ServerHandle, text: str, seed: int) -> bytes:
    body = {"model": "tts-1", "voice": "alloy", "input": text, "response_format": "pcm", "seed": seed}
    r = httpx.post(f"{server.base_url}/v1/audio/speech", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.content


@pytest.mark.parametrize("seed", [11, 12])
def test_one_segment_is_byte_identical_across_apis(server: ServerHandle, seed: int) -> None:
    live = live_pcm(server, ONE_SEGMENT, seed)
    assert_not_silent(s16(live))
    assert len(live) > RATE_HZ  # more than half a second
    assert fish_pcm(server, ONE_SEGMENT, seed) == live
    assert openai_pcm(server, ONE_SEGMENT, seed) == live


def test_seeds_differ(server: ServerHandle) -> None:
    assert fish_pcm(server, ONE_SEGMENT, 11) != fish_pcm(server, ONE_SEGMENT, 12)


def test_several_segments_are_byte_identical_across_apis(server: ServerHandle) -> None:
    live = live_pcm(server, SEGMENTS, 13)
    assert fish_pcm(server, SEGMENTS, 13) == live
    assert openai_pcm(server, SEGMENTS, 13) == live
    assert fish_pcm(server, SEGMENTS, 14) != live

"""`streaming.synth` and `fishgate synth`: one-shot synthesis equals what `/v1/tts/live` streams for the same seed."""

from __future__ import annotations

import asyncio

import msgpack
import numpy as np
import pytest
import soundfile as sf
from websockets.asyncio.client import connect

from server.cli import main
from streaming.audio_encoders import encode_wav, float_to_s16le
from streaming.segmenter import SegmenterConfig
from streaming.session import SynthesisSettings
from streaming.synth import reference_voice, segment_text, synthesize
from tests.server.conftest import start_server

SEED = 1234
# Three segments (a first sentence is cut at once; later ones need 50 chars): history conditioning is exercised.
TEXT = "Hi there. The second sentence has a clause, and then it ends. Yes?"
RECV_TIMEOUT_S = 60.0


async def _live_pcm(url: str, text: str, seed: int, references: list | None = None) -> bytes:
    """Text sent at once, then stop, over the real WebSocket; pcm at 44.1 kHz."""
    audio = bytearray()
    async with connect(url, max_size=2**25) as ws:
        request = {"text": "", "format": "pcm", "sample_rate": 44100, "seed": seed, "references": references or []}
        await ws.send(msgpack.packb({"event": "start", "request": request}))
        await ws.send(msgpack.packb({"event": "text", "text": text}))
        await ws.send(msgpack.packb({"event": "stop"}))
        while True:
            event = msgpack.unpackb(await asyncio.wait_for(ws.recv(), RECV_TIMEOUT_S))
            if event["event"] == "audio":
                audio.extend(event["audio"])
            elif event["event"] == "error":
                raise AssertionError(f"server error: {event}")
            elif event["event"] == "finish":
                assert event["reason"] == "stop"
                return bytes(audio)


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    with start_server(tmp_path_factory.mktemp("synth")) as handle:
        pcm = asyncio.run(_live_pcm(handle.ws_url, TEXT, SEED))
        yield handle, pcm


def test_text_splits_into_several_segments() -> None:
    assert len(segment_text(TEXT, SegmenterConfig())) >= 3


def model_settings(handle, seed: int) -> SynthesisSettings:
    """What the live endpoint builds for a request naming only a seed: the served model's sampling defaults."""
    return handle.gateway.sampling_defaults().applied_to(SynthesisSettings(seed=seed))


def test_synthesize_equals_live_stream(live) -> None:
    handle, live_pcm = live
    assert len(live_pcm) >= 2 * 2048 * 40  # at least 40 frames of audio

    async def run() -> np.ndarray:
        return await synthesize(handle.gateway.engine, TEXT, settings=model_settings(handle, SEED))

    async def other_seed() -> np.ndarray:
        return await synthesize(handle.gateway.engine, TEXT, settings=model_settings(handle, SEED + 1))

    assert float_to_s16le(asyncio.run(run())) == live_pcm
    assert float_to_s16le(asyncio.run(other_seed())) != live_pcm  # the seed matters: the equality is no coincidence


def test_cli_writes_wav_equal_to_live_stream(live, tmp_path, capsys) -> None:
    _, live_pcm = live
    out = tmp_path / "out" / "speech.wav"
    assert main(["synth", TEXT, "-o", str(out), "--seed", str(SEED), "--device", "cpu"]) == 0
    assert "wrote" in capsys.readouterr().out
    samples, rate = sf.read(out, dtype="int16")
    assert rate == 44100
    assert samples.tobytes() == live_pcm


def test_reference_voice_equals_live_inline_reference(live) -> None:
    handle, _ = live
    rng = np.random.default_rng(0)
    ref_wav = encode_wav(0.3 * rng.standard_normal(2 * 22050).astype(np.float32), 22050)  # 2 s at 22.05 kHz
    ref_text = "A made up transcript of the reference."
    text = "Cloned voices take the same path."
    live_cloned = asyncio.run(_live_pcm(handle.ws_url, text, SEED, [{"audio": ref_wav, "text": ref_text}]))

    async def run() -> tuple[np.ndarray, np.ndarray]:
        engine = handle.gateway.engine
        voice = await reference_voice(engine, ref_wav, ref_text, min_duration_s=1.0, max_duration_s=60.0)
        assert voice.references[0][0] == ref_text and voice.references[0][1].shape[0] == engine.info.num_codebooks
        cloned = await synthesize(engine, text, voice, model_settings(handle, SEED))
        plain = await synthesize(engine, text, settings=model_settings(handle, SEED))
        return cloned, plain

    cloned, plain = asyncio.run(run())
    assert float_to_s16le(cloned) == live_cloned
    assert float_to_s16le(plain) != live_cloned  # the reference changed the prompt


def test_cli_refuses_voice_audio_without_text(tmp_path, capsys) -> None:
    code = main(["synth", "Hello.", "-o", str(tmp_path / "x.wav"), "--voice-audio", str(tmp_path / "ref.wav")])
    assert code == 2
    assert "--voice-text" in capsys.readouterr().err

"""The official Fish Audio SDK clients, unchanged, against a real fishgate server."""

from __future__ import annotations

import io

import numpy as np
import soundfile as sf
from fish_audio_sdk import TTSRequest, WebSocketSession
from fishaudio import FishAudio

from tests.server.conftest import ServerHandle
from tests.server.http_helpers import FRAME_SAMPLES

TEXT = ["Hello ", "there, this is ", "a streaming test. ", "And a second sentence."]


def test_current_sdk_streams_pcm(server: ServerHandle) -> None:
    client = FishAudio(api_key="anything", base_url=server.base_url)
    before = server.vocoded_frames()
    audio = b"".join(client.tts.stream_websocket(iter(TEXT), format="pcm"))
    pcm = np.frombuffer(audio, dtype="<i2")
    # whole 44.1 kHz frames: every sample the vocoder made for this session, nothing else
    assert len(audio) % 2 == 0 and len(pcm) == (server.vocoded_frames() - before) * FRAME_SAMPLES > 0
    assert np.abs(pcm).max() > 100  # not silence


def test_legacy_sdk_streams_wav(server: ServerHandle) -> None:
    before = server.vocoded_frames()
    with WebSocketSession("anything", base_url=server.base_url) as ws:
        data = b"".join(ws.tts(TTSRequest(text="", format="wav"), iter(["Legacy client says hello."])))
    pcm, rate = sf.read(io.BytesIO(data), dtype="int16")
    assert rate == 44100 and len(pcm) == (server.vocoded_frames() - before) * FRAME_SAMPLES > 0

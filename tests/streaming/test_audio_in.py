"""Reference-audio decoding: formats read back, limits checked before full decoding, clear error codes."""

from __future__ import annotations

import io

import numpy as np
import pytest
import soundfile as sf

from streaming import audio_in
from streaming.audio_encoders import encode_wav, wav_header
from streaming.audio_in import ReferenceAudioError, decode_audio_file
from tests.streaming.audio_helpers import sine


def decode(data: bytes) -> tuple[np.ndarray, int]:
    return decode_audio_file(data, max_bytes=5_000_000, min_duration_s=0.5, max_duration_s=10.0)


def file_bytes(x: np.ndarray, rate_hz: int, **kw) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, x, rate_hz, **kw)
    return buf.getvalue()


def test_wav_stereo_is_mixed_to_mono():
    left, right = sine(440.0, 1.0, 22050, 0.4), sine(440.0, 1.0, 22050, 0.2)
    y, rate = decode(file_bytes(np.stack([left, right], axis=1), 22050, format="WAV"))
    assert rate == 22050 and y.dtype == np.float32 and y.shape == (22050,)
    np.testing.assert_allclose(y, (left + right) / 2, atol=1e-4)


@pytest.mark.parametrize(("fmt", "subtype"), [("FLAC", "PCM_16"), ("OGG", "VORBIS"), ("OGG", "OPUS"), ("MP3", None)])
def test_compressed_files_decode(fmt, subtype):
    rate_hz = 48000
    data = file_bytes(sine(300.0, 1.0, rate_hz), rate_hz, format=fmt, subtype=subtype)
    y, rate = decode(data)
    assert rate == rate_hz and abs(y.size - rate_hz) < 0.05 * rate_hz


def test_streamed_wav_with_unknown_length_decodes():
    x = sine(440.0, 1.0, 16000)
    data = wav_header(16000) + encode_wav(x, 16000)[44:]
    y, rate = decode(data)
    assert rate == 16000 and y.size == x.size


@pytest.mark.parametrize(
    ("data", "code"),
    [
        (b"", "empty_audio"),
        (b"hello, this is plainly text and not audio at all" * 10, "not_audio"),
        (b"\x89PNG\r\n\x1a\n" + bytes(200), "not_audio"),
        (np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes(), "not_audio"),
        (b"RIFF\x24\x00\x00\x00WAVEfmt ", "not_audio"),  # truncated header
    ],
)
def test_non_audio_is_rejected(data, code):
    with pytest.raises(ReferenceAudioError) as info:
        decode(data)
    assert info.value.code == code and isinstance(info.value, ValueError)


def test_too_large_is_rejected_before_parsing(monkeypatch):
    monkeypatch.setattr(audio_in.sf, "info", lambda *_: pytest.fail("parsed an oversized upload"))
    with pytest.raises(ReferenceAudioError, match="limit is 100 bytes") as info:
        decode_audio_file(bytes(101), max_bytes=100, min_duration_s=0.0, max_duration_s=1.0)
    assert info.value.code == "audio_too_large"


def test_too_long_is_rejected_from_the_header_without_decoding(monkeypatch):
    data = encode_wav(np.zeros(16000 * 11, np.float32), 16000)
    monkeypatch.setattr(sf.SoundFile, "read", lambda *_, **__: pytest.fail("decoded a file the header rules out"))
    with pytest.raises(ReferenceAudioError, match="at most 10 s") as info:
        decode(data)
    assert info.value.code == "audio_too_long"


def test_too_long_without_length_in_header_is_caught_by_capped_decoding():
    data = wav_header(16000) + encode_wav(np.zeros(16000 * 11, np.float32), 16000)[44:]
    with pytest.raises(ReferenceAudioError) as info:
        decode(data)
    assert info.value.code == "audio_too_long"


def test_too_short_is_rejected():
    with pytest.raises(ReferenceAudioError, match=r"at least 0\.5 s") as info:
        decode(encode_wav(np.zeros(1600, np.float32), 16000))
    assert info.value.code == "audio_too_short"


def test_too_many_channels_is_rejected():
    data = file_bytes(np.zeros((16000, 9), np.float32), 16000, format="WAV")
    with pytest.raises(ReferenceAudioError) as info:
        decode(data)
    assert info.value.code == "too_many_channels"


def test_nan_samples_are_rejected():
    x = np.full(16000, np.nan, np.float32)
    data = file_bytes(x, 16000, format="WAV", subtype="FLOAT")
    with pytest.raises(ReferenceAudioError) as info:
        decode(data)
    assert info.value.code == "bad_audio"

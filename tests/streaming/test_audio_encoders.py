"""Encoders: s16 clipping, WAV headers, MP3/Opus/FLAC through libsndfile, decoded back with soundfile and `wave`."""

from __future__ import annotations

import io
import struct
import wave

import numpy as np
import pytest
import soundfile as sf

from streaming.audio_encoders import (
    WAV_UNKNOWN_SIZE,
    FlacEncoder,
    Mp3Encoder,
    OpusEncoder,
    WavEncoder,
    _AppendSink,
    codec_sample_rate_hz,
    encode_wav,
    float_to_s16le,
    mp3_frame_bytes,
    wav_header,
)
from tests.streaming.audio_helpers import decode, dominant_hz, sine


def encode_all(encoder, x: np.ndarray, chunk: int = 4800) -> list[bytes]:
    return [encoder.encode(x[i : i + chunk]) for i in range(0, x.size, chunk)] + [encoder.finish()]


def test_s16_clips_never_wraps():
    x = np.array([-3.0, -1.5, -1.0, -0.5, 0.0, 0.5, 1.0, 1.5, 3.0, np.nan, 1e30], np.float32)
    got = np.frombuffer(float_to_s16le(x), "<i2")
    np.testing.assert_array_equal(got, [-32767, -32767, -32767, -16384, 0, 16384, 32767, 32767, 32767, 0, 32767])


@pytest.mark.parametrize("n", [1, 4096, 49_152])
def test_s16_fast_path_equals_the_plain_formula(n: int) -> None:
    """float_to_s16le's in-place path against the formula it replaces, finite and non-finite chunks alike, and it
    leaves the caller's samples alone."""
    rng = np.random.default_rng(n)
    finite = (rng.standard_normal(n) * 0.8).astype(np.float32)
    bad = finite.copy()
    bad[::97], bad[n // 2], bad[-1] = np.nan, np.inf, -np.inf
    for x in (finite, bad, finite.astype(np.float64)):
        before = x.copy()
        plain = np.rint(np.clip(np.nan_to_num(x.astype(np.float32), nan=0.0), -1.0, 1.0) * 32767.0).astype("<i2")
        assert float_to_s16le(x) == plain.tobytes()
        np.testing.assert_array_equal(x, before)


def test_streaming_wav_header_uses_unknown_size_sentinel_and_reads_back():
    header = wav_header(24000)
    assert len(header) == 44 and header[:4] == b"RIFF" and header[8:16] == b"WAVEfmt "
    assert struct.unpack("<I", header[4:8])[0] == WAV_UNKNOWN_SIZE
    assert struct.unpack("<I", header[40:44])[0] == WAV_UNKNOWN_SIZE
    x = sine(440.0, 0.5, 24000)
    enc = WavEncoder(24000)
    chunks = encode_all(enc, x)
    assert chunks[0][:44] == header and all(c[:4] != b"RIFF" for c in chunks[1:])
    stream = b"".join(chunks)
    pcm = float_to_s16le(x)
    y, rate = sf.read(io.BytesIO(stream), dtype="int16")  # libsndfile: data runs to the end of the stream
    assert rate == 24000 and y.tobytes() == pcm
    with wave.open(io.BytesIO(stream)) as w:  # Python's wave reads to EOF as well
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (24000, 1, 2)
        assert w.readframes(10**9) == pcm


def test_empty_wav_stream_is_header_only():
    enc = WavEncoder(16000)
    assert enc.finish() == wav_header(16000)
    y, rate = decode(wav_header(16000))
    assert rate == 16000 and y.size == 0


def test_complete_wav_has_exact_lengths():
    x = sine(1000.0, 0.25, 16000)
    data = encode_wav(x, 16000)
    assert struct.unpack("<I", data[4:8])[0] == len(data) - 8
    assert struct.unpack("<I", data[40:44])[0] == len(data) - 44 == 2 * x.size
    with wave.open(io.BytesIO(data)) as w:
        assert w.getnframes() == x.size
    assert sf.info(io.BytesIO(data)).frames == x.size


def test_mp3_frame_bytes_from_header():
    assert mp3_frame_bytes(bytes.fromhex("fffb90c4")) == 417  # MPEG-1 L3 128 kbps 44.1 kHz: 144·128000/44100
    assert mp3_frame_bytes(bytes.fromhex("fffb92c4")) == 418  # same, padded
    assert mp3_frame_bytes(bytes.fromhex("fff3a8c4")) == 72 * 96000 // 16000  # MPEG-2 L3 96 kbps 16 kHz
    assert mp3_frame_bytes(b"RIFF") is None and mp3_frame_bytes(b"\xff\xfb") is None


def test_append_sink_applies_pending_patches_and_drops_sent_ones():
    sink = _AppendSink()
    sink.write(b"abcdef")
    sink.seek(1)
    sink.write(b"XY")  # lands on pending bytes: applied
    sink.seek(0, io.SEEK_END)
    assert sink.take() == b"aXYdef"
    sink.write(b"gh")
    sink.seek(4)
    sink.write(b"ZZZZ")  # first two bytes were already taken: dropped; the rest overwrite "gh"
    assert sink.take() == b"ZZ" and sink.dropped_patch_bytes == 2


@pytest.mark.parametrize("rate_hz", [8000, 16000, 22050, 24000, 32000, 44100, 48000])
def test_mp3_every_accepted_rate(rate_hz):
    x = sine(440.0, 1.0, rate_hz)
    stream = b"".join(encode_all(Mp3Encoder(rate_hz, 64), x))
    assert stream[:2] in (b"\xff\xfb", b"\xff\xf3", b"\xff\xe3")  # starts on a frame, reserved tag frame stripped
    y, rate = decode(stream)
    assert rate == rate_hz
    assert 0 <= y.size - x.size <= 2304  # LAME's start delay plus end padding: about two frames
    assert abs(dominant_hz(y, rate)[0] - 440.0) < 4.4


@pytest.mark.parametrize("kbps", [64, 128, 192])
def test_mp3_bitrate_is_the_requested_one(kbps):
    x = sine(440.0, 2.0) + np.random.default_rng(0).normal(0, 0.05, 88200).astype(np.float32)
    stream = b"".join(encode_all(Mp3Encoder(44100, kbps), x))
    assert abs(len(stream) * 8 / 2.0 / 1000 - kbps) / kbps < 0.05
    assert stream[2] >> 4 == {64: 5, 128: 9, 192: 11}[kbps]  # bitrate index of the first frame header


def test_mp3_frames_stream_before_finish():
    enc = Mp3Encoder(44100, 128)
    x = sine(440.0, 2.0)
    chunks = encode_all(enc, x, chunk=8820)  # 200 ms pushes
    assert chunks[0] and sum(map(len, chunks[:-1])) > 0.9 * sum(map(len, chunks))
    for c in chunks[:-1]:  # each push returns whole frames, back to back
        pos = 0
        while pos < len(c):
            frame_bytes = mp3_frame_bytes(c[pos : pos + 4])
            assert frame_bytes is not None, f"push output is not whole frames (no header at byte {pos})"
            pos += frame_bytes
        assert pos == len(c)


def test_opus_header_pages_then_audio_pages_stream():
    enc = OpusEncoder(48000, 32, 48000)
    chunks = encode_all(enc, sine(440.0, 2.0, 48000), chunk=9600)  # 200 ms pushes
    assert chunks[0][:4] == b"OggS" and b"OpusHead" in chunks[0] and b"OpusTags" in chunks[0]
    assert all(c[:4] == b"OggS" for c in chunks if c)  # whole pages only
    assert all(chunks[1:-1])  # every later push carries audio pages
    y, rate = decode(b"".join(chunks))
    assert rate == 48000 and y.size == 96000
    assert abs(dominant_hz(y, rate)[0] - 440.0) < 4.4


def test_opus_runs_at_next_opus_rate_and_records_the_requested_one():
    assert [codec_sample_rate_hz("opus", r) for r in (8000, 16000, 22050, 24000, 32000, 44100, 48000)] == [
        8000, 16000, 24000, 24000, 48000, 48000, 48000
    ]  # fmt: skip
    assert codec_sample_rate_hz("mp3", 44100) == 44100
    stream = b"".join(encode_all(OpusEncoder(48000, None, 44100), sine(440.0, 0.5, 48000)))
    head = stream.index(b"OpusHead")
    assert struct.unpack("<I", stream[head + 12 : head + 16])[0] == 44100  # OpusHead input sample rate
    _, rate = decode(stream)
    assert rate == 48000


@pytest.mark.parametrize("kbps", [24, 64])
def test_opus_bitrate_is_near_the_requested_one(kbps):
    x = sine(440.0, 3.0, 48000) + np.random.default_rng(0).normal(0, 0.1, 144000).astype(np.float32)
    stream = b"".join(encode_all(OpusEncoder(48000, kbps, 48000), x))
    third_page = stream.index(b"OggS", stream.index(b"OpusTags"))  # first audio page, after OpusHead and OpusTags
    audio_kbps = (len(stream) - third_page) * 8 / 3.0 / 1000
    assert kbps <= audio_kbps < 1.1 * kbps + 4  # libopus VBR lands a little above target; Ogg adds ~1 kbps


def test_flac_is_whole_file_at_finish_with_exact_length():
    x = sine(440.0, 1.0, 44100)
    chunks = encode_all(FlacEncoder(44100), x)
    assert not any(chunks[:-1]) and chunks[-1][:4] == b"fLaC"
    assert sf.info(io.BytesIO(chunks[-1])).frames == x.size
    y, rate = sf.read(io.BytesIO(chunks[-1]), dtype="int16")
    assert rate == 44100 and y.tobytes() == float_to_s16le(x)  # lossless


@pytest.mark.parametrize("fmt", ["mp3", "opus"])
def test_first_audio_bytes_within_100_ms_of_input(fmt):
    rate_hz = 48000
    enc = Mp3Encoder(rate_hz, 128) if fmt == "mp3" else OpusEncoder(rate_hz, 32, rate_hz)
    x = sine(440.0, 0.5, rate_hz)
    step = rate_hz // 100  # 10 ms pushes
    outs = [enc.encode(x[i : i + step]) for i in range(0, x.size, step)]
    if fmt == "mp3":
        first_audio = next(k for k, o in enumerate(outs) if o)
    else:  # the first two Ogg pages are OpusHead and OpusTags; the third is the first to carry audio
        pages = np.cumsum([o.count(b"OggS") for o in outs])
        first_audio = int(np.argmax(pages >= 3))
    assert (first_audio + 1) * 10 <= 100

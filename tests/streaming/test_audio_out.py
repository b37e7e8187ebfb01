"""AudioOutput end to end: real encoders, outputs decoded back with soundfile; validation of every field."""

from __future__ import annotations

import io

import numpy as np
import pytest
import soundfile as sf
import soxr

from streaming.audio_out import (
    ACCEPTED_SAMPLE_RATES_HZ,
    AudioFormatError,
    AudioOutput,
    OutputFormat,
    validate_output_format,
)
from tests.streaming.audio_helpers import decode, dominant_hz, push_in_chunks, sine

VOCODER_HZ = 44100
# Extra samples a decoder may return beyond the true length: LAME's start delay plus frame padding (~2 frames).
MP3_SLACK_SAMPLES = 2304


def run(fmt: OutputFormat, x: np.ndarray, seed: int = 0) -> tuple[list[bytes], AudioOutput]:
    out = AudioOutput(fmt)
    chunks = push_in_chunks(out.push, x, seed=seed, lo=2000, hi=20000)  # vocoder-sized pushes: 45–450 ms
    return [*chunks, out.finish()], out


def pcm_samples(data: bytes) -> np.ndarray:
    return np.frombuffer(data, "<i2").astype(np.float32) / 32767


@pytest.mark.parametrize(
    ("fmt", "rate_hz", "bitrate"),
    [
        ("pcm", 24000, None),
        ("pcm", 44100, None),
        ("wav", 16000, None),
        ("wav", 44100, None),
        ("mp3", 44100, 128),
        ("mp3", 22050, 64),
        ("opus", 48000, None),
        ("opus", 44100, 32),
        ("opus", 16000, 24),
        ("flac", 24000, None),
    ],
)
def test_sine_survives_each_format(fmt, rate_hz, bitrate):
    x = sine(440.0, 1.5)
    chunks, out = run(OutputFormat(fmt, rate_hz, bitrate), x)
    data = b"".join(chunks)
    if fmt == "pcm":
        y, got_rate = pcm_samples(data), rate_hz
    else:
        y, got_rate = decode(data)
    assert got_rate == out.codec_sample_rate_hz == (48000 if (fmt, rate_hz) == ("opus", 44100) else rate_hz)
    expected = round(1.5 * got_rate)
    if fmt == "mp3":
        assert 0 <= y.size - expected <= MP3_SLACK_SAMPLES
    else:
        assert abs(y.size - expected) <= 1
    freq, purity = dominant_hz(y, got_rate)
    assert abs(freq - 440.0) < 4.4 and purity > 0.95
    body = y[got_rate // 20 : -got_rate // 20]  # lossy codecs ring at the hard cut where the test tone stops
    assert 0.45 < np.abs(body).max() < 0.55  # level kept through every codec


def test_streamed_pcm_equals_one_shot_resampling():
    rng = np.random.default_rng(0)
    x = (0.3 * rng.standard_normal(3 * VOCODER_HZ)).astype(np.float32)
    reference = np.clip(soxr.resample(x, VOCODER_HZ, 24000, quality="HQ"), -1, 1)
    for seed in (1, 2):
        out = AudioOutput(OutputFormat("pcm", 24000))
        chunks = push_in_chunks(out.push, x, seed=seed, lo=1, hi=9000)
        y = np.frombuffer(b"".join([*chunks, out.finish()]), "<i2").astype(np.int32)
        assert y.size == reference.size
        assert np.abs(y - np.rint(reference * 32767)).max() <= 1  # seamless at every chunk boundary


@pytest.mark.parametrize("fmt", ["mp3", "opus"])
def test_compressed_audio_streams_before_finish(fmt):
    chunks, _ = run(OutputFormat(fmt, 48000), sine(440.0, 3.0))
    streamed = sum(map(len, chunks[:-1]))
    assert chunks[0] and streamed > 0.85 * sum(map(len, chunks))


def test_wav_header_comes_with_first_audio():
    chunks, _ = run(OutputFormat("wav", 24000), sine(440.0, 1.0))
    first = next(c for c in chunks if c)
    assert first[:4] == b"RIFF" and len(first) > 44
    assert sum(c.count(b"RIFF") for c in chunks) == 1


def test_flac_arrives_whole_at_finish():
    chunks, _ = run(OutputFormat("flac", 44100), sine(440.0, 1.0))
    assert not any(chunks[:-1]) and sf.info(io.BytesIO(chunks[-1])).frames == VOCODER_HZ


@pytest.mark.parametrize(("volume_db", "ratio"), [(6.0, 10 ** (6 / 20)), (-20.0, 0.1), (0.0, 1.0)])
def test_volume_scales_amplitude(volume_db, ratio):
    x = sine(440.0, 0.5, amplitude=0.25)
    chunks, _ = run(OutputFormat("pcm", 44100, volume_db=volume_db), x)
    y = pcm_samples(b"".join(chunks))
    assert abs(np.abs(y).max() / 0.25 - ratio) < 0.005 * ratio
    if volume_db == 6.0:
        assert abs(ratio - 2.0) < 0.01  # +6 dB is (almost exactly) double


def test_volume_clips_at_full_scale_without_wrapping():
    x = sine(440.0, 0.5, amplitude=0.8)
    chunks, _ = run(OutputFormat("pcm", 44100, volume_db=6.0), x)
    y = np.frombuffer(b"".join(chunks), "<i2")
    assert y.max() == 32767 and y.min() == -32767
    assert np.all(np.sign(y[x > 0.1]) == 1) and np.all(np.sign(y[x < -0.1]) == -1)  # no wrap-around


def test_input_beyond_full_scale_and_nan_are_clipped():
    x = np.array([3.0, -3.0, 1.5, -1.5, np.nan, np.inf, -np.inf, 0.5], np.float32)
    out = AudioOutput(OutputFormat("pcm", 44100))
    y = np.frombuffer(out.push(x) + out.finish(), "<i2")
    np.testing.assert_array_equal(y, [32767, -32767, 32767, -32767, 0, 32767, -32767, 16384])


@pytest.mark.parametrize(("fmt", "speed"), [("wav", 0.5), ("opus", 1.5), ("mp3", 2.0)])
def test_speed_scales_duration_and_keeps_pitch(fmt, speed):
    chunks, _ = run(OutputFormat(fmt, 24000 if fmt != "opus" else 48000, speed=speed), sine(440.0, 2.0))
    y, rate = decode(b"".join(chunks))
    expected = 2.0 / speed * rate
    slack = MP3_SLACK_SAMPLES if fmt == "mp3" else 0
    assert abs(y.size - expected) <= 0.02 * expected + slack
    assert abs(dominant_hz(y, rate)[0] - 440.0) < 4.4


@pytest.mark.parametrize("fmt", ["pcm", "wav", "opus", "flac", "mp3"])
def test_empty_utterance(fmt):
    out = AudioOutput(OutputFormat(fmt, 48000))
    data = out.finish()
    if fmt in ("wav", "opus", "flac"):  # a readable file of (almost) nothing
        y, _ = decode(data)
        assert y.size <= 1
    else:  # raw PCM, and MP3 (no file header: zero frames is a valid stream)
        assert data == b""


def test_misuse_raises_with_the_fix():
    out = AudioOutput(OutputFormat("pcm", 44100))
    with pytest.raises(ValueError, match=r"1-D array \(T,\)"):
        out.push(np.zeros((2, 100), np.float32))
    out.finish()
    with pytest.raises(RuntimeError, match="new AudioOutput per utterance"):
        out.push(np.zeros(10, np.float32))
    with pytest.raises(RuntimeError, match="twice"):
        out.finish()


def test_media_type_and_counters():
    out = AudioOutput(OutputFormat("opus", 44100))
    assert out.media_type == "audio/ogg; codecs=opus"
    out.push(sine(440.0, 1.0))
    out.finish()
    assert out.samples_in == VOCODER_HZ and out.samples_encoded == 48000


# -- validation -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fmt",
    [
        OutputFormat("pcm", 24000),
        OutputFormat("wav", 8000, bitrate_kbps=999),  # bitrate ignored where the format has none
        OutputFormat("mp3", 44100, 64),
        OutputFormat("mp3", 32000, 192),
        OutputFormat("opus", 48000, 64),
        OutputFormat("opus", 22050, None),
        OutputFormat("flac", 48000),
        OutputFormat("wav", 44100, volume_db=-20.0, speed=0.5),
        OutputFormat("wav", 44100, volume_db=20, speed=2),
        *(OutputFormat("wav", r) for r in ACCEPTED_SAMPLE_RATES_HZ),
    ],
)
def test_valid_formats_pass(fmt):
    validate_output_format(fmt)


@pytest.mark.parametrize(
    ("fmt", "code", "hint"),
    [
        (OutputFormat("aac"), "unsupported_format", "mp3 or opus"),
        (OutputFormat("ogg"), "unsupported_format", "pcm, wav, mp3, opus, flac"),
        (OutputFormat("MP3"), "unsupported_format", "pcm, wav, mp3, opus, flac"),
        (OutputFormat("wav", 11025), "unsupported_sample_rate", "8000, 16000, 22050, 24000, 32000, 44100, 48000"),
        (OutputFormat("wav", 96000), "unsupported_sample_rate", "44100"),
        (OutputFormat("wav", "44100"), "unsupported_sample_rate", "44100"),  # type: ignore[arg-type]
        (OutputFormat("wav", True), "unsupported_sample_rate", "44100"),
        (OutputFormat("mp3", 44100, 96), "unsupported_bitrate", "64, 128, 192"),
        (OutputFormat("mp3", 44100, 320), "unsupported_bitrate", "64, 128, 192"),
        (OutputFormat("opus", 48000, 128), "unsupported_bitrate", "24, 32, 48, 64"),
        (OutputFormat("opus", 48000, -1000), "unsupported_bitrate", "leave it unset"),
        (OutputFormat(speed=0.49), "speed_out_of_range", "0.5 to 2.0"),
        (OutputFormat(speed=2.01), "speed_out_of_range", "0.5 to 2.0"),
        (OutputFormat(speed=float("nan")), "speed_out_of_range", "0.5 to 2.0"),
        (OutputFormat(speed="1"), "speed_out_of_range", "0.5 to 2.0"),  # type: ignore[arg-type]
        (OutputFormat(volume_db=-20.5), "volume_out_of_range", "-20 to 20 dB"),
        (OutputFormat(volume_db=21), "volume_out_of_range", "-20 to 20 dB"),
        (OutputFormat(volume_db=float("inf")), "volume_out_of_range", "-20 to 20 dB"),
    ],
)
def test_invalid_formats_raise_with_code_and_fix(fmt, code, hint):
    with pytest.raises(AudioFormatError) as info:
        validate_output_format(fmt)
    assert isinstance(info.value, ValueError)
    assert info.value.code == code
    assert hint in str(info.value)
    with pytest.raises(AudioFormatError):
        AudioOutput(fmt)  # the pipeline validates too


def test_speed_one_passes_samples_through_untouched():
    """At speed 1.0 (and 0 dB, at the vocoder rate) no stretcher runs: every 16-bit sample is the input's own.

    Even an overlap-add whose windows sum to one moves float32 samples by an ulp, enough to flip some rounded
    16-bit values of a noise signal this long, so any processing at speed 1.0 shows up here.
    """
    rng = np.random.default_rng(3)
    x = (0.3 * rng.standard_normal(3 * VOCODER_HZ)).astype(np.float32)
    chunks, _ = run(OutputFormat("pcm", VOCODER_HZ, speed=1.0), x)
    expected = np.rint(np.clip(x, -1, 1) * 32767).astype("<i2")
    np.testing.assert_array_equal(np.frombuffer(b"".join(chunks), "<i2"), expected)

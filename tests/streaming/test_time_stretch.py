"""WSOLA time-stretch: duration scales by 1/speed, pitch stays, output does not depend on chunking."""

from __future__ import annotations

import numpy as np
import pytest

from streaming.time_stretch import WsolaStretcher
from tests.streaming.audio_helpers import dominant_hz, run_stretcher, sine

RATE_HZ = 44100


def stretch(x: np.ndarray, speed: float, seed: int | None = None) -> np.ndarray:
    return run_stretcher(WsolaStretcher(speed, RATE_HZ), x, seed)


@pytest.mark.parametrize("speed", [0.5, 0.75, 1.5, 2.0])
def test_sine_duration_scales_and_pitch_is_kept(speed):
    x = sine(440.0, 2.0)
    y = stretch(x, speed, seed=1)
    expected = x.size / speed
    assert abs(y.size - expected) / expected < 0.02
    freq, purity = dominant_hz(y[2000:-2000], RATE_HZ)
    assert abs(freq - 440.0) / 440.0 < 0.01
    assert purity > 0.99  # no phase clicks: nearly all energy stays at the tone


@pytest.mark.parametrize("speed", [0.5, 0.6, 0.75, 0.9])
def test_slowed_audio_keeps_its_level_to_the_last_sample(speed):
    """Slowed down, the last frames' positions run past the input's end: they must still read real audio, not the
    zeros the flush pads with (the last 300 samples used to fade to silence at speed 0.5, and to ~35 % at 0.75),
    and chunking must still not matter there."""
    x = sine(200.0, 1.0) + sine(523.0, 1.0, amplitude=0.2)
    y = stretch(x, speed)
    level = float(np.sqrt(np.mean(x**2)))
    tail = float(np.sqrt(np.mean(y[-300:] ** 2)))
    assert tail > 0.8 * level, (tail, level)
    np.testing.assert_array_equal(stretch(x, speed, seed=4), y)


@pytest.mark.parametrize("speed", [0.5, 1.5, 2.0])
def test_chunking_does_not_change_output(speed):
    x = sine(220.0, 1.0) + sine(330.0, 1.0, amplitude=0.2)
    one_shot = stretch(x, speed)
    for seed in (2, 3):
        np.testing.assert_array_equal(stretch(x, speed, seed=seed), one_shot)


def test_tiny_chunks_equal_one_shot():
    x = sine(300.0, 0.3)
    s = WsolaStretcher(1.5, RATE_HZ)
    tiny = np.concatenate([*(s.push(x[i : i + 7]) for i in range(0, x.size, 7)), s.finish()])
    np.testing.assert_array_equal(tiny, stretch(x, 1.5))


def test_output_is_emitted_while_streaming():
    s = WsolaStretcher(1.5, RATE_HZ)
    x = sine(200.0, 1.0)
    early = s.push(x[: RATE_HZ // 2])
    # Output lags input by about one frame plus the tolerance, not by the whole utterance.
    assert early.size > (RATE_HZ // 2) / 1.5 - 0.06 * RATE_HZ


def test_first_hop_passes_through_unchanged():
    x = sine(440.0, 0.5)
    s = WsolaStretcher(0.5, RATE_HZ)
    y = np.concatenate([s.push(x), s.finish()])
    np.testing.assert_array_equal(y[: s.hop_samples], x[: s.hop_samples])


@pytest.mark.parametrize("seed", [None, 4])
def test_speed_one_reproduces_the_input_sample_for_sample(seed):
    """At speed 1.0 every frame is read from where it lands (the best match of the natural successor is itself), so
    the output is the input, same length, same positions, same level, up to float32 rounding of the window sum."""
    x = (0.3 * np.random.default_rng(5).standard_normal(RATE_HZ // 2)).astype(np.float32)
    y = stretch(x, 1.0, seed=seed)
    assert y.size == x.size
    assert np.abs(y - x).max() < 1e-6  # one ulp of 0.3-scale noise is ~3e-8; a shift or a 0.1 % gain is far larger


@pytest.mark.parametrize("speed", [0.5, 2.0])
def test_speech_like_envelope_stays_level(speed):
    # A gliding harmonic tone (140 ± 20 Hz, 7 harmonics) stands in for voiced speech.
    t = np.arange(2 * RATE_HZ) / RATE_HZ
    phase = 2 * np.pi * np.cumsum(140 + 20 * np.sin(2 * np.pi * 3 * t)) / RATE_HZ
    x = np.sum([(0.3 / h) * np.sin(h * phase) for h in range(1, 8)], axis=0).astype(np.float32)
    y = stretch(x, speed)

    def short_rms(v, w=882):
        n = v.size // w
        return np.sqrt((v[: n * w].reshape(n, w) ** 2).mean(axis=1))[2:-2]

    level = short_rms(x).mean()
    rms = short_rms(y)
    assert rms.min() > 0.85 * level and rms.max() < 1.15 * level  # no dropouts or doubled overlaps


def test_silence_stays_silent_and_sized():
    y = stretch(np.zeros(10000, np.float32), 2.0)
    assert y.size == 5000 and not y.any()


def test_empty_input():
    s = WsolaStretcher(1.5, RATE_HZ)
    assert s.finish().size == 0


@pytest.mark.parametrize("speed", [0.49, 2.01, float("nan")])
def test_speed_out_of_range_is_refused(speed):
    with pytest.raises(ValueError, match="speed must be within"):
        WsolaStretcher(speed, RATE_HZ)


def test_misuse_after_finish():
    s = WsolaStretcher(1.5, RATE_HZ)
    s.finish()
    with pytest.raises(RuntimeError, match="after finish"):
        s.push(np.zeros(10, np.float32))
    with pytest.raises(RuntimeError, match="twice"):
        s.finish()

"""OpenAI's wider speed range (0.25–4.0): two chained WSOLA passes, and AudioOutput's `speed_range` switch."""

from __future__ import annotations

import numpy as np
import pytest

from streaming.audio_out import WIDE_SPEED_RANGE, AudioFormatError, AudioOutput, OutputFormat
from streaming.time_stretch import ChainedStretcher, WsolaStretcher, make_stretcher
from tests.streaming.audio_helpers import dominant_hz, run_stretcher, sine

RATE_HZ = 44100


def stretch(x: np.ndarray, speed: float, seed: int | None = None) -> np.ndarray:
    return run_stretcher(make_stretcher(speed, RATE_HZ), x, seed)


@pytest.mark.parametrize("speed", [0.25, 0.4, 3.0, 4.0])
def test_chained_duration_scales_and_pitch_is_kept(speed):
    x = sine(440.0, 2.0)
    y = stretch(x, speed, seed=1)
    expected = x.size / speed
    assert abs(y.size - expected) <= 2  # round(round(n / s) / s), s = sqrt(speed)
    freq, purity = dominant_hz(y[4000:-4000], RATE_HZ)
    assert abs(freq - 440.0) / 440.0 < 0.01
    assert purity > 0.98


@pytest.mark.parametrize("speed", [0.3, 3.5])
def test_chained_chunking_does_not_change_output(speed):
    x = sine(220.0, 1.0) + sine(330.0, 1.0, amplitude=0.2)
    one_shot = stretch(x, speed)
    for seed in (2, 3):
        np.testing.assert_array_equal(stretch(x, speed, seed=seed), one_shot)


def test_make_stretcher_uses_one_pass_inside_fish_range():
    assert isinstance(make_stretcher(0.5, RATE_HZ), WsolaStretcher)
    assert isinstance(make_stretcher(2.0, RATE_HZ), WsolaStretcher)
    assert isinstance(make_stretcher(2.5, RATE_HZ), ChainedStretcher)
    x = sine(300.0, 0.5)
    np.testing.assert_array_equal(
        stretch(x, 1.5), np.concatenate([(s := WsolaStretcher(1.5, RATE_HZ)).push(x), s.finish()])
    )


@pytest.mark.parametrize("speed", [0.24, 4.01, float("nan")])
def test_chained_out_of_range_is_refused(speed):
    with pytest.raises(ValueError, match="speed must be within"):
        ChainedStretcher(speed, RATE_HZ)


def test_audio_output_wide_range_only_when_asked():
    with pytest.raises(AudioFormatError, match=r"0\.5 to 2\.0"):
        AudioOutput(OutputFormat("pcm", 24000, speed=4.0))
    with pytest.raises(AudioFormatError, match=r"0\.25 to 4\.0"):
        AudioOutput(OutputFormat("pcm", 24000, speed=4.5), speed_range=WIDE_SPEED_RANGE)
    out = AudioOutput(OutputFormat("pcm", 24000, speed=4.0), speed_range=WIDE_SPEED_RANGE)
    x = sine(440.0, 2.0)
    data = out.push(x) + out.finish()
    assert abs(len(data) // 2 - 0.5 * 24000) <= 2  # 2 s at 4× speed = 0.5 s at 24 kHz
    with pytest.raises(ValueError, match="must lie within"):
        AudioOutput(OutputFormat("pcm", 24000), speed_range=(0.1, 8.0))

"""Signal helpers shared by the audio tests: test tones and an independent spectral check."""

from __future__ import annotations

import io

import numpy as np
import soundfile as sf


def sine(freq_hz: float, duration_s: float, rate_hz: int = 44100, amplitude: float = 0.5) -> np.ndarray:
    t = np.arange(round(duration_s * rate_hz)) / rate_hz
    return (amplitude * np.sin(2 * np.pi * freq_hz * t)).astype(np.float32)


def dominant_hz(y: np.ndarray, rate_hz: int) -> tuple[float, float]:
    """(peak frequency, fraction of energy within ±10 Hz of it), from a Hann-windowed, 8× zero-padded FFT."""
    y = np.asarray(y, dtype=np.float64)
    n = y.size
    spectrum = np.abs(np.fft.rfft(y * np.hanning(n), 8 * n)) ** 2
    freqs = np.fft.rfftfreq(8 * n, 1 / rate_hz)
    peak = int(np.argmax(spectrum))
    near = np.abs(freqs - freqs[peak]) <= 10.0
    return float(freqs[peak]), float(spectrum[near].sum() / spectrum.sum())


def decode(data: bytes) -> tuple[np.ndarray, int]:
    y, rate_hz = sf.read(io.BytesIO(data), dtype="float32")
    return y, rate_hz


def push_in_chunks(push, x: np.ndarray, seed: int = 0, lo: int = 50, hi: int = 20000) -> list:
    """Feed `x` through `push` in random chunk sizes; return the list of results."""
    rng = np.random.default_rng(seed)
    outs, i = [], 0
    while i < x.size:
        n = int(rng.integers(lo, hi))
        outs.append(push(x[i : i + n]))
        i += n
    return outs


def run_stretcher(stretcher, x: np.ndarray, seed: int | None = None) -> np.ndarray:
    """Push x through a stretcher (whole, or in seeded random chunks) and finish it."""
    outs = [stretcher.push(x)] if seed is None else push_in_chunks(stretcher.push, x, seed=seed)
    return np.concatenate([*outs, stretcher.finish()])

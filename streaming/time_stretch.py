"""Pitch-preserving time-stretch for `prosody.speed`, streaming: WSOLA (waveform-similarity overlap-add).

Owns `WsolaStretcher`: float32 mono chunks in, stretched float32 chunks out, the same samples whatever the chunking.
Output frames of `frame_samples` are laid every `hop_samples` (50 % overlap, periodic Hann, so windows sum to one);
frame k is read from the input near k·hop·speed, shifted within ±tolerance to the offset whose waveform best
continues the previous frame (normalised cross-correlation, computed with one FFT), so pitch periods line up and no
phase clicks appear. `ChainedStretcher` runs two passes of sqrt(speed) for OpenAI's wider 0.25–4.0 range, and
`make_stretcher` picks one or the other. It knows nothing about sample formats, codecs or where the audio comes from.
"""

from __future__ import annotations

import numpy as np

# 15 ms hop (30 ms frames): long enough to hold two periods of a low voice, short enough not to smear syllables.
HOP_MS = 15.0
# ±8 ms search: spans one pitch period down to ~62 Hz, so a phase-aligned offset always exists for speech.
TOLERANCE_MS = 8.0
# speed range accepted (Fish's `prosody.speed`); outside it WSOLA frames stop overlapping or repeat too often.
MIN_SPEED = 0.5
MAX_SPEED = 2.0
# OpenAI's `speed` range: two chained passes of sqrt(speed) each keep every pass within MIN_SPEED–MAX_SPEED.
MIN_CHAINED_SPEED = 0.25
MAX_CHAINED_SPEED = 4.0
# Below this correlation score every candidate is (near) silence: keep the nominal position instead of a random one.
SILENCE_SCORE = 1e-9


class WsolaStretcher:
    """Streaming WSOLA: `push(chunk)` returns the output samples that are final; `finish()` returns the rest.

    The total output length is round(n_in / speed) samples. Output lags input by about one frame plus the
    tolerance (~40 ms at 44.1 kHz) while streaming; decisions depend only on sample values, never on chunk bounds.
    """

    def __init__(self, speed: float, sample_rate_hz: int) -> None:
        if not (MIN_SPEED <= speed <= MAX_SPEED):
            raise ValueError(f"speed must be within [{MIN_SPEED}, {MAX_SPEED}], got {speed}")
        if sample_rate_hz <= 0:
            raise ValueError(f"sample_rate_hz must be positive, got {sample_rate_hz}")
        self.speed = float(speed)
        self.hop_samples = max(1, round(sample_rate_hz * HOP_MS / 1000))
        self.frame_samples = 2 * self.hop_samples
        self.tolerance_samples = max(1, round(sample_rate_hz * TOLERANCE_MS / 1000))
        n = np.arange(self.frame_samples)
        self._window = (0.5 - 0.5 * np.cos(2 * np.pi * n / self.frame_samples)).astype(np.float32)
        # Frame 0 has no predecessor to overlap with: its rising half is flat so the first samples pass unchanged.
        self._first_window = self._window.copy()
        self._first_window[: self.hop_samples] = 1.0
        region_samples = self.frame_samples + 2 * self.tolerance_samples
        self._fft_size = 1 << (region_samples - 1).bit_length()

        self._in = np.zeros(0, dtype=np.float32)  # input samples from absolute index self._in_start on
        self._in_start = 0
        self._n_in = 0
        self._acc = np.zeros(self.frame_samples, dtype=np.float32)  # overlap-add buffer from self._emitted on
        self._emitted = 0
        self._next_frame = 0
        self._prev_start = 0  # absolute input index where the previous frame was read
        self._finished = False

    def push(self, pcm_f32: np.ndarray) -> np.ndarray:
        """Feed input samples; return the output samples that no later frame can change."""
        if self._finished:
            raise RuntimeError("WsolaStretcher.push() after finish(): create a new stretcher per utterance")
        x = np.asarray(pcm_f32, dtype=np.float32).reshape(-1)
        self._in = np.concatenate([self._in, x])
        self._n_in += x.size
        return self._run(available_end=self._n_in, out_limit=None)

    def finish(self) -> np.ndarray:
        """Flush: the tail is read against zeros past the end, then the output is cut to round(n_in / speed)."""
        if self._finished:
            raise RuntimeError("WsolaStretcher.finish() called twice")
        self._finished = True
        out_len = round(self._n_in / self.speed)
        if out_len <= self._emitted:
            return np.zeros(0, dtype=np.float32)
        last_frame = (out_len - 1) // self.hop_samples
        needed_end = self._nominal_start(last_frame) + self.tolerance_samples + 2 * self.frame_samples
        pad = needed_end - (self._in_start + self._in.size)
        if pad > 0:
            self._in = np.concatenate([self._in, np.zeros(pad, dtype=np.float32)])
        return self._run(available_end=self._in_start + self._in.size, out_limit=out_len)

    # -- internals -------------------------------------------------------------------------------------------------

    def _nominal_start(self, k: int) -> int:
        return round(k * self.hop_samples * self.speed)

    def _needed_end(self, k: int) -> int:
        if k == 0:
            return self.frame_samples
        end = self._nominal_start(k) + self.tolerance_samples + self.frame_samples
        return max(end, self._prev_start + self.hop_samples + self.frame_samples)

    def _run(self, available_end: int, out_limit: int | None) -> np.ndarray:
        hop, frame = self.hop_samples, self.frame_samples
        while True:
            k = self._next_frame
            if out_limit is not None and k * hop >= out_limit:
                break
            if self._needed_end(k) > available_end:
                break
            start = self._choose_start(k)
            segment = self._in[start - self._in_start : start - self._in_start + frame]
            offset = k * hop - self._emitted  # where this frame lands in the accumulator
            if self._acc.size < offset + frame:
                self._acc = np.concatenate([self._acc, np.zeros(offset + frame - self._acc.size, np.float32)])
            self._acc[offset : offset + frame] += segment * (self._first_window if k == 0 else self._window)
            self._prev_start = start
            self._next_frame = k + 1
        # Samples before the next frame's start have received every contribution they will get.
        final_end = self._next_frame * hop if out_limit is None else min(self._next_frame * hop, out_limit)
        n_final = max(0, final_end - self._emitted)
        out = self._acc[:n_final].copy()
        self._acc = self._acc[n_final:]
        self._emitted += n_final
        self._trim_input()
        return out

    def _choose_start(self, k: int) -> int:
        """Input index for frame k: the candidate near the nominal position most similar to the natural successor."""
        if k == 0:
            return 0
        frame, tol = self.frame_samples, self.tolerance_samples
        nominal = self._nominal_start(k)
        lo = max(nominal - tol, 0)
        hi = nominal + tol
        if self.speed < 1.0:
            # Slowed down, the last frames' positions run past the input's end while their output is still kept:
            # candidates stop at the last frame that fits, so the audio ends on its last real samples instead of
            # fading into the zeros finish() pads with. A no-op before the end (a frame is placed only once its
            # whole search window has arrived), so chunking still never changes the output.
            last_fit = max(0, self._n_in - frame)
            lo = min(lo, last_fit)
            hi = min(hi, max(lo, last_fit))
        natural = self._prev_start + self.hop_samples  # where frame k-1 would have continued without stretching
        template = self._in[natural - self._in_start : natural - self._in_start + frame]
        region = self._in[lo - self._in_start : hi - self._in_start + frame]  # (hi - lo + frame,)
        n_lags = hi - lo + 1
        spec = np.fft.rfft(region, self._fft_size) * np.conj(np.fft.rfft(template, self._fft_size))
        corr = np.fft.irfft(spec, self._fft_size)[:n_lags]  # corr[d] = sum_n template[n] * region[n + d]
        sq = np.concatenate([[0.0], np.cumsum(region.astype(np.float64) ** 2)])
        energy = sq[frame : frame + n_lags] - sq[:n_lags]
        score = corr / np.sqrt(np.maximum(energy, 1e-12))
        best = int(np.argmax(score))
        if score[best] <= SILENCE_SCORE:
            return min(max(nominal, lo), hi)
        return lo + best

    def _trim_input(self) -> None:
        """Drop input no future frame can read (both its search window and its template lie after this point)."""
        k = self._next_frame
        keep_from = min(self._nominal_start(k) - self.tolerance_samples, self._prev_start + self.hop_samples)
        if self.speed < 1.0:
            keep_from = min(keep_from, self._n_in - self.frame_samples)  # the last frame that fits (_choose_start)
        keep_from = max(keep_from, 0)
        drop = keep_from - self._in_start
        if drop > 0:
            self._in = self._in[drop:]
            self._in_start = keep_from


class ChainedStretcher:
    """Two WSOLA passes of sqrt(speed) each, for speeds outside MIN_SPEED–MAX_SPEED (up to 0.25–4.0).

    Same streaming contract as WsolaStretcher (chunking never changes the output); the total output length is
    round(round(n_in / s) / s) samples with s = sqrt(speed), within 1.5 samples of n_in / speed.
    """

    def __init__(self, speed: float, sample_rate_hz: int) -> None:
        if not (MIN_CHAINED_SPEED <= speed <= MAX_CHAINED_SPEED):
            raise ValueError(f"speed must be within [{MIN_CHAINED_SPEED}, {MAX_CHAINED_SPEED}], got {speed}")
        self.speed = float(speed)
        per_pass = float(np.sqrt(speed))
        self._first = WsolaStretcher(per_pass, sample_rate_hz)
        self._second = WsolaStretcher(per_pass, sample_rate_hz)

    def push(self, pcm_f32: np.ndarray) -> np.ndarray:
        return self._second.push(self._first.push(pcm_f32))

    def finish(self) -> np.ndarray:
        return np.concatenate([self._second.push(self._first.finish()), self._second.finish()])


def make_stretcher(speed: float, sample_rate_hz: int) -> WsolaStretcher | ChainedStretcher:
    """One WSOLA pass within MIN_SPEED–MAX_SPEED (Fish's range), two chained passes beyond it (OpenAI's range)."""
    if MIN_SPEED <= speed <= MAX_SPEED:
        return WsolaStretcher(speed, sample_rate_hz)
    return ChainedStretcher(speed, sample_rate_hz)

"""Per-utterance audio output: float32 mono PCM at the vocoder rate in, encoded bytes to send right away out.

Owns `OutputFormat` (what the client asked for), its validation (`validate_output_format`, errors carry a `code`),
and `AudioOutput`, the pipeline gain → time-stretch (WSOLA, speed ≠ 1) → resample (soxr, streaming, so chunk seams
are seamless: the output equals one-shot resampling) → clip to [-1, 1] → encode. Codecs live in
`streaming.audio_encoders`, the stretcher in `streaming.time_stretch`. It knows nothing about sessions, wire
protocols, the model or threads: one AudioOutput per utterance, driven by one thread.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import soxr

from streaming.audio_encoders import MEDIA_TYPES, PcmEncoder, codec_sample_rate_hz, make_encoder
from streaming.time_stretch import MAX_CHAINED_SPEED, MAX_SPEED, MIN_CHAINED_SPEED, MIN_SPEED, make_stretcher

# Fish Speech 1.5's vocoder (firefly-gan-vq) output rate: what AudioOutput expects unless told otherwise.
VOCODER_SAMPLE_RATE_HZ = 44_100
ACCEPTED_FORMATS = ("pcm", "wav", "mp3", "opus", "flac")
# Formats clients may name that we cannot produce, with the reason and the fix.
REFUSED_FORMATS = {"aac": "no AAC encoder ships with fishgate; ask for mp3 or opus instead"}
ACCEPTED_SAMPLE_RATES_HZ = (8000, 16000, 22050, 24000, 32000, 44100, 48000)
MP3_BITRATES_KBPS = (64, 128, 192)  # Fish's `mp3_bitrate`
OPUS_BITRATES_KBPS = (24, 32, 48, 64)  # Fish's `opus_bitrate` (its -1000 "auto" maps to bitrate_kbps=None)
MIN_VOLUME_DB, MAX_VOLUME_DB = -20.0, 20.0  # Fish's `prosody.volume`
# `speed` accepted by default (Fish's prosody.speed), and the widest any caller may allow (OpenAI's `speed`).
FISH_SPEED_RANGE = (MIN_SPEED, MAX_SPEED)
WIDE_SPEED_RANGE = (MIN_CHAINED_SPEED, MAX_CHAINED_SPEED)
# soxr "HQ": 20-bit quality, ~96 dB stop-band, far below 16-bit output's noise floor at a fraction of VHQ's cost.
RESAMPLE_QUALITY = "HQ"


class AudioFormatError(ValueError):
    """An OutputFormat outside what fishgate produces. `code` is machine-readable; the message names the fix."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True, slots=True)
class OutputFormat:
    """What one utterance's audio should look like on the wire."""

    format: str = "wav"  # pcm | wav | mp3 | opus | flac
    sample_rate_hz: int = VOCODER_SAMPLE_RATE_HZ  # opus at 22050/32000/44100 is encoded at 24000/48000 (see codec)
    bitrate_kbps: int | None = None  # mp3: 64/128/192 (None → 128); opus: 24/32/48/64 (None → libopus auto);
    #                                  ignored by pcm/wav/flac
    volume_db: float = 0.0  # gain applied before everything else; output is clipped at full scale
    speed: float = 1.0  # > 1 is faster; pitch is kept


def validate_output_format(fmt: OutputFormat, speed_range: tuple[float, float] = FISH_SPEED_RANGE) -> None:
    """Raise AudioFormatError (with `code`) unless `fmt` is something AudioOutput can produce.

    `speed_range` is Fish's 0.5–2.0 unless the caller's API allows more (at most WIDE_SPEED_RANGE, OpenAI's).
    """
    if not (WIDE_SPEED_RANGE[0] <= speed_range[0] <= speed_range[1] <= WIDE_SPEED_RANGE[1]):
        raise ValueError(f"speed_range {speed_range} must lie within {WIDE_SPEED_RANGE}")
    if fmt.format in REFUSED_FORMATS:
        raise AudioFormatError("unsupported_format", f"format {fmt.format!r} is refused: {REFUSED_FORMATS[fmt.format]}")
    if fmt.format not in ACCEPTED_FORMATS:
        raise AudioFormatError(
            "unsupported_format", f"format {fmt.format!r} is unknown; use one of {', '.join(ACCEPTED_FORMATS)}"
        )
    rate = fmt.sample_rate_hz
    if isinstance(rate, bool) or not isinstance(rate, int) or rate not in ACCEPTED_SAMPLE_RATES_HZ:
        raise AudioFormatError(
            "unsupported_sample_rate",
            f"sample_rate {rate!r} is not supported; use one of {', '.join(map(str, ACCEPTED_SAMPLE_RATES_HZ))} Hz",
        )
    allowed = {"mp3": MP3_BITRATES_KBPS, "opus": OPUS_BITRATES_KBPS}.get(fmt.format)
    if allowed is not None and fmt.bitrate_kbps is not None and fmt.bitrate_kbps not in allowed:
        raise AudioFormatError(
            "unsupported_bitrate",
            f"{fmt.format} bitrate {fmt.bitrate_kbps!r} kbps is not supported; use one of "
            f"{', '.join(map(str, allowed))} kbps (or leave it unset for the default)",
        )
    lo, hi = speed_range
    if not _finite_within(fmt.speed, lo, hi):
        raise AudioFormatError(
            "speed_out_of_range", f"speed {fmt.speed!r} is out of range; use a value from {lo} to {hi}"
        )
    if not _finite_within(fmt.volume_db, MIN_VOLUME_DB, MAX_VOLUME_DB):
        raise AudioFormatError(
            "volume_out_of_range",
            f"volume {fmt.volume_db!r} dB is out of range; use a value from {MIN_VOLUME_DB:g} to {MAX_VOLUME_DB:g} dB",
        )


def _finite_within(value: object, lo: float, hi: float) -> bool:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    return math.isfinite(value) and lo <= value <= hi


class AudioOutput:
    """One utterance's output pipeline. `push` returns bytes to send now (maybe empty); `finish` the tail.

    The concatenation of everything returned is one valid stream in the requested format. Not thread-safe.
    """

    def __init__(
        self,
        fmt: OutputFormat,
        input_sample_rate_hz: int = VOCODER_SAMPLE_RATE_HZ,
        *,
        speed_range: tuple[float, float] = FISH_SPEED_RANGE,
    ) -> None:
        validate_output_format(fmt, speed_range)
        self.format = fmt
        self.input_sample_rate_hz = input_sample_rate_hz
        self.codec_sample_rate_hz = codec_sample_rate_hz(fmt.format, fmt.sample_rate_hz)
        self.media_type = MEDIA_TYPES[fmt.format]
        self._gain = np.float32(10.0 ** (fmt.volume_db / 20.0))
        self._stretcher = make_stretcher(fmt.speed, input_sample_rate_hz) if fmt.speed != 1.0 else None
        self._resampler = (
            soxr.ResampleStream(input_sample_rate_hz, self.codec_sample_rate_hz, 1, "float32", RESAMPLE_QUALITY)
            if self.codec_sample_rate_hz != input_sample_rate_hz
            else None
        )
        self._encoder = make_encoder(fmt.format, fmt.sample_rate_hz, fmt.bitrate_kbps)
        self.samples_in = 0  # input samples pushed (input rate)
        self.samples_encoded = 0  # samples handed to the encoder (codec rate)
        self._finished = False

    @property
    def light(self) -> bool:
        """Whether `push` is only a few passes over the samples — no time-stretch, no resampling, raw or WAV bytes —
        so cheap that a caller may run it where a thread hand-off would cost more (a 24-frame chunk: ~40 µs on a
        2-core CPU, against ~100 µs for a trip through a thread pool)."""
        return self._stretcher is None and self._resampler is None and isinstance(self._encoder, PcmEncoder)

    def push(self, pcm_f32: np.ndarray) -> bytes:
        """Process one chunk of mono samples (1-D, nominally in [-1, 1]); return the bytes ready to send."""
        if self._finished:
            raise RuntimeError("AudioOutput.push() after finish(): create a new AudioOutput per utterance")
        x = np.asarray(pcm_f32)
        if x.ndim != 1:
            raise ValueError(f"AudioOutput.push() takes mono samples as a 1-D array (T,), got shape {x.shape}")
        x = x.astype(np.float32, copy=False)
        if not np.isfinite(x).all():  # one pass for the usual chunk instead of nan_to_num's three
            x = np.nan_to_num(x, nan=0.0, posinf=1.0, neginf=-1.0)
        self.samples_in += x.size
        if self._gain != 1.0:
            x = x * self._gain
        if self._stretcher is not None:
            x = self._stretcher.push(x)
        return self._resample_and_encode(x, last=False)

    def finish(self) -> bytes:
        """Flush the stretcher, resampler and encoder; return the final bytes. Call exactly once."""
        if self._finished:
            raise RuntimeError("AudioOutput.finish() called twice")
        self._finished = True
        tail = self._stretcher.finish() if self._stretcher is not None else np.zeros(0, np.float32)
        return self._resample_and_encode(tail, last=True) + self._encoder.finish()

    def _resample_and_encode(self, x: np.ndarray, last: bool) -> bytes:
        if self._resampler is not None:
            x = self._resampler.resample_chunk(np.ascontiguousarray(x, dtype=np.float32), last=last)
        x = np.clip(x, -1.0, 1.0)
        self.samples_encoded += x.size
        return self._encoder.encode(x)

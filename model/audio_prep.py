"""Reference-audio preparation for the codec encoder: any rate / channel count → mono float32 at 44.1 kHz.

Owns input validation (shape, dtype, finiteness, emptiness), integer-PCM scaling, the downmix (mean over
channels) and resampling. Resampling uses soxr, a band-limited polyphase resampler: the encoder's mel features
are sensitive to aliasing and a naive interpolation would shift codes. Decoding files is not done here
(callers pass arrays, e.g. from soundfile, whose 2-D layout is (samples, channels)).
"""

from __future__ import annotations

import numpy as np
import soxr
import torch

CODEC_SAMPLE_RATE_HZ = 44100
# More channels than this in the second dimension means the caller probably passed (channels, samples).
MAX_CHANNELS = 64
# soxr quality: "HQ" (20-bit, −120 dB stop band) is soxr's default and far beyond the encoder's needs.
SOXR_QUALITY = "HQ"
INT_SCALE = {np.dtype(np.int16): 32768.0, np.dtype(np.int32): 2147483648.0}


def to_codec_audio(
    audio: np.ndarray | torch.Tensor, sample_rate_hz: int, target_rate_hz: int = CODEC_SAMPLE_RATE_HZ
) -> np.ndarray:
    """Return `audio` as a 1-D float32 array at `target_rate_hz`.

    `audio` is (samples,) or (samples, channels) — soundfile's layout — as float (nominally in [−1, 1]) or
    int16/int32 PCM. Channels are averaged. Raises ValueError with the reason for unusable input.
    """
    if isinstance(audio, torch.Tensor):
        audio = audio.detach().cpu().numpy()
    audio = np.asarray(audio)
    if isinstance(sample_rate_hz, bool) or not isinstance(sample_rate_hz, int | np.integer) or sample_rate_hz <= 0:
        raise ValueError(f"sample_rate_hz must be a positive integer, got {sample_rate_hz!r}")
    if audio.ndim not in (1, 2):
        raise ValueError(f"audio must be 1-D (samples,) or 2-D (samples, channels), got shape {audio.shape}")
    if audio.ndim == 2:
        samples, channels = audio.shape
        if channels == 0:
            raise ValueError("audio has zero channels")
        if channels > MAX_CHANNELS and samples <= MAX_CHANNELS:
            raise ValueError(
                f"audio shape {audio.shape} looks like (channels, samples); pass (samples, channels) (transpose it)"
            )
    if audio.shape[0] == 0:
        raise ValueError("audio is empty (0 samples)")
    if audio.dtype in INT_SCALE:
        audio = audio.astype(np.float32) / INT_SCALE[audio.dtype]
    elif np.issubdtype(audio.dtype, np.floating):
        audio = audio.astype(np.float32, copy=False)
    else:
        raise ValueError(f"audio dtype {audio.dtype} is not supported; pass float32/float64 or int16/int32 PCM")
    if not np.isfinite(audio).all():
        raise ValueError("audio contains NaN or infinite samples")
    mono = audio.mean(axis=1, dtype=np.float32) if audio.ndim == 2 else audio
    if sample_rate_hz != target_rate_hz:
        mono = soxr.resample(mono, int(sample_rate_hz), target_rate_hz, quality=SOXR_QUALITY)
    return np.ascontiguousarray(mono, dtype=np.float32)

"""Uploaded reference audio (zero-shot cloning prompts): bytes in, float32 mono samples and their rate out.

Owns `decode_audio_file`, which checks size, container and duration *before* decoding everything (the header is
read with `soundfile.info`; decoding is capped at the duration limit), so a hostile upload costs little.
It reads whatever libsndfile reads (WAV, FLAC, Ogg Vorbis/Opus, MP3, AIFF, ...); it knows nothing about the
model's rate (resampling to the codec's rate is the caller's business) or where the bytes came from.
"""

from __future__ import annotations

import io

import numpy as np
import soundfile as sf

# A voice prompt is speech: more channels than this is not one, and each channel multiplies decode memory.
MAX_CHANNELS = 8
# libsndfile's "frame count unknown" value (SF_COUNT_MAX), reported for streams whose header has no length.
UNKNOWN_FRAMES = 2**63 - 1


class ReferenceAudioError(ValueError):
    """Uploaded reference audio that cannot be used. `code` is machine-readable; the message names the fix."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def decode_audio_file(
    data: bytes, *, max_bytes: int, min_duration_s: float, max_duration_s: float
) -> tuple[np.ndarray, int]:
    """Decode an uploaded audio file to (float32 mono samples (T,), sample rate in Hz).

    Raises ReferenceAudioError with code `empty_audio`, `audio_too_large` (more than max_bytes),
    `not_audio` (no container libsndfile knows), `too_many_channels`, `audio_too_short` / `audio_too_long`
    (outside [min_duration_s, max_duration_s]) or `bad_audio` (decoding failed or produced NaN/inf).
    Channels are averaged to mono. The length check uses the header when it states one; files whose header does
    not (or lies) are decoded only up to max_duration_s plus one sample.
    """
    if not data:
        raise ReferenceAudioError("empty_audio", "reference audio is empty; send the bytes of a WAV/FLAC/MP3/Ogg file")
    if len(data) > max_bytes:
        raise ReferenceAudioError(
            "audio_too_large",
            f"reference audio is {len(data)} bytes; the limit is {max_bytes} bytes — send a shorter or compressed clip",
        )
    try:
        info = sf.info(io.BytesIO(data))
    except (sf.LibsndfileError, RuntimeError, TypeError) as e:
        raise ReferenceAudioError(
            "not_audio", "reference audio is not a readable audio file; send WAV, FLAC, MP3 or Ogg (Vorbis/Opus)"
        ) from e
    rate_hz, channels = int(info.samplerate), int(info.channels)
    if rate_hz <= 0 or channels <= 0:
        raise ReferenceAudioError("not_audio", "reference audio header has no sample rate or channels")
    if channels > MAX_CHANNELS:
        raise ReferenceAudioError(
            "too_many_channels", f"reference audio has {channels} channels; send mono or stereo speech"
        )
    if 0 < info.frames < UNKNOWN_FRAMES:
        _check_duration(info.frames / rate_hz, min_duration_s, max_duration_s)

    cap_frames = int(max_duration_s * rate_hz) + 1
    try:
        with sf.SoundFile(io.BytesIO(data)) as f:
            samples = f.read(frames=cap_frames, dtype="float32", always_2d=True)  # (T, C)
    except (sf.LibsndfileError, RuntimeError) as e:
        raise ReferenceAudioError("bad_audio", "reference audio could not be decoded; re-encode it as WAV") from e
    _check_duration(samples.shape[0] / rate_hz, min_duration_s, max_duration_s)
    mono = samples.mean(axis=1, dtype=np.float32) if channels > 1 else samples[:, 0]
    if not np.isfinite(mono).all():
        raise ReferenceAudioError("bad_audio", "reference audio contains NaN or infinite samples; re-encode it")
    return np.ascontiguousarray(mono, dtype=np.float32), rate_hz


def _check_duration(duration_s: float, min_duration_s: float, max_duration_s: float) -> None:
    if duration_s > max_duration_s:
        raise ReferenceAudioError(
            "audio_too_long",
            f"reference audio is longer than {max_duration_s:g} s; trim it to at most {max_duration_s:g} s",
        )
    if duration_s < min_duration_s:
        raise ReferenceAudioError(
            "audio_too_short",
            f"reference audio is {duration_s:.2f} s; send at least {min_duration_s:g} s of speech",
        )

"""Streaming audio encoders: float32 mono PCM in [-1, 1] at the codec rate in, container bytes out.

Owns the byte formats: s16le PCM, WAV (streaming header and complete file), and MP3 / Ogg Opus / FLAC through
libsndfile (`soundfile`, whose wheels bundle LAME, libopus and libFLAC, so no extra dependency). It knows nothing
about resampling, gain or speed: callers hand it samples at `codec_sample_rate_hz(...)`, already clipped.

When each format's first bytes carry audio (what a time-to-first-audio probe should wait for):
- pcm:  every non-empty output is audio.
- wav:  the first output is the 44-byte header followed by the first PCM; all later bytes are audio.
- mp3:  every output is whole MPEG frames of audio, no header; the first frame comes once ~60 ms of input has been
        encoded (LAME's look-ahead), then one per 1152 samples. Decoders add LAME's ~1100-sample start delay.
- opus: the first output starts with the OpusHead and OpusTags pages (~0.9 kB); audio pages follow, one per 60 ms
        (three 20 ms packets), the first once ~70 ms of input has been encoded.
- flac: whole file at finish() (see FlacEncoder) — not a real-time format here.
"""

from __future__ import annotations

import io
import struct
from typing import Protocol

import numpy as np
import soundfile as sf

# Rates the Opus codec runs at; any other requested rate is encoded at the next one up (see codec_sample_rate_hz).
OPUS_SAMPLE_RATES_HZ = (8000, 12000, 16000, 24000, 48000)
# RIFF/data sizes for a WAV whose length is unknown when its header is sent: "runs to end of stream", the value
# ffmpeg and opus-tools write to pipes; libsndfile and Python's `wave` read such a stream to its end.
WAV_UNKNOWN_SIZE = 0xFFFFFFFF
# libsndfile commands soundfile does not wrap (values from sndfile.h; tests pin their effect on the output).
SFC_SET_OGG_PAGE_LATENCY_MS = 0x1302
SFC_SET_ORIGINAL_SAMPLERATE = 0x1500
# Ogg page latency: libsndfile's floor (its default is 1 s, far too late for live audio); pages then hold 60 ms.
OPUS_PAGE_LATENCY_MS = 50.0
# libsndfile maps compression level c∈[0,1] to max - c·(max - min) kbps per MPEG version: (min, max) by rate floor.
MP3_BITRATE_RANGES_KBPS = ((32000, (32, 320)), (16000, (8, 160)), (0, (8, 64)))
MP3_DEFAULT_BITRATE_KBPS = 128  # Fish's default `mp3_bitrate`
# libsndfile maps compression level c to Opus bitrate (1 - c)·250 + 6 kbps per channel.
OPUS_MIN_KBPS, OPUS_SPAN_KBPS = 6.0, 250.0
# HTTP media types, one per format, for the server's Content-Type.
MEDIA_TYPES = {
    "pcm": "audio/pcm",
    "wav": "audio/wav",
    "mp3": "audio/mpeg",
    "opus": "audio/ogg; codecs=opus",
    "flac": "audio/flac",
}


class Encoder(Protocol):
    """One utterance's encoder. `encode` returns bytes ready to send now; `finish` returns the tail."""

    sample_rate_hz: int

    def encode(self, pcm_f32: np.ndarray) -> bytes: ...

    def finish(self) -> bytes: ...


def codec_sample_rate_hz(fmt: str, requested_hz: int) -> int:
    """Rate the codec runs at: the requested one, except Opus, which only runs at 8/12/16/24/48 kHz.

    For Opus at 22050 / 32000 / 44100 Hz we encode at the next Opus rate up (24000, 48000, 48000) and record the
    requested rate as OpusHead's "input sample rate", as opusenc does; decoders output 48 kHz (or that rate).
    """
    if fmt != "opus" or requested_hz in OPUS_SAMPLE_RATES_HZ:
        return requested_hz
    return next((r for r in OPUS_SAMPLE_RATES_HZ if r >= requested_hz), OPUS_SAMPLE_RATES_HZ[-1])


def float_to_s16le(pcm_f32: np.ndarray) -> bytes:
    """Float samples → little-endian int16 bytes; values beyond ±1 saturate at ±32767 (never wrap), NaN → 0.

    Runs for every chunk of every stream (an H200 profile at 384 streams had ~20 encoder threads busy here,
    each holding the GIL the engine's worker needs): one finiteness check instead of nan_to_num's three passes, and
    the scaling in place — bitwise the result of `rint(clip(nan_to_num(x), -1, 1) * 32767)`, ~3× faster."""
    x = np.asarray(pcm_f32, dtype=np.float32).reshape(-1)
    if not np.isfinite(x).all():
        x = np.nan_to_num(x, nan=0.0)
    y = np.clip(x, -1.0, 1.0)  # a new array: the caller's samples are never written
    y *= np.float32(32767.0)
    np.rint(y, out=y)
    return y.astype("<i2").tobytes()


def wav_header(sample_rate_hz: int, data_bytes: int | None = None) -> bytes:
    """44-byte RIFF/WAVE header for 16-bit mono PCM; `data_bytes=None` writes the unknown-length sentinel."""
    data_size = WAV_UNKNOWN_SIZE if data_bytes is None else data_bytes
    riff_size = WAV_UNKNOWN_SIZE if data_bytes is None else 36 + data_bytes
    block_align = 2  # one channel × 2 bytes
    fmt_chunk = struct.pack("<HHIIHH", 1, 1, sample_rate_hz, sample_rate_hz * block_align, block_align, 16)
    return (
        b"RIFF" + struct.pack("<I", riff_size) + b"WAVE"
        + b"fmt " + struct.pack("<I", len(fmt_chunk)) + fmt_chunk
        + b"data" + struct.pack("<I", data_size)
    )  # fmt: skip


def encode_wav(pcm_f32: np.ndarray, sample_rate_hz: int) -> bytes:
    """A complete (non-streaming) 16-bit mono WAV file with exact RIFF and data lengths."""
    data = float_to_s16le(pcm_f32)
    return wav_header(sample_rate_hz, len(data)) + data


class PcmEncoder:
    """Raw s16le mono, no header."""

    def __init__(self, sample_rate_hz: int) -> None:
        self.sample_rate_hz = sample_rate_hz

    def encode(self, pcm_f32: np.ndarray) -> bytes:
        return float_to_s16le(pcm_f32)

    def finish(self) -> bytes:
        return b""


class WavEncoder(PcmEncoder):
    """Streaming WAV: the unknown-length header goes out with the first call, then plain s16le PCM."""

    def __init__(self, sample_rate_hz: int) -> None:
        super().__init__(sample_rate_hz)
        self._header_sent = False

    def _header_once(self) -> bytes:
        if self._header_sent:
            return b""
        self._header_sent = True
        return wav_header(self.sample_rate_hz)

    def encode(self, pcm_f32: np.ndarray) -> bytes:
        return self._header_once() + float_to_s16le(pcm_f32)

    def finish(self) -> bytes:
        return self._header_once()


class _AppendSink(io.RawIOBase):
    """Seekable file object for libsndfile's virtual I/O that hands out bytes as they are appended.

    Encoders seek back at close to patch headers (FLAC STREAMINFO, the MP3 info tag). A patch that lands on bytes
    still pending is applied; one that lands on bytes already taken cannot be, and is dropped and counted.
    """

    def __init__(self) -> None:
        super().__init__()
        self._pending = bytearray()
        self._taken_bytes = 0
        self._pos = 0
        self.dropped_patch_bytes = 0

    def readable(self) -> bool:
        return True  # libsndfile's virtual I/O wants a read callback; nothing is ever there to read

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buffer: object) -> int:
        return 0

    def write(self, data: object) -> int:
        chunk = bytes(data)  # type: ignore[call-overload]
        n = len(chunk)
        if self._pos < self._taken_bytes:
            skip = min(n, self._taken_bytes - self._pos)
            self.dropped_patch_bytes += skip
            chunk, self._pos = chunk[skip:], self._pos + skip
        offset = self._pos - self._taken_bytes
        if offset > len(self._pending):
            self._pending.extend(bytes(offset - len(self._pending)))
        self._pending[offset : offset + len(chunk)] = chunk
        self._pos += len(chunk)
        return n

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        end = self._taken_bytes + len(self._pending)
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: end}[whence]
        self._pos = base + offset
        return self._pos

    def tell(self) -> int:
        return self._pos

    def take(self) -> bytes:
        out = bytes(self._pending)
        self._taken_bytes += len(out)
        self._pending.clear()
        return out


class SoundfileEncoder:
    """libsndfile encoder writing into an _AppendSink; each `encode` returns what libsndfile wrote for it."""

    # Containers that are invalid with no audio at all (FLAC, Ogg) get one sample of silence written at finish()
    # if nothing else was, so an empty utterance is still a readable (~0 s) file.
    pad_empty = False

    def __init__(self, sample_rate_hz: int, container: str, subtype: str, **options: object) -> None:
        self.sample_rate_hz = sample_rate_hz
        self._sink = _AppendSink()
        self._file = sf.SoundFile(
            self._sink, "w", samplerate=sample_rate_hz, channels=1, format=container, subtype=subtype, **options
        )
        self._samples_written = 0

    def _command(self, command: int, ctype: str, value: float) -> None:
        """sf_command for settings soundfile does not wrap (uses soundfile's cffi handles)."""
        ptr = sf._ffi.new(f"{ctype}*", value)
        sf._snd.sf_command(self._file._file, command, ptr, sf._ffi.sizeof(ctype))

    def _write(self, samples: np.ndarray) -> None:
        if samples.size:
            self._file.write(samples)
            self._samples_written += samples.size

    def encode(self, pcm_f32: np.ndarray) -> bytes:
        self._write(np.ascontiguousarray(pcm_f32, dtype=np.float32).reshape(-1))
        return self._sink.take()

    def finish(self) -> bytes:
        if self.pad_empty and self._samples_written == 0:
            self._write(np.zeros(1, dtype=np.float32))
        self._file.close()
        return self._sink.take()


def mp3_compression_level(sample_rate_hz: int, bitrate_kbps: int) -> float:
    """libsndfile compression level that makes LAME's CBR bitrate exactly `bitrate_kbps` (capped at the maximum
    of the MPEG version this rate uses: 320 kbps ≥ 32 kHz, 160 kbps for 16–24 kHz, 64 kbps below)."""
    lo, hi = next(r for floor_hz, r in MP3_BITRATE_RANGES_KBPS if sample_rate_hz >= floor_hz)
    # libsndfile truncates the interpolated bitrate to int: aim half a kbps above so it lands on the target.
    level = (hi - min(bitrate_kbps, hi) - 0.5) / (hi - lo)
    return min(max(level, 0.0), 1.0)


class Mp3Encoder(SoundfileEncoder):
    """CBR MP3 through LAME, handed out as whole frames (LAME's output can stop mid-frame; the rest waits).

    libsndfile reserves the first frame for a LAME info tag that it fills in by seeking back at close; a stream
    cannot be patched after sending, so that reserved (all-zero) frame is not sent.
    """

    def __init__(self, sample_rate_hz: int, bitrate_kbps: int | None) -> None:
        kbps = MP3_DEFAULT_BITRATE_KBPS if bitrate_kbps is None else bitrate_kbps
        level = mp3_compression_level(sample_rate_hz, kbps)
        super().__init__(sample_rate_hz, "MP3", "MPEG_LAYER_III", compression_level=level, bitrate_mode="CONSTANT")
        self._partial = bytearray()  # bytes after the last whole frame handed out
        self._first_frame = True

    def _whole_frames(self, data: bytes, final: bool) -> bytes:
        buf = self._partial
        buf.extend(data)
        out = bytearray()
        pos = 0
        while len(buf) - pos >= 4:
            frame_bytes = mp3_frame_bytes(bytes(buf[pos : pos + 4]))
            if frame_bytes is None:  # not at a frame header (never seen from LAME): pass bytes through as they are
                out += buf[pos:]
                pos = len(buf)
                break
            if pos + frame_bytes > len(buf):
                break
            reserved = self._first_frame and not any(buf[pos + 4 : pos + frame_bytes])
            if not reserved:
                out += buf[pos : pos + frame_bytes]
            self._first_frame = False
            pos += frame_bytes
        if final:
            out += buf[pos:]
            pos = len(buf)
        del buf[:pos]
        return bytes(out)

    def encode(self, pcm_f32: np.ndarray) -> bytes:
        return self._whole_frames(super().encode(pcm_f32), final=False)

    def finish(self) -> bytes:
        return self._whole_frames(super().finish(), final=True)


def mp3_frame_bytes(header: bytes) -> int | None:
    """Length of the MPEG-1/2/2.5 Layer III frame starting with `header` (4 bytes), or None if it is not one."""
    if len(header) < 4 or header[0] != 0xFF or (header[1] & 0xE0) != 0xE0 or ((header[1] >> 1) & 3) != 1:
        return None
    version = (header[1] >> 3) & 3  # 3: MPEG-1, 2: MPEG-2, 0: MPEG-2.5
    bitrate_index, rate_index, padding = header[2] >> 4, (header[2] >> 2) & 3, (header[2] >> 1) & 1
    if version == 1 or bitrate_index in (0, 15) or rate_index == 3:
        return None
    mpeg1 = version == 3
    kbps_table = (
        (0, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320)
        if mpeg1
        else (0, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 144, 160)
    )
    rate_hz = (44100, 48000, 32000)[rate_index] // {3: 1, 2: 2, 0: 4}[version]
    return (144 if mpeg1 else 72) * kbps_table[bitrate_index] * 1000 // rate_hz + padding


class OpusEncoder(SoundfileEncoder):
    """Ogg Opus. `bitrate_kbps=None` leaves libopus's automatic bitrate."""

    pad_empty = True

    def __init__(self, sample_rate_hz: int, bitrate_kbps: int | None, requested_sample_rate_hz: int) -> None:
        level = None if bitrate_kbps is None else 1.0 - (bitrate_kbps - OPUS_MIN_KBPS) / OPUS_SPAN_KBPS
        super().__init__(sample_rate_hz, "OGG", "OPUS", compression_level=level)
        self._command(SFC_SET_OGG_PAGE_LATENCY_MS, "double", OPUS_PAGE_LATENCY_MS)
        self._command(SFC_SET_ORIGINAL_SAMPLERATE, "int", requested_sample_rate_hz)


class FlacEncoder(SoundfileEncoder):
    """16-bit FLAC, returned whole at finish(). Frames are encoded as audio arrives, but bytes are held: libFLAC
    patches the total length and MD5 into STREAMINFO at close, and libsndfile (hence `soundfile.read`) cannot read
    a FLAC whose STREAMINFO says "length unknown". FLAC serves OpenAI's file-style requests, not live streams."""

    pad_empty = True

    def __init__(self, sample_rate_hz: int) -> None:
        super().__init__(sample_rate_hz, "FLAC", "PCM_16")

    def encode(self, pcm_f32: np.ndarray) -> bytes:
        # Quantised here, as for pcm/wav, so every lossless format carries the same samples.
        self._write(np.frombuffer(float_to_s16le(pcm_f32), dtype="<i2"))
        return b""  # bytes stay in the sink, where the close-time STREAMINFO patch can still reach them


def make_encoder(fmt: str, requested_sample_rate_hz: int, bitrate_kbps: int | None) -> Encoder:
    """Encoder for a validated format; it runs at codec_sample_rate_hz(fmt, requested_sample_rate_hz)."""
    rate_hz = codec_sample_rate_hz(fmt, requested_sample_rate_hz)
    if fmt == "pcm":
        return PcmEncoder(rate_hz)
    if fmt == "wav":
        return WavEncoder(rate_hz)
    if fmt == "mp3":
        return Mp3Encoder(rate_hz, bitrate_kbps)
    if fmt == "opus":
        return OpusEncoder(rate_hz, bitrate_kbps, requested_sample_rate_hz)
    if fmt == "flac":
        return FlacEncoder(rate_hz)
    raise ValueError(f"no encoder for format {fmt!r}: validate the OutputFormat first (validate_output_format)")

"""Shared checks for the HTTP API tests: decoded-audio assertions, test clips, JSON error checks."""

from __future__ import annotations

import io
import socket
import struct

import httpx
import numpy as np
import soundfile as sf

FRAME_SAMPLES = 2048  # one codec frame at 44.1 kHz
NOT_SILENT_S16 = 100  # peak above this in int16: the untrained model's noise is loud, silence is 0


def decode(data: bytes) -> tuple[np.ndarray, int]:
    """A complete audio file → (int16 samples, sample rate)."""
    samples, rate = sf.read(io.BytesIO(data), dtype="int16")
    return samples, rate


def s16(data: bytes) -> np.ndarray:
    assert len(data) % 2 == 0, "pcm must be whole 16-bit samples"
    return np.frombuffer(data, dtype="<i2")


def assert_not_silent(samples: np.ndarray) -> None:
    assert samples.size > 0 and int(np.abs(samples.astype(np.int32)).max()) > NOT_SILENT_S16


def wav_fields(data: bytes) -> tuple[int, int, int]:
    """(RIFF size, sample rate, data size) read from a 44-byte canonical WAV header."""
    assert data[:4] == b"RIFF" and data[8:16] == b"WAVEfmt " and data[36:40] == b"data"
    return struct.unpack("<I", data[4:8])[0], struct.unpack("<I", data[24:28])[0], struct.unpack("<I", data[40:44])[0]


def clip(seconds: float, rate_hz: int = 16000, fmt: str = "WAV", seed: int = 0) -> bytes:
    """A speech-like test clip (a gliding tone with noise), encoded as an audio file."""
    rng = np.random.default_rng(seed)
    t = np.arange(round(seconds * rate_hz)) / rate_hz
    x = 0.3 * np.sin(2 * np.pi * (150 + 50 * t) * t) + 0.02 * rng.standard_normal(t.size)
    buf = io.BytesIO()
    sf.write(buf, x.astype(np.float32), rate_hz, format=fmt, subtype="PCM_16" if fmt == "WAV" else None)
    return buf.getvalue()


def assert_error(response: httpx.Response, status: int, code: str | None = None, *needles: str) -> str:
    """The response is our JSON error with this status (and code); its message contains every needle."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    if code is not None:
        assert error["code"] == code, error
    for needle in needles:
        assert needle in error["message"], error
    assert "Traceback" not in error["message"]
    return error["message"]


def raw_request(host: str, port: int, path: str, headers: dict[str, str], method: str = "POST") -> tuple[int, bytes]:
    """A request exactly as written (path not normalized; headers such as a Content-Length whose body never comes),
    without a body; → (status, body)."""
    lines = [
        f"{method} {path} HTTP/1.1",
        f"Host: {host}:{port}",
        "Connection: close",
        *(f"{k}: {v}" for k, v in headers.items()),
    ]
    with socket.create_connection((host, port), timeout=10) as s:
        s.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    return int(head.split()[1]), body

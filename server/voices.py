"""Stored voices (reference id → transcripts + codec codes), cached on disk; inline references encoded per request.

Layout under the references directory, one folder per id (ids are `[A-Za-z0-9][A-Za-z0-9_.-]{0,63}`, so no request
can name a path outside it):
    <id>/voice.json             {"references": [{"text": …, "codes": "codes_0.npy", "duration_s": …}], …}
    <id>/codes_<k>.npy           int16 (nc, T) codes, encoded once
Folders in fish-speech's own layout (`<id>/*.wav` + same-name `.lab` transcripts) are encoded on first use and
cached the same way. The id `default` is reserved for the model's own voice (no references).
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import re
import shutil
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from streaming.audio_in import ReferenceAudioError, decode_audio_file
from streaming.errors import UnknownVoice, ValueOutOfRange
from streaming.session import Voice

VOICE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
DEFAULT_VOICE = "default"
META_FILE = "voice.json"
AUDIO_SUFFIXES = (".wav", ".flac", ".mp3", ".ogg")
CODEC_FRAME_RATE_HZ = 44100 / 2048
# positions of the model's context kept free for the text and the generation when sizing references
CONTEXT_RESERVE_TOKENS = 1024

Encoder = Callable[[np.ndarray, int], Awaitable[np.ndarray]]


def check_voice_id(voice_id: str) -> str:
    if not isinstance(voice_id, str) or not VOICE_ID.fullmatch(voice_id) or ".." in voice_id:
        raise ValueOutOfRange(
            f"a voice id is 1–64 letters, digits, '_', '-' or '.', starting with a letter or digit (got {voice_id!r})"
        )
    return voice_id


@dataclass(frozen=True, slots=True)
class ReferenceLimits:
    max_bytes: int
    min_s: float
    max_s: float  # per reference; also bounded by the model's context

    @staticmethod
    def for_context(max_seq_len: int, max_bytes: int, min_s: float, max_s: float) -> ReferenceLimits:
        context_s = max(0.0, (max_seq_len - CONTEXT_RESERVE_TOKENS) / CODEC_FRAME_RATE_HZ)
        return ReferenceLimits(max_bytes, min_s, min(max_s, context_s))


def _read_limited(path: Path, limits: ReferenceLimits) -> bytes:
    """A reference file from disk, refused before reading when it is over the size limit."""
    size = path.stat().st_size
    if size > limits.max_bytes:
        raise ReferenceAudioError(
            "audio_too_large", f"{path.name} is {size} bytes; the limit is {limits.max_bytes} (--max-reference-bytes)"
        )
    return path.read_bytes()


def _load_voice(folder: Path, meta: dict) -> Voice:
    return Voice(tuple((r["text"], np.load(folder / r["codes"]).astype(np.int64)) for r in meta["references"]))


class VoiceStore:
    def __init__(self, root: Path, encode: Encoder, limits: Callable[[], ReferenceLimits]) -> None:
        self.root = root
        self.encode = encode
        self._limits = limits
        self._locks: dict[str, asyncio.Lock] = {}
        root.mkdir(parents=True, exist_ok=True)

    # ---- reading --------------------------------------------------------------------------------------------------
    def list_voices(self) -> list[dict]:
        out = []
        for folder in sorted(self.root.iterdir()):
            if VOICE_ID.fullmatch(folder.name) and self._is_own_folder(folder):
                meta = self._meta(folder)
                if meta is not None:
                    out.append({"id": folder.name, **_summary(meta)})
                elif pairs := self._upstream_files(folder):
                    out.append({"id": folder.name, "references": len(pairs), "encoded": False})
        return out

    async def voice(self, voice_id: str) -> Voice:
        if voice_id == DEFAULT_VOICE:
            return Voice()
        folder = self.root / check_voice_id(voice_id)
        meta = await asyncio.to_thread(self._meta, folder)  # file reads stay off the event loop
        if meta is None:
            pairs = await asyncio.to_thread(self._upstream_files, folder)
            if not pairs:
                raise UnknownVoice(f"no voice {voice_id!r}; GET /v1/references lists the stored ones")
            # one encode per folder at a time; locks only for folders that exist (unknown ids must not grow this)
            async with self._locks.setdefault(voice_id, asyncio.Lock()):
                meta = await asyncio.to_thread(self._meta, folder)
                if meta is None:
                    await self._encode_upstream_folder(folder, pairs)
                    meta = await asyncio.to_thread(self._meta, folder)
                    assert meta is not None
        return await asyncio.to_thread(_load_voice, folder, meta)

    # ---- writing --------------------------------------------------------------------------------------------------
    async def add(self, voice_id: str, text: str, audio: bytes) -> dict:
        check_voice_id(voice_id)
        if voice_id == DEFAULT_VOICE:
            raise ValueOutOfRange(f"the id {DEFAULT_VOICE!r} is reserved for the model's own voice; pick another")
        if not text.strip():
            raise ValueOutOfRange("text must be the transcript of the audio (non-empty)")
        codes, duration_s = await self.encode_inline(audio)
        meta = {"references": [{"text": text, "codes": "codes_0.npy", "duration_s": round(duration_s, 3)}]}
        await asyncio.to_thread(self._write, voice_id, codes, meta)
        return {"id": voice_id, **_summary(meta)}

    def _write(self, voice_id: str, codes: np.ndarray, meta: dict) -> None:
        """Write the voice into a hidden folder, then swap it in under its id."""
        folder = self.root / voice_id
        tmp = self.root / f".{voice_id}.{time.monotonic_ns()}.partial"
        tmp.mkdir()
        np.save(tmp / "codes_0.npy", codes.astype(np.int16))
        (tmp / META_FILE).write_text(json.dumps(meta, ensure_ascii=False))
        if folder.is_symlink():
            folder.unlink()  # a link planted under this id is replaced, never followed
        elif folder.exists():
            shutil.rmtree(folder)
        tmp.rename(folder)

    def delete(self, voice_id: str) -> None:
        folder = self.root / check_voice_id(voice_id)
        if not self._is_own_folder(folder):
            raise UnknownVoice(f"no voice {voice_id!r}")
        shutil.rmtree(folder)

    async def encode_inline(self, audio: bytes) -> tuple[np.ndarray, float]:
        """Uploaded audio bytes → (codes (nc, T), duration in s); limits checked before full decoding."""
        lim = self._limits()
        # ReferenceAudioError (a ValueError with a code) names the problem and the fix; it maps to HTTP 400
        samples, rate = await asyncio.to_thread(
            decode_audio_file, audio, max_bytes=lim.max_bytes, min_duration_s=lim.min_s, max_duration_s=lim.max_s
        )
        codes = await self.encode(samples, rate)
        return codes, len(samples) / rate

    async def resolve(self, voice_id: str | None, inline: list[tuple[str, bytes]]) -> Voice:
        """A request's voice: inline references win over a reference id; neither = the model's own voice."""
        if inline:
            refs = []
            for text, audio in inline:
                codes, _ = await self.encode_inline(audio)
                refs.append((text, codes))
            return Voice(tuple(refs))
        if voice_id:
            return await self.voice(voice_id)
        return Voice()

    def resolve_path(self, raw: str) -> Path:
        """fish-speech's `reference_audio` given as a server path: only files inside the references directory."""
        root = self.root.resolve()
        candidate = (root / raw).resolve() if not Path(raw).is_absolute() else Path(raw).resolve()
        if not candidate.is_relative_to(root) or not candidate.is_file():
            raise ValueOutOfRange(
                "reference_audio paths must name a file inside the server's references directory; "
                "upload the audio instead (references[].audio or POST /v1/references)"
            )
        return candidate

    # ---- internals ------------------------------------------------------------------------------------------------
    def exists(self, voice_id: str) -> bool:
        """A stored voice (or an upstream-layout folder) under this id; a planted link is none."""
        return self._is_own_folder(self.root / check_voice_id(voice_id))

    def _is_own_folder(self, folder: Path) -> bool:
        """A real folder of the references directory: no symbolic link may lead a voice id outside it (reading
        someone's files as a voice, or writing codes there)."""
        return folder.is_dir() and not folder.is_symlink() and folder.resolve().parent == self.root.resolve()

    @staticmethod
    def _is_own_file(path: Path) -> bool:
        return path.is_file() and not path.is_symlink()

    def _meta(self, folder: Path) -> dict | None:
        path = folder / META_FILE
        if not self._is_own_folder(folder) or not self._is_own_file(path):
            return None
        return json.loads(path.read_text(encoding="utf-8"))

    def _upstream_files(self, folder: Path) -> list[tuple[Path, Path]]:
        if not self._is_own_folder(folder):
            return []
        pairs = []
        for audio in sorted(folder.iterdir()):
            lab = audio.with_suffix(".lab")
            if audio.suffix.lower() in AUDIO_SUFFIXES and self._is_own_file(audio) and self._is_own_file(lab):
                pairs.append((audio, lab))
        return pairs

    async def _encode_upstream_folder(self, folder: Path, pairs: list[tuple[Path, Path]]) -> None:
        """Encode and cache an upstream-layout folder. Another gateway process (`serve --workers`) may do the same
        at once: each file appears whole (written aside, then renamed), so a reader never sees half of one."""
        refs = []
        for k, (audio, lab) in enumerate(pairs):
            codes, duration_s = await self.encode_inline(await asyncio.to_thread(_read_limited, audio, self._limits()))
            npy = io.BytesIO()
            np.save(npy, codes.astype(np.int16))
            _replace_whole(folder / f"codes_{k}.npy", npy.getvalue())
            text = lab.read_text(encoding="utf-8").strip()
            refs.append({"text": text, "codes": f"codes_{k}.npy", "duration_s": round(duration_s, 3)})
        _replace_whole(folder / META_FILE, json.dumps({"references": refs}, ensure_ascii=False).encode())


def _replace_whole(path: Path, data: bytes) -> None:
    """Write `path` through a hidden file beside it, then rename that over it."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{time.monotonic_ns()}.partial")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _summary(meta: dict) -> dict:
    refs = meta["references"]
    return {
        "references": len(refs),
        "duration_s": round(sum(r["duration_s"] for r in refs), 3),
        "text": " ".join(r["text"] for r in refs),
        "encoded": True,
    }

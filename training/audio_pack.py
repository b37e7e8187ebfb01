"""Teacher audio for codec training: manifest rows → compact int16 shards that travel to the GPU, and back to crops.

A shard is one `.npz` (numpy only, readable on a machine without soundfile/soxr): `audio` int16 (all utterances of
the shard concatenated), `offsets` (n+1,) and `ids`. Piper voices synthesise at ≤ 22.05 kHz, so the 44.1 kHz teacher
files hold nothing above ~11 kHz: shards default to 22.05 kHz (half the bytes, twice the speech per carried MiB) and
`AudioShard` upsamples them on the device with a windowed-sinc FIR to the codec rate. Knows nothing about models.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

# Shard size limit: a device call carries ≤ 64 MiB in all (repo, checkpoint and data together).
DEFAULT_SHARD_BYTES = 40 * 2**20
DEFAULT_PACK_RATE_HZ = 22050
# Half-length of the upsampling FIR in input samples, and the Kaiser window's beta (≈ 90 dB stop band).
FIR_HALF_TAPS = 24
FIR_KAISER_BETA = 9.0
# Accepted spellings of each manifest field (the corpus tooling is written separately; these are tolerated).
MANIFEST_FIELDS: dict[str, tuple[str, ...]] = {
    "id": ("id", "utt_id", "utterance_id", "name"),
    "text": ("text", "raw_text", "original_text"),
    "normalized_text": (
        "norm", "normalized_text", "normalised_text", "text_normalized", "text_normalised", "norm_text", "normalized",
        "normalised",
    ),
    "audio_path": ("audio_path", "audio", "path", "flac", "wav", "file"),
    "duration_s": ("duration_s", "duration", "seconds", "dur_s"),
    "split": ("split", "subset"),
}  # fmt: skip


@dataclass(frozen=True, slots=True)
class Utterance:
    id: str
    text: str
    normalized_text: str
    audio_path: Path
    duration_s: float
    split: str


def _field(row: dict[str, Any], name: str, line_no: int, path: Path, default: Any = None) -> Any:
    for key in MANIFEST_FIELDS[name]:
        if key in row:
            return row[key]
    if default is not None:
        return default
    raise ValueError(
        f"{path}:{line_no}: manifest row lacks {name!r} (accepted keys: {', '.join(MANIFEST_FIELDS[name])})"
    )


def read_manifest(path: Path | str) -> list[Utterance]:
    """JSONL rows {id, text, normalized text, audio path, duration, split}; audio paths resolve against the file."""
    path = Path(path)
    rows = []
    for line_no, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        row = json.loads(line)
        text = str(_field(row, "text", line_no, path))
        audio = Path(str(_field(row, "audio_path", line_no, path)))
        rows.append(
            Utterance(
                id=str(_field(row, "id", line_no, path)),
                text=text,
                normalized_text=str(_field(row, "normalized_text", line_no, path, default=text)),
                audio_path=audio if audio.is_absolute() else path.parent / audio,
                duration_s=float(_field(row, "duration_s", line_no, path, default=-1.0)),
                split=str(_field(row, "split", line_no, path, default="train")),
            )
        )
    return rows


def load_audio(path: Path, rate_hz: int) -> np.ndarray:
    """A sound file → mono float32 at `rate_hz` (soundfile decodes, model.audio_prep resamples with soxr)."""
    import soundfile as sf

    from model.audio_prep import to_codec_audio

    data, file_rate = sf.read(str(path), dtype="float32", always_2d=True)
    return to_codec_audio(data, file_rate, rate_hz)


def pack_shards(
    utterances: Iterable[Utterance],
    out_dir: Path,
    *,
    rate_hz: int = DEFAULT_PACK_RATE_HZ,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> list[Path]:
    """Write `shard_000.npz`, … of at most `max_shard_bytes` of int16 audio each; returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths: list[Path] = []
    pieces: list[np.ndarray] = []
    ids: list[str] = []

    def flush() -> None:
        if not pieces:
            return
        offsets = np.cumsum([0, *(len(p) for p in pieces)]).astype(np.int64)
        path = out_dir / f"shard_{len(paths):03d}.npz"
        np.savez_compressed(path, audio=np.concatenate(pieces), offsets=offsets, ids=np.array(ids), rate_hz=rate_hz)
        paths.append(path)
        pieces.clear()
        ids.clear()

    size = 0
    for utt in utterances:
        pcm = np.clip(np.round(load_audio(utt.audio_path, rate_hz) * 32767.0), -32768, 32767).astype(np.int16)
        if size + pcm.nbytes > max_shard_bytes and pieces:
            flush()
            size = 0
        pieces.append(pcm)
        ids.append(utt.id)
        size += pcm.nbytes
    flush()
    return paths


def sinc_upsampler(factor: int) -> torch.Tensor:
    """FIR (1, 1, K) for integer upsampling: Kaiser-windowed sinc at the input Nyquist, gain `factor`."""
    half = FIR_HALF_TAPS * factor
    t = torch.arange(-half, half + 1, dtype=torch.float64) / factor
    window = torch.special.i0(FIR_KAISER_BETA * torch.sqrt(1 - (t / (FIR_HALF_TAPS + 1)) ** 2))
    taps = torch.sinc(t) * window / torch.special.i0(torch.tensor(FIR_KAISER_BETA, dtype=torch.float64))
    return taps.to(torch.float32).view(1, 1, -1)


def upsample(audio: torch.Tensor, factor: int) -> torch.Tensor:
    """audio (N,) → (N·factor,) band-limited (zero-stuffing + FIR, centred so sample i maps to i·factor)."""
    if factor == 1:
        return audio
    taps = sinc_upsampler(factor).to(audio.device)
    y = F.conv_transpose1d(audio.view(1, 1, -1), taps, stride=factor)  # (1, 1, (N−1)·f + K)
    start = (taps.shape[-1] - 1) // 2
    return y[0, 0, start : start + audio.shape[0] * factor]


class AudioShard:
    """One or more shards on a device at the codec rate, as one stream; random crops for training batches."""

    def __init__(self, paths: Sequence[Path], rate_hz: int, device: torch.device | str = "cpu") -> None:
        streams: list[torch.Tensor] = []
        ids: list[str] = []
        for path in paths:
            with np.load(path, allow_pickle=False) as z:
                pack_rate = int(z["rate_hz"])
                if rate_hz % pack_rate:
                    raise ValueError(f"{path} is at {pack_rate} Hz; the codec rate {rate_hz} must be a multiple of it")
                pcm = torch.from_numpy(z["audio"].astype(np.float32) / 32768.0).to(device)
                streams.append(upsample(pcm, rate_hz // pack_rate))
                ids.extend(str(i) for i in z["ids"])
        if not streams:
            raise ValueError("no audio shards given")
        self.audio = torch.cat(streams)  # (N,) float32 at rate_hz
        self.rate_hz = rate_hz
        self.ids = ids

    @property
    def duration_s(self) -> float:
        return self.audio.shape[0] / self.rate_hz

    def split(self, holdout_fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(train stream, held-out tail) — the tail gives fixed validation crops."""
        cut = int(self.audio.shape[0] * (1 - holdout_fraction))
        return self.audio[:cut], self.audio[cut:]

    @staticmethod
    def crops(stream: torch.Tensor, batch: int, n_samples: int, generator: torch.Generator) -> torch.Tensor:
        """(batch, n_samples) random windows of `stream` (offsets drawn on the CPU generator)."""
        if stream.shape[0] < n_samples:
            reps = math.ceil(n_samples / max(stream.shape[0], 1))
            stream = stream.repeat(reps)
        starts = torch.randint(0, stream.shape[0] - n_samples + 1, (batch,), generator=generator)
        idx = starts.to(stream.device).unsqueeze(1) + torch.arange(n_samples, device=stream.device)
        return stream[idx]

"""How intelligible the codec alone is: held-out teacher audio encoded and decoded, then judged by Whisper.

The DualAR can only speak through the codec, so this bounds the default voice's WER from below (the first codec trained:
139 %, why that voice was not shipped; training/TRAINING.md). Reads a teacher manifest (training/teacher.py) and a codec
resume file or checkpoint folder; writes the resynthesised WAVs beside a manifest and prints the WER summary
(training/wer.py).

    python -m training.codec_wer --codec build/training/run1/gan_codec_resume.safetensors --limit 25
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from .audio_pack import load_audio
from .checkpoints import write_wav
from .encode_codes import load_encoder
from .wer import SENTENCE_LEVELS, evaluate, load_whisper, read_manifest


def resynthesize(codec_source: Path, manifest: Path, out: Path, limit: int | None) -> list[tuple[str, Path, str]]:
    codec = load_encoder(codec_source)
    rate = codec.config.sample_rate
    out.mkdir(parents=True, exist_ok=True)
    clips = []
    for clip_id, path, reference in read_manifest(manifest, split="test", limit=limit):
        audio = load_audio(path, rate)
        with torch.inference_mode():
            pcm = codec.decode(codec.encode(torch.from_numpy(audio)[None]))[0].reshape(-1)
        wav = out / f"{clip_id}.wav"
        write_wav(wav, pcm, rate)
        clips.append((clip_id, wav, reference))
    return clips


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--codec", type=Path, required=True, help="codec_resume.safetensors or a checkpoint folder")
    parser.add_argument("--manifest", type=Path, default=Path("build/training/teacher/manifest.jsonl"))
    parser.add_argument("--limit", type=int, default=25)
    parser.add_argument("--out", type=Path, default=Path("build/codec_wer"))
    args = parser.parse_args(argv)
    clips = resynthesize(args.codec, args.manifest, args.out, args.limit)
    if not clips:
        print(f"no test rows in {args.manifest}", file=sys.stderr)
        return 2
    report = evaluate(load_whisper(), clips, control=False)
    verdict = SENTENCE_LEVELS.verdict(report.wer)
    print(json.dumps({"clips": report.clips, "wer": round(report.wer, 4), "verdict": verdict}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Write a full-size Fish 1.5 checkpoint folder with random weights (official layout) plus a stored voice.

For the end-to-end server benchmark on the GPU machine: `fishgate serve --checkpoint DIR` loads it through the real
loaders. The voice (`<refs>/bench-voice`) holds ~650 random code frames (30 s of "reference audio"), so streams run
at positions 1,000–2,000 as with a real cloned voice. The end token is made unreachable (its output row is zeroed
and pushed down) so utterance lengths are set by max_new_tokens alone.
Usage: python -m bench.make_checkpoint OUT_DIR REFS_DIR [--tiny]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from bench.fullsize import FISH15_CONFIG, TINY_CONFIG, random_codec, random_model, tokenizer_lines
from model.weights import write_safetensors

VOICE_FRAMES = 650
IM_END_ID = 100_004  # official layout: <|im_end|> = len(ranks) + 4


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("refs", type=Path)
    ap.add_argument("--tiny", action="store_true", help="a small model of the same structure (CPU dry run)")
    args = ap.parse_args(argv)
    out, refs = args.out, args.refs
    out.mkdir(parents=True, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = random_model(device, torch.bfloat16, seed=0, tiny=args.tiny)
    with torch.no_grad():
        if model.output is not None:
            model.output.weight[IM_END_ID] = 0  # never the argmax: lengths are set by max_new_tokens
    write_safetensors({k: v.cpu() for k, v in model.state_dict().items()}, out / "model.safetensors")
    cfg = TINY_CONFIG if args.tiny else FISH15_CONFIG
    (out / "config.json").write_text(json.dumps(cfg, indent=4, sort_keys=True))
    (out / "tokenizer.tiktoken").write_text(tokenizer_lines())
    codec = random_codec("cpu", torch.float32, seed=0, tiny=args.tiny)
    write_safetensors({k: v.contiguous() for k, v in codec.state_dict().items()}, out / "generator.safetensors")
    (out / "codec_config.json").write_text(json.dumps(codec.config.to_dict()))
    (out / "fishgate.json").write_text(json.dumps({"name": "fish-speech-1.5-random-weights"}))

    rows = codec.config.rows
    voice = refs / "bench-voice"
    voice.mkdir(parents=True, exist_ok=True)
    codes = np.random.default_rng(0).integers(0, 1000, size=(rows, VOICE_FRAMES)).astype(np.int16)
    np.save(voice / "codes_0.npy", codes)
    text = "This is the transcript of a thirty second reference recording used to clone a voice. " * 4
    meta = {"references": [{"text": text.strip(), "codes": "codes_0.npy", "duration_s": VOICE_FRAMES * 2048 / 44100}]}
    (voice / "voice.json").write_text(json.dumps(meta))
    print(f"wrote {out} and {voice}")


if __name__ == "__main__":
    main()

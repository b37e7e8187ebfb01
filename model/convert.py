"""`fishgate convert`: rewrite a checkpoint folder's pickles as safetensors so later loads are a zero-copy mmap.

Writes `model.safetensors` (from `model.pth`, keys normalised as the loader would) and `generator.safetensors`
(from the official generator `.pth`, `generator.` prefix and weight-norm spellings normalised, weight norm kept
unfolded so the file stays a faithful copy). Next to the originals by default; to `out_dir` otherwise, together
with the small files a checkpoint needs. Every written file is verified by reading it back through the loaders.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import torch

from .checkpoint import CONFIG_JSON, MODEL_SAFETENSORS, TOKENIZER_FILE, convert_model_weights, load_dual_ar
from .codec_checkpoint import CODEC_CONFIG_NAME, codec_weights_file, load_codec, read_codec_state_dict
from .weights import CheckpointError, write_safetensors

GENERATOR_SAFETENSORS = "generator.safetensors"
# Files a checkpoint folder needs besides the weights (copied when converting into another folder).
SIDE_FILES = (CONFIG_JSON, TOKENIZER_FILE, "special_tokens.json", CODEC_CONFIG_NAME, "fishgate.json")

Progress = Callable[[str, int, int], None]


def convert_checkpoint(folder: Path, out_dir: Path | None = None, progress: Progress | None = None) -> list[Path]:
    """Convert what needs converting; returns the files written (an already-converted folder writes nothing)."""
    folder = Path(folder)
    out = Path(out_dir) if out_dir is not None else folder
    if not folder.is_dir():
        raise CheckpointError(f"{folder} is not a folder; pass the checkpoint folder (the one with config.json)")
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    if out != folder:
        for name in SIDE_FILES:
            if (folder / name).is_file():
                shutil.copy2(folder / name, out / name)
    if (folder / CONFIG_JSON).is_file() and not (out / MODEL_SAFETENSORS).is_file():
        path = convert_model_weights(folder, out, progress)
        if path is not None:
            written.append(path)
    gen = _convert_generator(folder, out, progress)
    if gen is not None:
        written.append(gen)
    _verify(out, written)
    return written


def _convert_generator(folder: Path, out: Path, progress: Progress | None) -> Path | None:
    try:
        src = codec_weights_file(folder)
    except CheckpointError:
        return None  # a DualAR-only folder
    dst = out / GENERATOR_SAFETENSORS
    if src.suffix == ".safetensors" or dst.is_file():
        return None
    state = read_codec_state_dict(src)

    def report(done: int, total: int) -> None:
        if progress is not None:
            progress(GENERATOR_SAFETENSORS, done, total)

    write_safetensors(state, dst, metadata={"format": "pt", "source": src.name}, progress=report)
    return dst


def _verify(out: Path, written: list[Path]) -> None:
    """Read every written file back through the real loaders (on the meta-free CPU path)."""
    names = {p.name for p in written}
    if MODEL_SAFETENSORS in names:
        load_dual_ar(out, dtype=torch.bfloat16)
    if GENERATOR_SAFETENSORS in names:
        load_codec(out, with_encoder=True)

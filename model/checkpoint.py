"""Checkpoint folders: load the official Fish Speech 1.5 layout and convert it to safetensors.

A folder holds `config.json`, `model.pth` (or `model.safetensors`), `tokenizer.tiktoken` and the codec generator
(see `model.codec_checkpoint`). The DualAR is built on the meta device and loaded with `assign=True` from an
mmap-ed file, so a full-size load never needs twice the model's size in RAM. Loading prefers safetensors when present.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from .config import DualARConfig
from .dual_ar import DualARTransformer
from .tokenizer import FishTokenizer
from .weights import CheckpointError, check_keys, read_state_dict, strip_prefix, write_safetensors

MODEL_PTH = "model.pth"
MODEL_SAFETENSORS = "model.safetensors"
CONFIG_JSON = "config.json"
TOKENIZER_FILE = "tokenizer.tiktoken"


def expected_state_shapes(config: DualARConfig, semantic_begin_id: int = 0) -> dict[str, tuple[int, ...]]:
    """Key → shape of the DualAR state dict for this config (built on the meta device: no memory)."""
    with torch.device("meta"):
        model = DualARTransformer(config, semantic_begin_id)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def model_weights_path(folder: Path) -> Path:
    for name in (MODEL_SAFETENSORS, MODEL_PTH):
        if (folder / name).is_file():
            return folder / name
    raise CheckpointError(
        f"{folder} has neither {MODEL_SAFETENSORS} nor {MODEL_PTH}; point --checkpoint at a Fish Speech 1.5 folder"
    )


def read_model_state(path: Path) -> dict[str, torch.Tensor]:
    """Read model weights and normalise them the way upstream's loader does (wrapper, `model.` prefix, wq/wk/wv)."""
    state = read_state_dict(path)
    if state and next(iter(state)).startswith("model."):
        state = strip_prefix(state, "model.")
    # separate q/k/v projections are concatenated into wqkv, as upstream's load hook does
    for key in [k for k in state if k.endswith(".attention.wq.weight")]:
        prefix = key[: -len("wq.weight")]
        parts = [state.pop(prefix + n) for n in ("wq.weight", "wk.weight", "wv.weight")]
        state[prefix + "wqkv.weight"] = torch.cat(parts)
    return state


def _is_cache_key(key: str) -> bool:
    # a model saved after upstream's setup_caches carries its KV caches as buffers
    return ".kv_cache." in key


@dataclass
class LoadedDualAR:
    model: DualARTransformer
    tokenizer: FishTokenizer
    config: DualARConfig
    weights_path: Path


def load_dual_ar(
    folder: Path,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    max_seq_len: int | None = None,
    timings_s: dict[str, float] | None = None,
) -> LoadedDualAR:
    """Load the text→semantic model of a checkpoint folder. `max_seq_len` may lower the context (saves memory).
    `timings_s` receives the seconds spent reading (mmap, key check, tokenizer) and moving the weights to the device."""
    t0 = time.perf_counter()
    folder = Path(folder)
    if not (folder / CONFIG_JSON).is_file():
        raise CheckpointError(f"{folder} has no {CONFIG_JSON}; point --checkpoint at a Fish Speech 1.5 folder")
    if not (folder / TOKENIZER_FILE).is_file():
        raise CheckpointError(f"{folder} has no {TOKENIZER_FILE} (it ships with the official checkpoint)")
    config = DualARConfig.from_json(folder / CONFIG_JSON)
    if max_seq_len is not None:
        config = DualARConfig.from_dict({**config.to_dict(), "max_seq_len": max_seq_len})
    tokenizer = FishTokenizer.from_file(folder / TOKENIZER_FILE)
    if config.vocab_size <= tokenizer.semantic_end_id:
        raise CheckpointError(
            f"vocab_size {config.vocab_size} is too small for {TOKENIZER_FILE}, whose last semantic token id is "
            f"{tokenizer.semantic_end_id}: the tokenizer does not belong to this model"
        )
    weights_path = model_weights_path(folder)
    state = read_model_state(weights_path)
    check_keys(expected_state_shapes(config), state, f"{weights_path}", ignore_unexpected=_is_cache_key)
    state = {k: v for k, v in state.items() if not _is_cache_key(k)}
    with torch.device("meta"):
        model = DualARTransformer(config, tokenizer.semantic_begin_id)
    model.load_state_dict(state, strict=True, assign=True)
    t1 = time.perf_counter()
    model = model.to(device=device, dtype=dtype).eval()
    # inference weights: without this, an eager decode step outside inference_mode records autograd history
    # (the KV cache writes chain a graph across steps; a CPU engine step ran ~2x slower)
    model.requires_grad_(False)
    # RoPE tables stay fp32 (bf16-rounded values) whatever the model dtype; .to(dtype) above cast them.
    model.freqs_cis = model.freqs_cis.float()
    model.fast_freqs_cis = model.fast_freqs_cis.float()
    if timings_s is not None:
        timings_s["read"] = t1 - t0
        timings_s["to_device"] = time.perf_counter() - t1
    return LoadedDualAR(model, tokenizer, config, weights_path)


ProgressFn = Callable[[str, int, int], None]


def convert_model_weights(folder: Path, out_dir: Path, progress: ProgressFn | None = None) -> Path | None:
    """Write `model.safetensors` for a folder that only has `model.pth`. Returns the written path (None if skipped)."""
    src = folder / MODEL_PTH
    if not src.is_file():
        return None
    state = read_model_state(src)
    config = DualARConfig.from_json(folder / CONFIG_JSON)
    check_keys(expected_state_shapes(config), state, str(src), ignore_unexpected=_is_cache_key)
    state = {k: v for k, v in state.items() if not _is_cache_key(k)}
    dst = out_dir / MODEL_SAFETENSORS

    def report(done: int, total: int) -> None:
        if progress is not None:
            progress(MODEL_SAFETENSORS, done, total)

    write_safetensors(state, dst, metadata={"format": "pt", "source": MODEL_PTH}, progress=report)
    return dst

"""Shared pieces of the GPU benchmarks and GPU tests: the official Fish 1.5 DualAR config, deterministic random
weights, a byte-ish 100,000-rank tokenizer (so the official special ids 100000.. hold), the official codec with
random weights and the run's environment record. No measurement logic lives here (bench/step.py times the step).

The config is a copy of `fish15_model_keys.json`'s "config" (../shared does not travel to the GPU machine).
"""

from __future__ import annotations

import base64
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

import torch

from model.codec_config import CodecConfig
from model.config import DualARConfig
from model.dual_ar import DualARTransformer
from model.vocoder import FireflyCodec

# The official Fish Speech 1.5 config.json (copied from shared/fixtures/fish15/manifests/fish15_model_keys.json).
FISH15_CONFIG: dict[str, Any] = {
    "attention_qkv_bias": False, "codebook_size": 1024, "dim": 1024, "dropout": 0.0,
    "fast_attention_qkv_bias": False, "fast_dim": 1024, "fast_head_dim": 64, "fast_intermediate_size": 4096,
    "fast_n_head": 16, "fast_n_local_heads": 2, "head_dim": 64, "initializer_range": 0.02,
    "intermediate_size": 4096, "is_reward_model": False, "max_seq_len": 8192, "model_type": "dual_ar",
    "n_fast_layer": 4, "n_head": 16, "n_layer": 24, "n_local_heads": 2, "norm_eps": 1e-06, "num_codebooks": 8,
    "rope_base": 1000000.0, "tie_word_embeddings": False, "use_gradient_checkpointing": True, "vocab_size": 102048,
}  # fmt: skip
# A small config of the same structure for CPU dry runs of the scripts (--dry-run).
TINY_CONFIG: dict[str, Any] = {
    **FISH15_CONFIG, "dim": 64, "fast_dim": 64, "n_head": 4, "fast_n_head": 4, "n_local_heads": 2,
    "fast_n_local_heads": 2, "intermediate_size": 128, "fast_intermediate_size": 128, "n_layer": 2,
    "n_fast_layer": 1, "head_dim": 16, "fast_head_dim": 16, "max_seq_len": 2048,
}  # fmt: skip
# Number of ordinary tokenizer ranks of the official tokenizer: <|begin_of_text|> is id 100000, semantic:0 100012.
N_RANKS = 100_000
SEMANTIC_BEGIN_ID = N_RANKS + 12
INIT_STD = 0.02  # upstream _init_weights: normal(0, initializer_range)
# Output heads are scaled up so logits have a std of ~3 (a peaked softmax, as a trained model has), not ~0.6.
HEAD_SCALE = 5.0


def dual_ar_config(tiny: bool = False) -> DualARConfig:
    return DualARConfig.from_dict(TINY_CONFIG if tiny else FISH15_CONFIG)


def tokenizer_lines() -> str:
    """256 single bytes, then 2-byte and 3-byte dummy tokens up to N_RANKS ranks (ids match the official layout)."""
    tokens = [bytes([b]) for b in range(256)]
    i = 0
    while len(tokens) < N_RANKS:
        a, b, c = (i >> 16) & 0xFF, (i >> 8) & 0xFF, i & 0xFF
        tokens.append(bytes([b, c]) if i < 65536 else bytes([a, b, c]))
        i += 1
    return "".join(f"{base64.b64encode(t).decode()} {r}\n" for r, t in enumerate(tokens))


@torch.no_grad()
def init_random_(model: DualARTransformer, seed: int) -> None:
    """Upstream-like init in place: weights N(0, 0.02), biases 0, norms 1; output heads × HEAD_SCALE."""
    gen = torch.Generator(device=model.embeddings.weight.device).manual_seed(seed)
    for name, p in model.named_parameters():
        if "norm" in name:
            p.fill_(1.0)
        elif name.endswith(".bias"):
            p.zero_()
        else:
            p.copy_(torch.randn(p.shape, generator=gen, device=p.device, dtype=torch.float32) * INIT_STD)
    for head in (model.output, model.fast_output):
        if head is not None:
            head.weight.mul_(HEAD_SCALE)


def random_model(device: str, dtype: torch.dtype, seed: int = 0, tiny: bool = False) -> DualARTransformer:
    """Full-size (or tiny) DualAR with deterministic random weights; RoPE tables stay fp32 as load_dual_ar keeps them."""
    with torch.device(device):
        model = DualARTransformer(dual_ar_config(tiny), SEMANTIC_BEGIN_ID)
    model = model.to(device)
    init_random_(model, seed)
    model = model.to(dtype).eval().requires_grad_(False)
    model.freqs_cis = model.freqs_cis.float()
    model.fast_freqs_cis = model.fast_freqs_cis.float()
    return model


def codec_config(tiny: bool = False) -> CodecConfig:
    if not tiny:
        return CodecConfig.official()
    d = CodecConfig.official().to_dict()
    d["head"] = {**d["head"], "upsample_initial_channel": 32, "num_mels": 32,
                 "resblock_kernel_sizes": [3], "resblock_dilation_sizes": [[1]]}  # fmt: skip
    d["quantizer"] = {**d["quantizer"], "input_dim": 32}
    d["backbone"] = {**d["backbone"], "dims": [8, 16, 24, 32]}
    return CodecConfig.from_dict(d)


@torch.no_grad()
def random_codec(device: str, dtype: torch.dtype, seed: int = 0, tiny: bool = False) -> FireflyCodec:
    """The codec decoder (official config) with PyTorch's default random init, output scaled to ~0.1 RMS."""
    torch.manual_seed(seed)
    codec = FireflyCodec(codec_config(tiny), with_encoder=False).eval().requires_grad_(False)
    probe = codec.decode(torch.randint(0, 1000, (1, codec.config.rows, 16)))
    codec.head.conv_post.conv.weight.mul_(0.1 / float(probe.float().std()))
    codec = codec.to(device=device, dtype=dtype)
    codec.init_buffers(device)  # .to(dtype) would have cast the FSQ constant buffers
    return codec


# ---- the run's record --------------------------------------------------------------------------------------------
def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def environment() -> dict[str, Any]:
    """What the numbers were measured on (the commit comes from FISHGATE_COMMIT: the GPU copy has no .git)."""
    env: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"),
        "commit": os.environ.get("FISHGATE_COMMIT", "unknown"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cuda": torch.version.cuda,
    }
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        env.update(gpu=p.name, gpu_memory_gib=round(p.total_memory / 2**30, 1), sms=p.multi_processor_count)
    return env


def write_json(path: str | None, data: dict[str, Any]) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(data, indent=1, default=str) + "\n")

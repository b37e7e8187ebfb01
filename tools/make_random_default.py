"""Write the embedded default model: a tiny Fish-architecture checkpoint with fixed random weights.

It exists so a fresh install runs end to end (server, protocols, demo page) before a trained default voice ships;
its audio is noise, and `fishgate.json` says so (`untrained: true`), which the server reports in logs, /healthz
and the demo page. Deterministic: the same seed writes the same bytes. Usage:
    python tools/make_random_default.py [OUT_DIR]   (default: model/default_model)
"""

from __future__ import annotations

import base64
import json
import sys
from pathlib import Path

import torch

from model.codec_config import CodecConfig
from model.config import DualARConfig
from model.dual_ar import DualARTransformer
from model.tokenizer import FishTokenizer
from model.vocoder import FireflyCodec
from model.weights import write_safetensors

SEED = 20261130
DUAL_AR = {
    "model_type": "dual_ar", "vocab_size": 1296, "n_layer": 2, "n_head": 4, "n_local_heads": 2, "dim": 64,
    "intermediate_size": 160, "rope_base": 10000.0, "norm_eps": 1e-6, "max_seq_len": 2048,
    "tie_word_embeddings": False, "attention_qkv_bias": False, "codebook_size": 1024, "num_codebooks": 4,
    "n_fast_layer": 1, "fast_dim": 64, "fast_n_head": 4, "fast_n_local_heads": 2, "fast_intermediate_size": 160,
}  # fmt: skip
CODEC = {
    "spec_transform": {"sample_rate": 44100, "n_mels": 16, "n_fft": 2048, "hop_length": 512, "win_length": 2048},
    "backbone": {"input_channels": 16, "depths": [1, 1, 1, 1], "dims": [8, 16, 24, 32], "drop_path_rate": 0.2,
                 "kernel_size": 7},
    "head": {"hop_length": 512, "upsample_rates": [8, 8, 2, 2, 2], "upsample_kernel_sizes": [16, 16, 4, 4, 4],
             "resblock_kernel_sizes": [3], "resblock_dilation_sizes": [[1]],
             "num_mels": 32, "upsample_initial_channel": 32, "pre_conv_kernel_size": 13, "post_conv_kernel_size": 13},
    "quantizer": {"input_dim": 32, "n_groups": 4, "n_codebooks": 1, "levels": [8, 5, 5, 5],
                  "downsample_factor": [2, 2]},
}  # fmt: skip
METADATA = {"name": "fishgate-default-untrained", "untrained": True, "max_frames_per_char": 1.5}
TARGET_RMS = 0.1  # scale of the noise the random vocoder makes


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(SEED)
    (out / "tokenizer.tiktoken").write_text(
        "".join(f"{base64.b64encode(bytes([b])).decode()} {b}\n" for b in range(256))
    )
    tokenizer = FishTokenizer.from_file(out / "tokenizer.tiktoken")
    (out / "special_tokens.json").write_text(json.dumps(dict(tokenizer.special_ids), indent=1))
    cfg = DualARConfig.from_dict(DUAL_AR)
    (out / "config.json").write_text(json.dumps(DUAL_AR, indent=4, sort_keys=True))
    model = DualARTransformer(cfg, tokenizer.semantic_begin_id)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.ones_like(p) if "norm" in name else torch.randn_like(p) * 0.02)
    write_safetensors(model.state_dict(), out / "model.safetensors", metadata={"format": "pt"})

    codec_cfg = CodecConfig.from_dict(CODEC)
    (out / "codec_config.json").write_text(json.dumps(CODEC, indent=2))
    codec = FireflyCodec(codec_cfg, with_encoder=True)
    codec.init_buffers("cpu")
    with torch.no_grad():
        probe = codec.decode(torch.randint(0, 1000, (1, codec_cfg.quantizer.n_groups, 64)))
        codec.head.conv_post.conv.weight.mul_(TARGET_RMS / float(probe.std()))
    state = {k: v.contiguous() for k, v in codec.state_dict().items()}
    write_safetensors(state, out / "generator.safetensors", metadata={"format": "pt"})
    (out / "fishgate.json").write_text(json.dumps(METADATA, indent=2) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[1] / "model" / "default_model")

"""Model sizes for the trained default voice (issue 6) and the CPU real-time measurements that pick them.

Owns the candidate DualAR and codec configurations (as the dicts written to `config.json` / `codec_config.json`), the
chosen pair (`DUAL_AR_SMALL`, `CODEC_SMALL`), tiny configurations for CPU tests, and `measure_*`: the per-frame CPU
cost with the engine's own code (DecodeStepper with the engine's CPU row layout and batch-invariant mode, and the
StreamingDecoder), fp32, one torch thread. `python -m training.configs` prints the table kept in TRAINING.md.
Knows nothing about training.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from model.codec_config import CodecConfig
from model.config import DualARConfig
from model.dual_ar import DualARTransformer
from model.stepper import DecodeStepper, RowSampling
from model.vocoder import FireflyCodec
from model.vocoder_stream import StreamingDecoder

# Byte-level tokenizer: 256 byte ranks + 1036 specials = 1292 ids, padded to a multiple of 8 (as the default model).
BYTE_VOCAB_SIZE = 1296
# Audio seconds per code frame at 44.1 kHz with 2048 samples per frame; a frame must cost less than half of it.
FRAME_S = 2048 / 44100
# The engine's CPU layout: 8 sessions + 1 scratch row decode, 8 more rows hold voice prefixes (streaming/backend.py).
ENGINE_ROWS, ENGINE_MAX_BATCH = 17, 9
# A paragraph of ordinary English (three segments) for the end-to-end engine measurement.
BENCH_TEXT = (
    "The quick brown fox jumps over the lazy dog, and then it runs back into the forest. "
    "Nobody in the small village had ever seen anything quite like it before that morning. "
    "By the evening, everyone was telling the story, and each version was a little longer than the last."
)
# Chunk sizes of the engine's BALANCED schedule for one ~5 s segment (107 frames): 4,4,8,8,16,24,24 + tail 16,2,1.
BALANCED_CHUNKS_FRAMES = (4, 4, 8, 8, 16, 24, 24, 16, 2, 1)


def dual_ar_dict(
    dim: int, n_layer: int, intermediate_size: int, *, fast_dim: int, n_fast_layer: int, fast_intermediate_size: int,
    num_codebooks: int = 4, head_dim: int = 48, max_seq_len: int = 2048,
) -> dict[str, Any]:  # fmt: skip
    """A config.json for a byte-tokenizer DualAR with grouped-query attention (2 query heads per kv head)."""
    n_head, fast_n_head = dim // head_dim, fast_dim // head_dim
    return {
        "model_type": "dual_ar", "vocab_size": BYTE_VOCAB_SIZE, "n_layer": n_layer, "n_head": n_head,
        "n_local_heads": max(n_head // 2, 1), "dim": dim, "intermediate_size": intermediate_size,
        "rope_base": 10000.0, "norm_eps": 1e-6, "max_seq_len": max_seq_len, "tie_word_embeddings": False,
        "attention_qkv_bias": False, "codebook_size": 1024, "num_codebooks": num_codebooks,
        "n_fast_layer": n_fast_layer, "fast_dim": fast_dim, "fast_n_head": fast_n_head,
        "fast_n_local_heads": max(fast_n_head // 2, 1), "fast_intermediate_size": fast_intermediate_size,
    }  # fmt: skip


def codec_dict(
    channels: int, *, feature_dim: int, n_groups: int = 4, n_mels: int = 128,
    backbone_dims: Sequence[int] = (64, 96, 128), backbone_depths: Sequence[int] = (1, 1, 2),
    upsample_rates: Sequence[int] = (8, 8, 2, 2, 2), upsample_kernel_sizes: Sequence[int] = (16, 16, 4, 4, 4),
    resblock_kernel_sizes: Sequence[int] = (3,), resblock_dilation_sizes: Sequence[Sequence[int]] = ((1, 3),),
    hop_length: int = 512,
) -> dict[str, Any]:  # fmt: skip
    """A codec_config.json: 44.1 kHz, FSQ levels 8·5·5·5 (1000 codes) per group, 4× downsample to the code rate.

    The backbone's last width is `feature_dim` (it must equal the quantizer's input and the head's input).
    """
    dims = [*backbone_dims[:-1], feature_dim] if len(backbone_dims) else [feature_dim]
    return {
        "spec_transform": {"sample_rate": 44100, "n_mels": n_mels, "n_fft": 2048, "hop_length": hop_length,
                           "win_length": 2048},
        "backbone": {"input_channels": n_mels, "depths": list(backbone_depths), "dims": dims, "drop_path_rate": 0.0,
                     "kernel_size": 7},
        "head": {"hop_length": hop_length, "upsample_rates": list(upsample_rates),
                 "upsample_kernel_sizes": list(upsample_kernel_sizes),
                 "resblock_kernel_sizes": list(resblock_kernel_sizes),
                 "resblock_dilation_sizes": [list(d) for d in resblock_dilation_sizes], "num_mels": feature_dim,
                 "upsample_initial_channel": channels, "pre_conv_kernel_size": 13, "post_conv_kernel_size": 13},
        "quantizer": {"input_dim": feature_dim, "n_groups": n_groups, "n_codebooks": 1, "levels": [8, 5, 5, 5],
                      "downsample_factor": [2, 2]},
    }  # fmt: skip


# ---- candidates (measured in TRAINING.md) ---------------------------------------------------------------------------
DUAL_AR_CANDIDATES: dict[str, dict[str, Any]] = {
    "ar-128x4": dual_ar_dict(128, 4, 384, fast_dim=128, n_fast_layer=1, fast_intermediate_size=384, head_dim=32),
    "ar-192x4": dual_ar_dict(192, 4, 512, fast_dim=192, n_fast_layer=1, fast_intermediate_size=512),
    "ar-192x6": dual_ar_dict(192, 6, 512, fast_dim=192, n_fast_layer=1, fast_intermediate_size=512),
    "ar-192x4-f2": dual_ar_dict(192, 4, 512, fast_dim=192, n_fast_layer=2, fast_intermediate_size=512),
    "ar-256x4": dual_ar_dict(256, 4, 768, fast_dim=256, n_fast_layer=1, fast_intermediate_size=768, head_dim=64),
    # 8 codebooks, as upstream: pairs with codec-c128-g8 (twice the bits per frame, one fast step more per codebook)
    "ar-192x4-c8": dual_ar_dict(192, 4, 512, fast_dim=192, n_fast_layer=1, fast_intermediate_size=512, num_codebooks=8),
    "ar-192x6-c8": dual_ar_dict(192, 6, 512, fast_dim=192, n_fast_layer=1, fast_intermediate_size=512, num_codebooks=8),
}
CODEC_CANDIDATES: dict[str, dict[str, Any]] = {
    "codec-c96": codec_dict(96, feature_dim=128),
    "codec-c128": codec_dict(128, feature_dim=128),
    # 8 FSQ groups (upstream's count): 80 bits a frame instead of 40, same decoder
    "codec-c128-g8": codec_dict(128, feature_dim=128, n_groups=8),
    "codec-c192": codec_dict(192, feature_dim=160, backbone_dims=(64, 128, 160)),
    "codec-c256-k37": codec_dict(
        256, feature_dim=192, backbone_dims=(64, 128, 192), resblock_kernel_sizes=(3, 7),
        resblock_dilation_sizes=((1, 3), (1, 3)),
    ),
}  # fmt: skip

# ---- the chosen sizes (see TRAINING.md for the measurements) ---------------------------------------------------------
DUAL_AR_SMALL = DUAL_AR_CANDIDATES["ar-192x4"]
CODEC_SMALL = CODEC_CANDIDATES["codec-c128"]

# ---- tiny sizes for CPU tests (seconds per hundred steps) ------------------------------------------------------------
DUAL_AR_TINY = dual_ar_dict(64, 2, 128, fast_dim=64, n_fast_layer=1, fast_intermediate_size=128, head_dim=16)
CODEC_TINY = codec_dict(
    32, feature_dim=32, n_mels=32, backbone_dims=(16, 32), backbone_depths=(1, 1), resblock_dilation_sizes=((1,),)
)


def named_config(name_or_dict: str | dict[str, Any], table: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """A config dict from a candidate name (or `small` / `tiny`) or a dict given as is."""
    if isinstance(name_or_dict, dict):
        return name_or_dict
    aliases = {"small": 0, "tiny": 1}
    if name_or_dict in aliases:
        is_codec = table is CODEC_CANDIDATES
        pair = (CODEC_SMALL, CODEC_TINY) if is_codec else (DUAL_AR_SMALL, DUAL_AR_TINY)
        return pair[aliases[name_or_dict]]
    if name_or_dict not in table:
        raise ValueError(f"unknown config {name_or_dict!r}; use small, tiny or one of {', '.join(table)}")
    return table[name_or_dict]


# ---- measurement -----------------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class DualARCost:
    params: int
    step_ms: float  # one engine decode step (one frame) for one stream, min over repeats of the mean


@dataclass(frozen=True, slots=True)
class CodecCost:
    decoder_params: int
    encoder_params: int
    ms_per_frame: dict[int, float]  # chunk size (frames) → ms per frame, min over repeats
    segment_ms_per_frame: float  # one 107-frame segment in the BALANCED chunk schedule
    encode_rtf: float  # encoder seconds per second of audio (encode_codes on CPU)


def _min_mean_s(fn: Any, repeats: int, iters: int) -> float:
    """CPU seconds of this thread per call, min over repeats (CPU time: a busy shared machine inflates wall time)."""
    times = []
    for _ in range(repeats):
        t0 = time.thread_time()
        for _ in range(iters):
            fn()
        times.append((time.thread_time() - t0) / iters)
    return min(times)


@torch.inference_mode()
def measure_dual_ar(config: dict[str, Any], *, position: int = 300, repeats: int = 5, steps: int = 20) -> DualARCost:
    """Per-frame cost of one stream in the engine's CPU stepper (random weights: cost does not depend on them)."""
    cfg = DualARConfig.from_dict(config)
    model = DualARTransformer(cfg, semantic_begin_id=268).eval()
    model.set_batch_invariant(True)  # the engine's CPU default
    stepper = DecodeStepper(model, ENGINE_ROWS, max_batch=ENGINE_MAX_BATCH)
    stepper.set_sampling(0, RowSampling(temperature=0.7, top_p=0.7, repetition_penalty=1.2, seed=1))
    prompt = torch.zeros(1 + cfg.num_codebooks, position, dtype=torch.int32)
    prompt[0] = torch.randint(0, 256, (position,))
    logits, hidden = stepper.prefill(0, prompt, 0)
    stepper.start_segment(0, logits, hidden, position)
    stepper.set_commit([True])
    for _ in range(3):
        stepper.step(1, position + 8)
    step_s = _min_mean_s(lambda: stepper.step(1, position + 8), repeats, steps)
    return DualARCost(sum(p.numel() for p in model.parameters()), step_s * 1e3)


@torch.inference_mode()
def measure_codec(config: dict[str, Any], *, chunks: Sequence[int] = (2, 8, 24), repeats: int = 3) -> CodecCost:
    """Per-frame cost of the streaming vocoder at several chunk sizes, and of the encoder (10 s of audio)."""
    cfg = CodecConfig.from_dict(config)
    codec = FireflyCodec(cfg, with_encoder=True).eval()
    codec.init_buffers("cpu")
    names = [n for n, _ in codec.named_parameters()]
    encoder = {n for n in names if n.startswith(("backbone.", "quantizer.downsample.")) or ".project_in." in n}
    params = dict(codec.named_parameters())
    decoder = StreamingDecoder(codec, max_slots=8)
    slot = torch.tensor([0])

    def chunk_ms(frames: int) -> float:
        codes = torch.randint(0, cfg.codebook_size, (1, cfg.rows, frames))
        decoder.decode(codes, slot)
        return _min_mean_s(lambda: decoder.decode(codes, slot), repeats, 2) * 1e3

    per_size = {f: chunk_ms(f) for f in sorted({*chunks, *BALANCED_CHUNKS_FRAMES})}
    segment_ms = sum(per_size[f] for f in BALANCED_CHUNKS_FRAMES) / sum(BALANCED_CHUNKS_FRAMES)
    audio = torch.randn(1, 10 * cfg.sample_rate) * 0.1
    encode_s = _min_mean_s(lambda: codec.encode(audio), 2, 1)
    return CodecCost(
        decoder_params=sum(params[n].numel() for n in names if n not in encoder),
        encoder_params=sum(params[n].numel() for n in encoder),
        ms_per_frame={f: per_size[f] / f for f in chunks},
        segment_ms_per_frame=segment_ms,
        encode_rtf=encode_s / 10,
    )


@dataclass(frozen=True, slots=True)
class EngineCost:
    folder_bytes: int
    audio_s: float
    wall_s: float
    cpu_s: float  # process CPU time during the utterance (all threads): the wall time on an otherwise idle machine

    @property
    def rtf(self) -> float:
        return self.wall_s / self.audio_s

    @property
    def cpu_rtf(self) -> float:
        return self.cpu_s / self.audio_s


def measure_engine(dual_ar: dict[str, Any], codec: dict[str, Any], folder: Path, text: str = BENCH_TEXT) -> EngineCost:
    """Real-time factor of one utterance through the streaming engine (CPU, its defaults) with random weights.

    Random weights never stop on their own, so the export caps segments at a speech-like 1.43 frames per
    character (≈ 15 characters/s at 21.5 frames/s); the cost per frame does not depend on the weights.
    """
    import asyncio

    from streaming.config import BackendConfig
    from streaming.engine import Engine, EngineConfig
    from streaming.synth import synthesize

    from .checkpoints import export_model_folder
    from .codec_model import TrainableCodec
    from .dual_ar_init import init_dual_ar

    torch.manual_seed(0)
    model = DualARTransformer(DualARConfig.from_dict(dual_ar), semantic_begin_id=268)
    init_dual_ar(model, 0.02)
    gen = TrainableCodec(CodecConfig.from_dict(codec), seed=0)
    exported = export_model_folder(
        folder, dual_ar_state=model.state_dict(), dual_ar_config=dual_ar, codec_state=gen.inference_state_dict(),
        codec_config=codec, name="rtf-probe", max_frames_per_char=1.43,
    )  # fmt: skip
    engine = Engine(EngineConfig(BackendConfig(checkpoint=folder)))
    engine.start()
    try:
        if not engine.wait_ready(300):
            raise RuntimeError(f"engine did not start: {engine.fault}")
        t0, c0 = time.perf_counter(), time.process_time()
        pcm = asyncio.run(synthesize(engine, text))
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    finally:
        engine.stop()
    rate = CodecConfig.from_dict(codec).sample_rate
    return EngineCost(exported.total_bytes, len(pcm) / rate, wall, cpu)


# (DualAR, codec) pairs measured end to end through the engine.
ENGINE_PAIRS = (
    ("ar-128x4", "codec-c128"), ("ar-192x4", "codec-c128"), ("ar-192x6", "codec-c128"), ("ar-192x4", "codec-c192"),
)  # fmt: skip


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="CPU cost of the candidate sizes (1 torch thread, fp32)")
    parser.add_argument("--dual-ar", nargs="*", default=list(DUAL_AR_CANDIDATES))
    parser.add_argument("--codec", nargs="*", default=list(CODEC_CANDIDATES))
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the table keeps each minimum")
    parser.add_argument("--no-engine", action="store_true", help="skip the end-to-end engine runs")
    parser.add_argument("--pairs", nargs="*", help="engine pairs as DUALAR+CODEC (default: the measured table's)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    load_before = os.getloadavg()[0]
    ar: dict[str, DualARCost] = {}
    codec: dict[str, CodecCost] = {}
    engine: dict[tuple[str, str], EngineCost] = {}
    for _ in range(args.rounds):
        for name in args.dual_ar:
            c = measure_dual_ar(DUAL_AR_CANDIDATES[name])
            ar[name] = c if name not in ar or c.step_ms < ar[name].step_ms else ar[name]
        for name in args.codec:
            k = measure_codec(CODEC_CANDIDATES[name])
            codec[name] = (
                k if name not in codec or k.segment_ms_per_frame < codec[name].segment_ms_per_frame else codec[name]
            )
        pairs = [tuple(p.split("+", 1)) for p in args.pairs] if args.pairs else list(ENGINE_PAIRS)
        for pair in () if args.no_engine else pairs:
            with tempfile.TemporaryDirectory() as tmp:
                e = measure_engine(DUAL_AR_CANDIDATES[pair[0]], CODEC_CANDIDATES[pair[1]], Path(tmp) / "probe")
            engine[pair] = e if pair not in engine or e.cpu_rtf < engine[pair].cpu_rtf else engine[pair]
    out = ["| DualAR | params | fp16 MB | decode step, CPU ms/frame |", "|---|---|---|---|"]
    for name, c in ar.items():
        out.append(f"| {name} | {c.params / 1e6:.2f} M | {2 * c.params / 1e6:.1f} | {c.step_ms:.1f} |")
    out += ["", "| codec | decoder params | encoder params | fp16 MB | ms/frame @2 | @8 | @24 | BALANCED segment "
            "| encoder RTF |", "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for name, k in codec.items():
        per = " | ".join(f"{k.ms_per_frame[f]:.2f}" for f in (2, 8, 24))
        mb = 2 * (k.decoder_params + k.encoder_params) / 1e6
        out.append(
            f"| {name} | {k.decoder_params / 1e6:.2f} M | {k.encoder_params / 1e6:.2f} M | {mb:.1f} | {per} | "
            f"{k.segment_ms_per_frame:.2f} | {k.encode_rtf:.4f} |"
        )
    out += ["", "| engine (DualAR + codec) | folder MB | audio s | wall s | RTF (wall) | RTF (process CPU) |",
            "|---|---|---|---|---|---|"]  # fmt: skip
    for (a, k2), e in engine.items():
        out.append(
            f"| {a} + {k2} | {e.folder_bytes / 1e6:.1f} | {e.audio_s:.1f} | {e.wall_s:.2f} | {e.rtf:.3f} | "
            f"{e.cpu_rtf:.3f} |"
        )
    out.append(f"\n(a frame is {FRAME_S * 1e3:.1f} ms of audio; RTF 0.5 allows {FRAME_S * 500:.1f} ms per frame)")
    out.append(
        f"(load average before / after: {load_before:.2f} / {os.getloadavg()[0]:.2f}; minimum of {args.rounds} rounds)"
    )
    print("\n".join(out))


if __name__ == "__main__":
    main()

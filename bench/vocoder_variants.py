"""The streaming vocoder's CUDA-graph variants: torch.compile inside the graphs (`--compile-vocoder`) and the
channels-last layout (`StreamingDecoder(channels_last=True)`: activations, state and conv weights time-major).

For each variant, a GraphedVocoder over the official codec config (bf16, random weights) — the serving path —
captures one graph per (batch, frames) shape; the table gives the replay time, real-time factor, compile+capture
seconds, and each variant's error against an fp32 eager decode of the same codes (two chunks, so the carried state
is checked too). Issue 3's levels: ≤ 2.5 ms (pass) / 1.5 ms (target) per 8-frame chunk at batch 1, ≥ 1,500× /
2,500× real time batched. On CPU (`--tiny`, a smoke test of the script) the decoder runs without graphs.

    python -m bench.vocoder_variants --out $OUT/vocoder_variants.json     (GPU; ~2-4 min with compiles)
    python -m bench.vocoder_variants --tiny                               (CPU smoke test)
"""

from __future__ import annotations

import argparse
import time

import torch

from bench.fullsize import environment, event_ms, random_codec, wall_ms, write_json
from bench.profile_step import kernel_profile
from model import codec_layers, compiled_regions, vocoder_stream
from model.stepper import half_step_buckets
from model.vocoder_graphs import GraphedVocoder
from model.vocoder_stream import StreamingDecoder

SHAPES = ((1, 8), (8, 8), (64, 8), (64, 24), (256, 24))
# "+static": compile one graph per shape; "@cat", "@out", "@triton": the history join (vocoder_stream.SILU_JOIN);
# "+bench": cudnn.benchmark (e.g. "graph@triton+bench"); "+aten": conv biases by ATen's add (the default since run 16
# is the Triton kernel on CUDA, codec_layers.BIAS_ADD "auto"; "+tbias", its old name, is accepted and changes nothing);
# "+ops": also an eager per-ATen-op profile at the PROFILE_SHAPES (which op launched the slow kernels)
VARIANTS = ("graph", "graph+cl", "graph+compiled", "graph+cl+compiled")
PROFILE_SHAPES = ((1, 8), (64, 24))  # per-kernel profile of these graphs (GPU)


def codes_for(b: int, f: int, rows: int, device: str) -> list[torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(b * 100 + f)
    return [torch.randint(0, 1000, (b, rows, f), generator=g, device=device) for _ in range(2)]


@torch.inference_mode()
def reference(device: str, tiny: bool, shapes: tuple[tuple[int, int], ...]) -> dict[tuple[int, int], torch.Tensor]:
    """fp32 eager audio of both chunks of every shape (the same random weights as the bf16 codec)."""
    codec = random_codec(device, torch.float32, tiny=tiny)
    out = {}
    for b, f in shapes:
        dec = StreamingDecoder(codec, max_slots=b)
        slots = torch.arange(b, device=device)
        out[(b, f)] = torch.cat([dec.decode(c, slots) for c in codes_for(b, f, codec.config.rows, device)], -1)
    return out


@torch.inference_mode()
def run_variant(
    variant: str,
    device: str,
    tiny: bool,
    ref: dict[tuple[int, int], torch.Tensor],
    deadline: float | None,
    shapes: tuple[tuple[int, int], ...] = SHAPES,
) -> list[dict]:
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    codec = random_codec(device, dtype, tiny=tiny)
    # "@cat" / "@out" / "@triton": how silu-first convs join their history (model.vocoder_stream.SILU_JOIN)
    vocoder_stream.SILU_JOIN = variant.split("@")[1].split("+", maxsplit=1)[0] if "@" in variant else "auto"
    # "+bench": cuDNN autotunes each conv shape's algorithm at its first call (graph warm-up) instead of its heuristic
    torch.backends.cudnn.benchmark = "+bench" in variant
    codec_layers.BIAS_ADD = "aten" if "+aten" in variant else "auto"
    # cuDNN caches a conv's plan whether tuned or not, so tuned and untuned variants of one layout need their own
    # processes (run 16 call 3: "+bench" after "+cl" reused the heuristic's plans). Run 16's "+dbench" (autotuning
    # the dilated convs only) ran as fast as "+bench" and saved ~1 s of capture a graph; removed since
    # "+cf": the channels-last layout runs the convs cuDNN's heuristic handles badly channels-first
    codec_layers.CHANNELS_FIRST_CONVS = frozenset({(256, 7, 5)}) if "+cf" in variant else frozenset()
    # "+fuse": resblock biases folded into the join and the residual add (codec_layers.FUSE_BIAS)
    codec_layers.FUSE_BIAS = "on" if "+fuse" in variant else "off"
    backend = "inductor" if "compiled" in variant else None
    channels_last = "+cl" in variant
    compiled_regions.reset(static_shapes="+static" in variant)
    rows = []
    # one decoder for every shape, as in the engine (its state's size is fixed, so compiles are shared by shapes)
    dec = StreamingDecoder(codec, max_slots=2 * max(b for b, _ in shapes), channels_last=channels_last)
    for b, f in shapes:
        if deadline is not None and time.perf_counter() > deadline:
            print(f"{variant}: out of time before {b}×{f}", flush=True)
            break
        chunks = codes_for(b, f, codec.config.rows, device)
        slots = torch.arange(b, device=device)
        t0 = time.perf_counter()
        if device == "cuda":
            graphed = GraphedVocoder(dec, b, [b], compile_backend=backend)
            graphed.capture(b, f)
            torch.cuda.synchronize()
            prepare_s = time.perf_counter() - t0
            ms = event_ms(lambda g=graphed, c=chunks[0], s=slots: g.decode(c, s), iters=20 if b <= 8 else 10)
            profile = None
            if (b, f) in PROFILE_SHAPES:
                profile = kernel_profile(lambda g=graphed, c=chunks[0], s=slots: g.decode(c, s), top=12)
                if "+ops" in variant:
                    profile["ops"] = op_profile(lambda d=dec, c=chunks[0], s=slots: d.decode(c, s))
            dec.reset(slots)
            audio = torch.cat([graphed.decode(c, slots).clone() for c in chunks], -1)
        else:
            profile = None
            with compiled_regions.compiled(backend):
                dec.decode(chunks[0], slots)
                prepare_s = time.perf_counter() - t0
                ms = wall_ms(lambda d=dec, c=chunks[0], s=slots: d.decode(c, s), device, iters=5)
                dec.reset(slots)
                audio = torch.cat([dec.decode(c, slots) for c in chunks], -1)
        expected = ref[(b, f)]
        audio_s = b * f * codec.config.samples_per_frame / codec.config.sample_rate
        row = {
            "variant": variant, "batch": b, "frames": f, "ms": round(ms, 3),
            "x_realtime": round(audio_s / (ms / 1e3), 1), "compile_capture_s": round(prepare_s, 1),
            "rel_err_vs_fp32": float((audio.float() - expected).norm() / expected.norm()),
            "max_abs_vs_fp32": float((audio.float() - expected).abs().max()),
            "profile": profile,
        }  # fmt: skip
        print({k: v for k, v in row.items() if k != "profile"}, flush=True)
        rows.append(row)
    row_failed = compiled_regions.failed_regions()
    if row_failed:
        print(f"{variant}: regions that fell back to eager: {row_failed}", flush=True)
    return rows


def op_profile(fn, top: int = 15) -> list[dict]:
    """Device time per ATen op (with its input shapes) of one eager call: which op launched which kernels."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        fn()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages(group_by_input_shape=True) if e.key.startswith("aten::")]
    events.sort(key=lambda e: -e.self_device_time_total)
    return [
        {"op": e.key, "shapes": str(e.input_shapes)[:120], "count": e.count, "us": round(e.self_device_time_total, 1)}
        for e in events[:top]
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out")
    ap.add_argument("--tiny", action="store_true", help="the tiny codec config (CPU smoke test)")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--budget-s", type=float, default=None, help="skip the shapes left after this many seconds")
    ap.add_argument(
        "--shapes",
        default=",".join(f"{b}x{f}" for b, f in SHAPES),
        help="batch×frames, e.g. 1x8,64x24; 'engine': every graph the engine captures (half-step buckets up to 64 "
        "rows × every chunk size: 72 shapes)",
    )
    args = ap.parse_args()
    if args.shapes == "engine":
        # imported here: streaming.backend needs soxr, which the GPU machine has only from carried wheels, and the
        # other shapes run without them (bench/run_vocoder_layouts_gpu.sh; run 17 call 4 failed on this import)
        from streaming.backend import VOCODER_MAX_BATCH
        from streaming.chunking import all_chunk_sizes

        shapes = tuple((b, f) for b in half_step_buckets(VOCODER_MAX_BATCH) for f in all_chunk_sizes())
    else:
        shapes = tuple(tuple(int(n) for n in s.split("x")) for s in args.shapes.split(","))  # type: ignore[misc]
    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    deadline = time.perf_counter() + args.budget_s if args.budget_s else None
    ref = reference(device, args.tiny, shapes)
    rows = []
    for v in args.variants.split(","):
        rows += run_variant(v, device, args.tiny, ref, deadline, shapes)  # type: ignore[arg-type]
        write_json(args.out, {"environment": environment(), "device": device, "rows": rows})
    for r in rows:
        if r["profile"]:
            p = r["profile"]
            print(f"\n{r['variant']} {r['batch']}×{r['frames']}: {p['kernels']} kernels, {p['kernel_us_total']:.0f} µs")
            for k in p["top"]:
                print(f"  {k['us']:>9.1f} µs {k['count']:>5} × {k['name'][:80]}")
            for k in p.get("ops", []):
                print(f"  op {k['us']:>9.1f} µs {k['count']:>5} × {k['op']} {k['shapes']}")
    print(f"\n{'variant':<20}{'batch×frames':>13}{'ms':>9}{'× real time':>13}{'compile s':>11}{'rel err':>10}")
    for r in rows:
        shape = f"{r['batch']}×{r['frames']}"
        print(
            f"{r['variant']:<20}{shape:>13}{r['ms']:>9.3f}{r['x_realtime']:>13.1f}"
            f"{r['compile_capture_s']:>11.1f}{r['rel_err_vs_fp32']:>10.2e}"
        )
    write_json(args.out, {"environment": environment(), "device": device, "rows": rows})


if __name__ == "__main__":
    main()

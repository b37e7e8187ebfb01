"""Decode-step and streaming-vocoder throughput on the full-size Fish 1.5 model (bf16, random weights).

DecodeStepper at batch buckets 1…1024 with every row at a random position in [1000, 1900) (the KV cache is filled
with random values, not prefilled), eager vs CUDA-graph replay, plus the graph == eager frame check; the streaming
vocoder (official codec config) eager vs graph per (batch, frames) call; a combined estimate of real-time streams;
optionally the torch.compile'd step (cold or warm inductor cache, whichever TORCHINDUCTOR_CACHE_DIR holds).
Usage: python -m bench.bench_decode [--out r.json] [--compile-batches 1,8] [--compile-only] [--dry-run]
"""

from __future__ import annotations

import argparse
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

from bench.fullsize import (
    FRAME_RATE_HZ,
    SEMANTIC_BEGIN_ID,
    environment,
    event_ms,
    random_codec,
    random_model,
    wall_ms,
    write_json,
)
from model.dual_ar import DualARTransformer
from model.frame import PENALTY_WINDOW_FRAMES
from model.stepper import DecodeStepper
from model.vocoder_stream import StreamingDecoder

BATCHES = (1, 8, 32, 64, 128, 256, 512, 1024)
ATTN_LEN = 2048  # the engine's length bucket for positions in [1024, 2048)
POSITIONS = (1000, 1900)
VOCODER_SHAPES = ((1, 8), (1, 24), (8, 24), (64, 24), (256, 24))
CHECK_STEPS = 4


def fill_rows(st: DecodeStepper, rows: int, seed: int, greedy_every: int = 4) -> None:
    """Random frames, windows and positions for rows [0, rows); every `greedy_every`-th row samples greedily."""
    c, dev = st.model.config, st.device
    g = torch.Generator(device=dev).manual_seed(seed)

    def codes(*shape: int) -> torch.Tensor:
        return torch.randint(0, c.codebook_size, shape, generator=g, device=dev)

    frame_codes = codes(rows, c.num_codebooks)
    st.frame[:rows, 1:] = frame_codes
    st.frame[:rows, 0] = SEMANTIC_BEGIN_ID + frame_codes[:, 0]
    window_codes = codes(rows, c.num_codebooks, PENALTY_WINDOW_FRAMES)
    st.window[:rows, 1:] = window_codes
    st.window[:rows, 0] = SEMANTIC_BEGIN_ID + window_codes[:, 0]
    st.pos[:rows] = torch.randint(*POSITIONS, (rows,), generator=g, device=dev)
    st.loop_step[:rows] = torch.randint(0, 64, (rows,), generator=g, device=dev)
    st.seed[:rows] = torch.arange(rows, device=dev) + 1000 * seed
    st.noise_step[:rows] = seed
    greedy = (torch.arange(rows, device=dev) + seed) % greedy_every == 0
    st.temperature[:rows] = torch.where(greedy, 0.0, 0.7)
    st.top_p[:rows] = 0.7
    st.repetition_penalty[:rows] = 1.2
    st.commit.zero_()


def make_stepper(model: DualARTransformer, n_rows: int, cache_len: int = ATTN_LEN, **kw: Any) -> DecodeStepper:
    """A stepper whose one attention length is its cache's, `cache_len`, filled with random keys and values; the
    first ATTN_LEN positions hold the same values whatever `cache_len` (so a longer cache's steps are comparable)."""
    st = DecodeStepper(model, n_rows, max_seq_len=cache_len, length_buckets=[cache_len], **kw)
    caches = (st.cache.k, st.cache.v)
    if cache_len == ATTN_LEN:
        for cache in caches:
            cache.normal_(0, 0.5)
        return st
    # the same draws, in the same order, as the ATTN_LEN caches above; then the positions past them
    firsts = [torch.empty_like(cache[..., :ATTN_LEN, :], memory_format=torch.contiguous_format) for cache in caches]
    for first in firsts:
        first.normal_(0, 0.5)
    for cache, first in zip(caches, firsts, strict=True):
        cache[..., :ATTN_LEN, :].copy_(first)
        cache[..., ATTN_LEN:, :].normal_(0, 0.5)
    return st


def run_frames(st: DecodeStepper, rows: int, fn: Callable[[], object], steps: int) -> torch.Tensor:
    """`steps` committed steps from the current state; returns frames (steps, rows, 1+nc); state is restored."""
    saved = [t.clone() for t in st._row_tensors()]
    st.commit[:rows] = True
    out = []
    for _ in range(steps):
        fn()
        out.append(st.out[:rows].clone())
    for t, s in zip(st._row_tensors(), saved, strict=True):
        t.copy_(s)
    st.commit.zero_()
    return torch.stack(out)


def agreement(test: torch.Tensor, ref: torch.Tensor, greedy: torch.Tensor) -> dict[str, float]:
    """Frames (..., rows, 1+nc): fraction of equal codes, of equal whole frames, and both for greedy rows."""
    eq = test == ref
    g = eq[..., greedy, :]
    return {
        "codes_equal": float(eq.float().mean()),
        "frames_equal": float(eq.all(-1).float().mean()),
        "greedy_codes_equal": float(g.float().mean()) if g.numel() else float("nan"),
        "greedy_frames_equal": float(g.all(-1).float().mean()) if g.numel() else float("nan"),
        "bitwise": bool(eq.all()),
    }


@torch.inference_mode()
def bench_decode(model: DualARTransformer, batches: list[int], device: str) -> list[dict[str, Any]]:
    st = make_stepper(model, max(batches), use_cuda_graphs=device == "cuda")
    rows_out = []
    for b in batches:
        fill_rows(st, b, seed=b)
        r: dict[str, Any] = {"batch": b}
        r["eager_ms"] = wall_ms(lambda b=b: st._run_step(b, ATTN_LEN), device, iters=5 if b <= 256 else 3)
        if device == "cuda":
            t0 = time.perf_counter()
            graph = st.capture(b, ATTN_LEN)
            r["capture_s"] = time.perf_counter() - t0
            r["graph_ms"] = event_ms(graph.replay, iters=30)
            max_pos = int(st.pos[:b].max())
            r["engine_step_ms"] = wall_ms(lambda b=b, m=max_pos: st.step(b, m), device, iters=20, warmup=2)
            eager = run_frames(st, b, lambda b=b: st._step_impl(b, ATTN_LEN), CHECK_STEPS)
            replay = run_frames(st, b, graph.replay, CHECK_STEPS)
            r["graph_vs_eager"] = agreement(replay, eager, st.temperature[:b] == 0)
            best = r["graph_ms"]
        else:
            best = r["eager_ms"]
        r["frames_per_s"] = b * 1e3 / best
        r["realtime_streams"] = r["frames_per_s"] / FRAME_RATE_HZ
        rows_out.append(r)
        print(f"decode batch {b}: {r}", flush=True)
    return rows_out


def capture_vocoder(dec: StreamingDecoder, codes: torch.Tensor, slots: torch.Tensor) -> tuple[Any, Any, Any]:
    static_codes = codes.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            dec.decode(static_codes, slots)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = dec.decode(static_codes, slots)
    return graph, static_codes, static_out


@torch.inference_mode()
def bench_vocoder(device: str, tiny: bool) -> list[dict[str, Any]]:
    codec = random_codec(device, torch.bfloat16 if device == "cuda" else torch.float32, tiny=tiny)
    max_b = max(b for b, _ in VOCODER_SHAPES)
    dec = StreamingDecoder(codec, max_slots=max_b)
    rows_out = []
    for b, f in VOCODER_SHAPES:
        g = torch.Generator(device=device).manual_seed(b * 100 + f)
        chunks = [torch.randint(0, 1000, (b, codec.config.rows, f), generator=g, device=device) for _ in range(2)]
        slots = torch.arange(b, device=device)
        r: dict[str, Any] = {"batch": b, "frames": f}
        r["eager_ms"] = wall_ms(lambda c=chunks[0], s=slots: dec.decode(c, s), device, iters=5 if b <= 64 else 3)
        audio_s = b * f * codec.config.samples_per_frame / codec.config.sample_rate
        best = r["eager_ms"]
        if device == "cuda":
            graph, static_codes, static_out = capture_vocoder(dec, chunks[0], slots)
            r["graph_ms"] = event_ms(graph.replay, iters=10 if b <= 64 else 5)
            dec.reset(slots)
            eager = torch.cat([dec.decode(c, slots) for c in chunks], -1)
            dec.reset(slots)
            replayed = []
            for c in chunks:
                static_codes.copy_(c)
                graph.replay()
                replayed.append(static_out.clone())
            diff = (torch.cat(replayed, -1).float() - eager.float()).abs().max()
            r["graph_vs_eager_max_abs"] = float(diff)
            r["audio_rms"] = float(eager.float().pow(2).mean().sqrt())
            best = r["graph_ms"]
            del graph, static_out
        r["x_realtime"] = audio_s / (best / 1e3)
        r["ms_per_frame"] = best / (b * f)
        rows_out.append(r)
        print(f"vocoder {b}x{f}: {r}", flush=True)
    return rows_out


@torch.inference_mode()
def bench_compiled(
    model: DualARTransformer,
    batches: list[int],
    device: str,
    backend: str,
    on_result: Callable[[list[dict[str, Any]]], None] | None = None,
) -> list[dict[str, Any]]:
    """The compiled step captured in a graph: compile+capture time, replay time, frames vs the eager step."""
    st = make_stepper(model, max(batches), use_cuda_graphs=device == "cuda", compile_backend=backend)
    rows_out = []
    for b in batches:
        fill_rows(st, b, seed=b)
        r: dict[str, Any] = {"batch": b, "backend": backend}
        t0 = time.perf_counter()
        if device == "cuda":
            graph = st.capture(b, ATTN_LEN)
            run: Callable[[], object] = graph.replay
        else:
            st._run_step(b, ATTN_LEN)
            run = lambda b=b: st._run_step(b, ATTN_LEN)  # noqa: E731
        r["compile_and_capture_s"] = time.perf_counter() - t0
        r["graph_ms"] = event_ms(run, iters=30) if device == "cuda" else wall_ms(run, device, iters=3)
        r["frames_per_s"] = b * 1e3 / r["graph_ms"]
        r["realtime_streams"] = r["frames_per_s"] / FRAME_RATE_HZ
        # one step from 8 random states, compiled vs eager (rows alternate greedy / sampled between trials)
        tests, refs, greedy = [], [], []
        for trial in range(8):
            fill_rows(st, b, seed=1000 + trial, greedy_every=2)
            refs.append(run_frames(st, b, lambda b=b: st._step_impl(b, ATTN_LEN), 1)[0])
            tests.append(run_frames(st, b, run, 1)[0])
            greedy.append(st.temperature[:b] == 0)
        test, ref, gmask = torch.cat(tests), torch.cat(refs), torch.cat(greedy)
        r["compiled_vs_eager"] = agreement(test, ref, gmask)
        eager_run = run_frames(st, b, lambda b=b: st._step_impl(b, ATTN_LEN), CHECK_STEPS)
        r["compiled_vs_eager_4_steps_from_one_state"] = agreement(run_frames(st, b, run, CHECK_STEPS), eager_run,
                                                                  st.temperature[:b] == 0)  # fmt: skip
        rows_out.append(r)
        print(f"compiled batch {b}: {r}", flush=True)
        if on_result is not None:  # compiling is the slow stage: keep each batch's result even if a later one dies
            on_result(rows_out)
    return rows_out


def combined(decode: list[dict[str, Any]], vocoder: list[dict[str, Any]], key: str) -> dict[str, Any]:
    """Real-time streams when one worker does, per second, N·21.53 frames of decode and of vocoder (24-frame chunks)."""
    voc = {r["batch"]: r["ms_per_frame"] for r in vocoder if r["frames"] == 24}
    table = []
    for r in decode:
        n = r["batch"]
        vb = max((b for b in voc if b <= n), default=min(voc))
        decode_ms = r.get(key, r["eager_ms"])
        load = FRAME_RATE_HZ * (decode_ms + n * voc[vb]) / 1e3  # seconds of GPU work per second of audio
        table.append({"streams": n, "decode_ms_per_step": decode_ms, "vocoder_batch": vb,
                      "vocoder_ms_per_frame": voc[vb], "gpu_s_per_s": load, "realtime_ok": load <= 1.0})  # fmt: skip
    ok = [t["streams"] for t in table if t["realtime_ok"]]
    return {"table": table, "max_realtime_streams_measured": max(ok) if ok else 0}


def print_tables(res: dict[str, Any]) -> None:
    if res.get("decode"):
        print("\n== decode step (bf16, attn 2048, positions 1000-1900) ==")
        print(
            f"{'batch':>6s} {'eager ms':>9s} {'graph ms':>9s} {'step() ms':>9s} {'frames/s':>9s} {'RT streams':>10s} {'graph==eager':>12s}"
        )
        for r in res["decode"]:
            gve = r.get("graph_vs_eager", {})
            print(f"{r['batch']:6d} {r['eager_ms']:9.2f} {r.get('graph_ms', float('nan')):9.3f} "
                  f"{r.get('engine_step_ms', float('nan')):9.3f} {r['frames_per_s']:9.0f} {r['realtime_streams']:10.1f} "
                  f"{gve.get('codes_equal', float('nan')):12.4f}")  # fmt: skip
    if res.get("vocoder"):
        print("\n== streaming vocoder (bf16, official config) ==")
        print(f"{'B x F':>8s} {'eager ms':>9s} {'graph ms':>9s} {'x RT':>8s} {'graph-eager':>11s}")
        for r in res["vocoder"]:
            print(f"{r['batch']:>4d}x{r['frames']:<3d} {r['eager_ms']:9.2f} {r.get('graph_ms', float('nan')):9.3f} "
                  f"{r['x_realtime']:8.0f} {r.get('graph_vs_eager_max_abs', float('nan')):11.2e}")  # fmt: skip
    if res.get("compiled"):
        print("\n== compiled step (inductor) in a CUDA graph ==")
        for r in res["compiled"]:
            cve = r["compiled_vs_eager"]
            print(f"batch {r['batch']}: compile+capture {r['compile_and_capture_s']:.1f} s, {r['graph_ms']:.3f} ms/step, "
                  f"{r['realtime_streams']:.0f} RT streams; vs eager codes {cve['codes_equal']:.3f}, greedy frames "
                  f"{cve['greedy_frames_equal']:.3f}")  # fmt: skip
    for key, comb in res.get("combined", {}).items():
        print(
            f"combined ({key}): max real-time streams among measured batches = {comb['max_realtime_streams_measured']}"
        )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    ap.add_argument("--compile-batches", default="", help="e.g. 1,8: also time the torch.compile'd step")
    ap.add_argument("--compile-backend", default="inductor")
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--no-vocoder", action="store_true")
    ap.add_argument("--dry-run", action="store_true", help="tiny config on CPU (checks the script, not the GPU)")
    args = ap.parse_args()
    device = "cpu" if args.dry_run else "cuda"
    res: dict[str, Any] = {"env": environment(), "what": "bench_decode", "dry_run": args.dry_run, "errors": {}}
    batches = [int(x) for x in args.batches.split(",") if x]
    compile_batches = [int(x) for x in args.compile_batches.split(",") if x]
    model = random_model(device, torch.bfloat16 if device == "cuda" else torch.float32, seed=0, tiny=args.dry_run)

    stages: list[tuple[str, Callable[[], Any]]] = []
    if not args.compile_only:
        stages.append(("decode", lambda: bench_decode(model, batches, device)))
        if not args.no_vocoder:
            stages.append(("vocoder", lambda: bench_vocoder(device, args.dry_run)))
    if compile_batches:

        def save_compiled(rows: list[dict[str, Any]]) -> None:
            res["compiled"] = rows
            write_json(args.out, res)

        stages.append(
            ("compiled", lambda: bench_compiled(model, compile_batches, device, args.compile_backend, save_compiled))
        )
    for name, fn in stages:
        t0 = time.perf_counter()
        try:
            res[name] = fn()
        except Exception as e:  # keep what the other stages measured
            res["errors"][name] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"
            print(f"stage {name} FAILED: {res['errors'][name]}", flush=True)
        res.setdefault("stage_s", {})[name] = time.perf_counter() - t0
        if device == "cuda":
            res.setdefault("gpu_peak_gib", {})[name] = torch.cuda.max_memory_allocated() / 2**30
        if res.get("decode") and res.get("vocoder"):
            res["combined"] = {"graph": combined(res["decode"], res["vocoder"], "graph_ms")}
        write_json(args.out, res)
    print_tables(res)


if __name__ == "__main__":
    main()

"""The decode step's speed-ups measured one on top of the other, each in its own CUDA graphs from the same state:

1. `eager`     — the step as plain PyTorch ops in one CUDA graph per bucket (runs 1-11's code path)
2. `fused_ffn` — + one GEMV for each layer's w1 and w3 (`DualARTransformer.fuse_feed_forward`, what the engine loads)
3. `compiled`  — + torch.compile (inductor) of the step's regions: block, sampler, noise hash, heads
4. `compiled_cd` — + inductor's coordinate-descent tuning of its Triton kernels (slow to compile)
5. `compiled_reduce` — `compiled` with the cached attention as fp32 reductions inductor generates at every batch
   (`compiled` does so at batch 1 only, `compiled_sdpa` never)
6. `compiled_length` — `compiled` with the slow stack's decode attention by model.decode_attention's kernel, which
   reads each row's keys only up to its position (`--length-attention on`); `compiled_length_4096` the same with a
   4,096-position cache as its one attention length, as the engine runs it (same rows, positions and first 2,048
   positions of keys and values)

Run 25 added `engine_tuned_gemv` (call 4 ran every block product through model.gemv's kernels, as
`engine_tuned_length_4096` then, against the default as `engine_tuned_gemv_off`; run 26 made it the blocks' four
products and the codebook heads with the norms, SwiGLU and residual adds fused in, configs from bench.gemv_sweep) and `compiled_length_4096_fast_sdpa` (the fast stack's attention by inductor / SDPA, not the kernel); its
call 3 also measured RMSNorm folded into the product after it in one-row regions (2.140 against 2.117 ms without:
no gain, removed).

Per variant and batch: graph replay ms (median of 30), capture time (the compile, for 3-4), frames against variant
1 over 4 committed steps from the same state (sampling is chaotic: one flipped near-tie changes every later code, so
this counts divergence, not error), and the logits of one decode pass against an fp32 copy of the weights next to
the eager bf16 path's (the error measure). Kernel profiles of each batch-1 graph; `--warm-only` (a fresh process on
the same inductor cache) times what a restart pays to compile. Full-size Fish 1.5 config, random weights, bf16, rows
at positions 1000-1900, attention bucket 2048. Run 12 also measured what-ifs since removed from the code (bench/NOTES.md):
the fast stack's attention by plain fp32 math, and the slow stack's for small batches.
Usage: python -m bench.step_variants [--out r.json] [--batches 1,8,64] [--compile-batches 1,8] [--variants ...]
"""

from __future__ import annotations

import argparse
import copy
import glob
import os
import shutil
import time
import traceback
from dataclasses import dataclass
from typing import Any

import torch

from bench.bench_decode import ATTN_LEN, agreement, fill_rows, make_stepper, run_frames
from bench.fullsize import FRAME_RATE_HZ, environment, event_ms, random_model, wall_ms, write_json
from bench.profile_step import kernel_profile
from model import compiled_regions, gemv, launch_overlap
from model.dual_ar import DualARTransformer
from model.layers import Attention
from model.stepper import DecodeStepper

CHECK_STEPS = 4


@dataclass(frozen=True)
class Variant:
    fused: bool = True  # w1/w3 in one matmul (one-way: fused variants come after unfused ones)
    compiled: bool = False  # regions through inductor
    mode: str | None = None  # torch.compile mode
    coordinate_descent: bool = False  # inductor's coordinate-descent tuning of its Triton kernels
    reduction_attention: bool = False  # the slow and fast stacks' cached attention as inductor reductions
    decode_attention: str = "auto"  # otherwise: the model's rule (reductions at batch 1), or "sdpa"
    length_attention: bool = False  # the slow stack's decode attention by model.decode_attention's kernel
    cache_len: int = ATTN_LEN  # the stepper's cache and so its one attention length (the same rows and positions)
    tune_single_row: bool = False  # the stepper's own tuned one-row regions (compiled_regions.tuned_options())
    all_directions: bool = False  # coordinate descent tries every direction at once (gpt-fast's setting), not one
    fast_length_attention: bool = True  # with length_attention: the fast stack's too (run 25), else inductor/SDPA
    gemv: bool = False  # one-row compiled blocks and codebook heads by model.gemv's fused kernels (run 26)
    gemv_rows: int = 1  # ... and those of up to this many rows (gemv.MAX_ROWS)
    pdl: bool = False  # model.gemv's and model.decode_attention's kernels by programmatic dependent launch (run 27)


VARIANTS = {
    "eager": Variant(fused=False),
    "fused_ffn": Variant(),
    "compiled": Variant(compiled=True),
    "compiled_sdpa": Variant(compiled=True, decode_attention="sdpa"),  # run 12's code: SDPA at every batch
    "compiled_cd": Variant(compiled=True, coordinate_descent=True),
    "compiled_reduce": Variant(compiled=True, reduction_attention=True),
    "compiled_autotune": Variant(compiled=True, mode="max-autotune-no-cudagraphs"),  # minutes of autotuning per shape
    "compiled_length": Variant(compiled=True, length_attention=True),  # `compiled` + the length-aware attention kernel
    # the same over a 4,096-position cache: the engine's one decode length with the kernel on (positions unchanged)
    "compiled_length_4096": Variant(compiled=True, length_attention=True, cache_len=4096),
    # the engine's tuned one-row step (`--compile-tune-single-row on`) with the kernel, against `compiled_cd` (SDPA
    # era: reductions at one row over the 2,048 bucket); run at --batches 1 (coordinate descent compiles for minutes)
    "compiled_cd_length_4096": Variant(compiled=True, coordinate_descent=True, length_attention=True, cache_len=4096),
    # the same through the engine's path (DecodeStepper(tune_single_row=True): tuning and the static launcher off
    # as options of the one-row regions' compile, not global settings); run 24
    "engine_tuned_length_4096": Variant(compiled=True, length_attention=True, cache_len=4096, tune_single_row=True),
    # the same with inductor's coordinate_descent_check_all_directions (run 25)
    "engine_tuned_all_dirs": Variant(
        compiled=True, length_attention=True, cache_len=4096, tune_single_row=True, all_directions=True
    ),
    # run 26: the one-row blocks' four products and the codebook heads by model.gemv's kernels, norms, SwiGLU and
    # residual adds fused into them (run 25: wqkv and wo only, unfused); then the fast stack's attention by
    # inductor / SDPA (not the kernel)
    "engine_tuned_gemv": Variant(compiled=True, length_attention=True, cache_len=4096, tune_single_row=True, gemv=True),
    # run 26: the static-compiled buckets of up to 8 rows with model.gemv's kernels (gemv.MAX_ROWS 8), against
    # compiled_length_4096 (inductor's untuned kernels and cuBLAS there)
    "compiled_length_4096_gemv8": Variant(
        compiled=True, length_attention=True, cache_len=4096, gemv=True, gemv_rows=gemv.KERNEL_MAX_ROWS
    ),
    # run 27: the same with programmatic dependent launch (model.launch_overlap): each kernel's weight reads start
    # while the kernel before it runs; and with the few-row kernels too (gemv.MAX_ROWS 8: the 2-8-row buckets)
    "engine_tuned_gemv_pdl": Variant(
        compiled=True, length_attention=True, cache_len=4096, tune_single_row=True, gemv=True, pdl=True
    ),
    "engine_tuned_gemv8_pdl": Variant(
        compiled=True,
        length_attention=True,
        cache_len=4096,
        tune_single_row=True,
        gemv=True,
        gemv_rows=gemv.KERNEL_MAX_ROWS,
        pdl=True,
    ),
    "compiled_length_4096_fast_sdpa": Variant(
        compiled=True, length_attention=True, cache_len=4096, fast_length_attention=False
    ),
}


def apply(model: DualARTransformer, v: Variant) -> None:
    Attention.decode_attention = "reduction" if v.reduction_attention else v.decode_attention
    model.use_length_attention(v.length_attention)
    gemv.MODE = "auto" if v.gemv else "off"
    gemv.MAX_ROWS = v.gemv_rows
    launch_overlap.MODE = "auto" if v.pdl else "off"
    if not v.fast_length_attention:
        for module in model.fast_layers.modules():
            if isinstance(module, Attention):
                module.length_attention = False
    if v.fused:
        model.fuse_feed_forward()
    if v.compiled:
        import torch._inductor.config as inductor_config

        inductor_config.coordinate_descent_tuning = v.coordinate_descent
        inductor_config.coordinate_descent_check_all_directions = v.all_directions
        compiled_regions.reset(v.mode)


def new_stepper(
    model: DualARTransformer,
    rows: int,
    compile_backend: str | None,
    compile_max: int,
    cache_len: int = ATTN_LEN,
    tune_single_row: bool = False,
) -> DecodeStepper:
    torch.manual_seed(0)  # the same random KV cache for every variant
    return make_stepper(
        model, rows, cache_len, use_cuda_graphs=True, compile_backend=compile_backend,
        compile_max_batch=compile_max or None, tune_single_row=tune_single_row,
    )  # fmt: skip


@torch.inference_mode()
def reference_frames(model: DualARTransformer, batches: list[int]) -> dict[int, torch.Tensor]:
    st = new_stepper(model, max(batches), None, 0)
    out = {}
    for b in batches:
        fill_rows(st, b, seed=b)
        out[b] = run_frames(st, b, lambda b=b: st._step_impl(b, ATTN_LEN), CHECK_STEPS)
    return out


@torch.inference_mode()
def measure(
    model: DualARTransformer,
    name: str,
    batches: list[int],
    refs: dict[int, torch.Tensor],
    compile_batches: list[int],
    deadline: float,
    profile_batches: tuple[int, ...] = (1,),
    trace_dir: str | None = None,
) -> dict[str, Any]:
    v = VARIANTS[name]
    backend = "inductor" if v.compiled else None
    todo = [b for b in batches if backend is None or b in compile_batches]
    length = v.cache_len
    st = new_stepper(model, max(batches), backend, max(compile_batches, default=0), length, v.tune_single_row)
    out: dict[str, Any] = {"variant": name, "batches": []}
    for b in todo:
        if time.perf_counter() > deadline:
            out["skipped_from_batch"] = b
            break
        fill_rows(st, b, seed=b)
        t0 = time.perf_counter()
        try:
            graph = st.capture(b, length)
        except Exception as e:  # keep the batches measured so far (a failed compile or out of memory at the largest)
            out.setdefault("failed_batches", {})[b] = f"{type(e).__name__}: {str(e)[:500]}"
            print(f"{name} batch {b} FAILED: {out['failed_batches'][b]}", flush=True)
            torch.cuda.empty_cache()
            continue
        r: dict[str, Any] = {"batch": b, "capture_s": time.perf_counter() - t0}
        r["graph_ms"] = event_ms(graph.replay, iters=30)
        r["step_call_ms"] = wall_ms(lambda b=b: st.step(b, int(st.pos[:b].max())), "cuda", iters=20, warmup=2)
        r["realtime_streams"] = b * 1e3 / r["graph_ms"] / FRAME_RATE_HZ
        got = run_frames(st, b, graph.replay, CHECK_STEPS)
        r["vs_eager"] = agreement(got, refs[b], st.temperature[:b] == 0)
        out["batches"].append(r)
        print(f"{name} batch {b}: {r['graph_ms']:.3f} ms (capture {r['capture_s']:.1f} s), "
              f"codes equal {r['vs_eager']['codes_equal']:.3f}", flush=True)  # fmt: skip
    for b in profile_batches:  # where a batch's graph spends its kernel time (run 12: 8.93 ms at 256 rows against
        if b in todo and (b, length) in st._graphs:  # the plain yardstick's 5.79, never profiled)
            fill_rows(st, b, seed=b)
            trace = f"{trace_dir}/{name}_b{b}.json" if trace_dir else None
            out[f"profile_b{b}"] = kernel_profile(st._graphs[(b, length)].replay, top=20, trace_path=trace)
    out["failed_regions"] = compiled_regions.failed_regions()
    out["cache_counts"] = compiled_regions.cache_counts()  # cumulative over the process's variants
    print(f"{name} compile caches so far: {out['cache_counts']}", flush=True)
    return out


class Reference32:
    """One decode pass (slow logits, then the fast stack's first codebook logits) of 8 rows at positions 1000-1900
    from one random state, in fp32 on an fp32 copy of the weights: the yardstick for a variant's bf16 logits (its
    error against fp32 next to the eager bf16 path's error says whether a fast path adds error beyond bf16's)."""

    ROWS = 8

    @torch.inference_mode()
    def __init__(self, model: DualARTransformer) -> None:
        c = model.config
        g = torch.Generator(device="cuda").manual_seed(123)
        codes = torch.randint(0, c.codebook_size, (self.ROWS, c.num_codebooks), generator=g, device="cuda")
        self.frames = torch.cat([codes[:, :1] + model.semantic_begin_id, codes], dim=1)
        self.pos = torch.randint(1000, 1900, (self.ROWS,), generator=g, device="cuda")
        self.cache = model.make_cache(self.ROWS, ATTN_LEN)
        self.cache.k.normal_(0, 0.5, generator=g)
        self.cache.v.normal_(0, 0.5, generator=g)
        ref = copy.deepcopy(model).float()
        cache32 = ref.make_cache(self.ROWS, ATTN_LEN)
        cache32.k.copy_(self.cache.k)
        cache32.v.copy_(self.cache.v)
        self.ref = self._logits(ref, cache32)
        del ref, cache32
        torch.cuda.empty_cache()

    def _logits(self, model: DualARTransformer, cache: Any) -> tuple[torch.Tensor, torch.Tensor]:
        logits, hidden = model.decode_slow(self.frames, cache, self.pos, ATTN_LEN)
        fast = model.fast_step(hidden, model.make_fast_cache(self.ROWS), 0)
        return logits.float(), fast.float()

    @torch.inference_mode()
    def compare(self, model: DualARTransformer, backend: str | None) -> dict[str, float]:
        with compiled_regions.compiled(backend):
            got = self._logits(model, self.cache)
        out = {}
        for name, g, r in zip(("slow", "fast"), got, self.ref, strict=True):
            out[f"{name}_rel_err"] = float((g - r).norm() / r.norm())
            out[f"{name}_top1_equal"] = float((g.argmax(-1) == r.argmax(-1)).float().mean())
        return out


@torch.inference_mode()
def warm_start(model: DualARTransformer, compile_batches: list[int]) -> dict[str, Any]:
    """What a restart pays: compile + capture of the compiled buckets with inductor's on-disk cache already filled."""
    model.fuse_feed_forward()
    st = new_stepper(model, max(compile_batches), "inductor", max(compile_batches))
    out: dict[str, Any] = {"batches": []}
    for b in compile_batches:
        fill_rows(st, b, seed=b)
        t0 = time.perf_counter()
        graph = st.capture(b, ATTN_LEN)
        out["batches"].append(
            {"batch": b, "capture_s": time.perf_counter() - t0, "graph_ms": event_ms(graph.replay, 30)}
        )
        print(f"warm batch {b}: {out['batches'][-1]}", flush=True)
    out["failed_regions"] = compiled_regions.failed_regions()
    return out


def copy_generated_code(dest: str) -> None:
    """Inductor's generated modules (each graph's kernels as source and its `call` in launch order), flattened."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    os.makedirs(dest, exist_ok=True)
    for path in glob.glob(os.path.join(cache_dir(), "**", "*.py"), recursive=True):
        shutil.copy(path, os.path.join(dest, os.path.basename(path)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--compile-batches", default="1,8")
    ap.add_argument("--budget-s", type=float, default=400.0, help="stop starting new measurements after this")
    ap.add_argument("--variants", default="eager,fused_ffn,compiled")
    ap.add_argument("--warm-only", action="store_true")
    ap.add_argument("--profile-batches", default="1", help="kernel profiles of these batches' graphs")
    ap.add_argument("--trace-dir", default=None, help="write each profile's Chrome trace here")
    ap.add_argument("--code-dir", default=None, help="copy inductor's generated Python (kernels, call order) here")
    ap.add_argument("--gemv-configs", default=None, help="model.gemv's launch configs from bench.gemv_sweep's JSON")
    args = ap.parse_args()
    if args.gemv_configs:
        print(f"gemv configs: {gemv.load_configs(args.gemv_configs)} from {args.gemv_configs}", flush=True)
    if args.trace_dir:
        os.makedirs(args.trace_dir, exist_ok=True)
    profile_batches = tuple(int(x) for x in args.profile_batches.split(",") if x)
    t_start = time.perf_counter()
    deadline = t_start + args.budget_s
    batches = [int(x) for x in args.batches.split(",") if x]
    compile_batches = [int(x) for x in args.compile_batches.split(",") if x]
    res: dict[str, Any] = {"env": environment(), "what": "step_variants", "errors": {}}
    model = random_model("cuda", torch.bfloat16, seed=0)
    res["model_build_s"] = time.perf_counter() - t_start
    if args.warm_only:
        try:
            res["warm"] = warm_start(model, compile_batches)
        except Exception as e:
            res["errors"]["warm"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"
            print(res["errors"]["warm"], flush=True)
        write_json(args.out, res)
        return
    refs = reference_frames(model, batches)
    res["variants"] = []
    ref32 = Reference32(model)
    for name in args.variants.split(","):
        if time.perf_counter() > deadline:
            res["errors"][name] = "skipped: out of time"
            continue
        try:
            apply(model, VARIANTS[name])
            v = measure(model, name, batches, refs, compile_batches, deadline, profile_batches, args.trace_dir)
            v["logits_vs_fp32"] = ref32.compare(model, "inductor" if VARIANTS[name].compiled else None)
            print(f"{name} logits vs fp32: {v['logits_vs_fp32']}", flush=True)
            res["variants"].append(v)
        except Exception as e:  # keep what the other variants measured
            res["errors"][name] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"
            print(f"variant {name} FAILED: {res['errors'][name]}", flush=True)
        res["total_s"] = time.perf_counter() - t_start
        write_json(args.out, res)
    if args.code_dir:
        copy_generated_code(args.code_dir)
    print(f"\n{'variant':>10s} {'batch':>5s} {'graph ms':>9s} {'step() ms':>9s} {'capture s':>9s} {'codes eq':>8s} "
          f"{'greedy fr eq':>12s}")  # fmt: skip
    for v in res["variants"]:
        for r in v["batches"]:
            a = r["vs_eager"]
            print(f"{v['variant']:>10s} {r['batch']:5d} {r['graph_ms']:9.3f} {r['step_call_ms']:9.3f} "
                  f"{r['capture_s']:9.1f} {a['codes_equal']:8.3f} {a['greedy_frames_equal']:12.3f}")  # fmt: skip
        for b in profile_batches:
            p = v.get(f"profile_b{b}")
            if p:
                print(
                    f"  {v['variant']} batch-{b} graph: {p['kernels']} kernels, "
                    f"{p['kernel_us_total'] / 1e3:.3f} ms kernel time"
                )
                print("    by family: " + ", ".join(f"{f} {us / 1e3:.2f} ms" for f, us in p["families_us"].items()))
                for k in p["top"][: 8 if b == 1 else 16]:
                    print(f"    {k['count']:5d} {k['us']:8.1f} us  {k['name'][:70]}")


if __name__ == "__main__":
    main()

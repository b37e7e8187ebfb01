"""Where the batch-1 decode step's time goes: per-kernel profile of one step, graph replay times of the current code
at several batches, and what-if variants patched in at run time (the old unfused RMSNorm; SDPA backends; matmul
attention instead of SDPA), each checked against the current code's frames. Prints tables, writes JSON.
Usage: python -m bench.profile_step [--out r.json] [--dry-run]
"""

from __future__ import annotations

import argparse
import contextlib
import time
import traceback
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F

from bench.bench_decode import ATTN_LEN, agreement, fill_rows, make_stepper, run_frames
from bench.fullsize import FRAME_RATE_HZ, environment, event_ms, random_model, write_json
from model import layers
from model.dual_ar import DualARTransformer

BATCHES = (1, 8, 64, 256, 1024)
VARIANTS = ("rms_norm", "sdpa_efficient", "sdpa_flash", "matmul_attention")


@contextlib.contextmanager
def patched(variant: str) -> Iterator[None]:
    """Run-time what-ifs joined by '+': 'rms_norm' (the old seven-kernel norm, to measure the fused one against),
    'matmul_attention' (no SDPA), 'sdpa_efficient' / 'sdpa_flash' (restrict SDPA's backends; cuDNN is the default)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    saved_norm, saved_sdpa = layers.RMSNorm.forward, F.scaled_dot_product_attention
    stack = contextlib.ExitStack()

    def unfused_norm(self: layers.RMSNorm, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(torch.mean(xf * xf, dim=-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight

    def matmul_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Any = None) -> torch.Tensor:
        return layers.invariant_attention(q, k, v, attn_mask)

    try:
        if "rms_norm" in variant:
            layers.RMSNorm.forward = unfused_norm  # type: ignore[method-assign]
        if "matmul_attention" in variant:
            F.scaled_dot_product_attention = matmul_attention  # type: ignore[assignment]
        if "sdpa_efficient" in variant:
            stack.enter_context(sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]))
        if "sdpa_flash" in variant:  # flash where there is no mask (fast stack), else memory-efficient
            stack.enter_context(sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]))
        yield
    finally:
        stack.close()
        layers.RMSNorm.forward = saved_norm  # type: ignore[method-assign]
        F.scaled_dot_product_attention = saved_sdpa


# Kernel families by name, to read where a step's time goes at a glance: the top-N list of a large batch's step
# spreads one family over many fused-kernel names. Inductor names a Triton kernel after the ops it fused, so those
# are sorted by what they contain (a fused `mm`: a matmul; `softmax`: attention or sampling's softmax), the library
# kernels by their own names.
TRITON_FAMILIES = (
    ("gemm", ("_mm_", "_mm", "addmm", "bmm")),
    ("softmax (attention, sampling)", ("softmax",)),
    ("rms norm", ("rms_norm",)),
    ("cache write", ("index_put",)),
)
LIBRARY_FAMILIES = (
    ("sort", ("radixsort", "sort")),
    ("scan (top-p cumsum)", ("devicescan", "scan")),
    ("gemm", ("nvjet", "gemm", "cutlass", "splitk", "xmma", "cublas", "_gemv")),  # the last: model.gemv's kernels
    ("attention", ("fmha", "flash", "cudnn", "length_attention")),  # the last: model.decode_attention's kernels
    ("gather/scatter/index", ("scatter", "gather", "index")),
    ("copy", ("memcpy", "memset")),
)


def kernel_family(name: str) -> str:
    low = name.lower()
    if low.startswith("triton_"):
        families, fallback = TRITON_FAMILIES, "other triton"
    else:
        families, fallback = LIBRARY_FAMILIES, "other"
    return next((family for family, keys in families if any(k in low for k in keys)), fallback)


def kernel_profile(fn: Callable[[], object], top: int = 25, trace_path: str | None = None) -> dict[str, Any]:
    """Kernels of one call of fn: count, summed device time, time by kernel family, the top ones by time; with
    `trace_path`, the profiler's Chrome trace too (every kernel in launch order with its grid, block and registers:
    what `bench/step_anatomy.py` reads)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    if trace_path:
        prof.export_chrome_trace(trace_path)
    agg: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            a = agg[evt.name[:90]]
            a[0] += 1
            a[1] += evt.time_range.elapsed_us()
    rows = sorted(([n, int(c), t] for n, (c, t) in agg.items()), key=lambda r: -r[2])
    families: dict[str, float] = defaultdict(float)
    for n, _, t in rows:
        families[kernel_family(n)] += t
    return {
        "kernels": sum(r[1] for r in rows),
        "kernel_us_total": sum(r[2] for r in rows),
        "families_us": {f: round(t, 1) for f, t in sorted(families.items(), key=lambda kv: -kv[1])},
        "top": [{"name": n, "count": c, "us": round(t, 1)} for n, c, t in rows[:top]],
    }


@torch.inference_mode()
def main_gpu(model: DualARTransformer, res: dict[str, Any], save: Callable[[], None]) -> None:
    st = make_stepper(model, max(BATCHES), use_cuda_graphs=True)
    res["graph"] = []
    for b in BATCHES:
        fill_rows(st, b, seed=b)
        graph = st.capture(b, ATTN_LEN)
        r: dict[str, Any] = {"batch": b, "graph_ms": event_ms(graph.replay, iters=30)}
        r["frames_per_s"] = b * 1e3 / r["graph_ms"]
        r["realtime_streams"] = r["frames_per_s"] / FRAME_RATE_HZ
        eager = run_frames(st, b, lambda b=b: st._step_impl(b, ATTN_LEN), 4)
        r["graph_vs_eager"] = agreement(run_frames(st, b, graph.replay, 4), eager, st.temperature[:b] == 0)
        res["graph"].append(r)
        print(f"graph batch {b}: {r['graph_ms']:.3f} ms, {r['realtime_streams']:.0f} RT streams, "
              f"graph==eager {r['graph_vs_eager']['bitwise']}", flush=True)  # fmt: skip
        save()
    fill_rows(st, 1, seed=1)
    res["profile_eager_b1"] = kernel_profile(lambda: st._step_impl(1, ATTN_LEN))
    save()
    res["profile_graph_b1"] = kernel_profile(st._graphs[(1, ATTN_LEN)].replay)
    save()
    fill_rows(st, 64, seed=64)
    res["profile_eager_b64"] = kernel_profile(lambda: st._step_impl(64, ATTN_LEN), top=15)
    save()
    res["variants"] = []
    fill_rows(st, 8, seed=7, greedy_every=1)
    base = run_frames(st, 8, lambda: st._step_impl(8, ATTN_LEN), 1)
    for variant in VARIANTS:
        v: dict[str, Any] = {"variant": variant}
        try:
            with patched(variant):
                vst = make_stepper(model, 8, use_cuda_graphs=True)
                for b in (1, 8):
                    fill_rows(vst, b, seed=b)
                    v[f"graph_ms_b{b}"] = event_ms(vst.capture(b, ATTN_LEN).replay, iters=30)
                fill_rows(vst, 8, seed=7, greedy_every=1)
                vst.cache.k.copy_(st.cache.k[:, :8])
                vst.cache.v.copy_(st.cache.v[:, :8])
                got = run_frames(vst, 8, lambda vst=vst: vst._step_impl(8, ATTN_LEN), 1)
                v["greedy_vs_current"] = agreement(got, base, torch.ones(8, dtype=torch.bool, device=got.device))
                del vst
        except Exception as e:
            v["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}"
        res["variants"].append(v)
        print(f"variant {variant}: {v}", flush=True)
        save()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    res: dict[str, Any] = {"env": environment(), "what": "profile_step"}
    t0 = time.perf_counter()
    model = random_model("cuda", torch.bfloat16, seed=0)
    try:
        main_gpu(model, res, lambda: write_json(args.out, res))
    except Exception as e:
        res["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"
        print(res["error"])
    res["total_s"] = time.perf_counter() - t0
    write_json(args.out, res)
    for key in ("profile_eager_b1", "profile_graph_b1", "profile_eager_b64"):
        p = res.get(key)
        if p:
            print(f"\n== {key}: {p['kernels']} kernels, {p['kernel_us_total'] / 1e3:.3f} ms of kernel time ==")
            for r in p["top"][:12]:
                print(f"{r['count']:6d} {r['us']:9.1f} us  {r['name']}")


if __name__ == "__main__":
    main()

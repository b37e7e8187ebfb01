"""model.gemv's launch configs for the full-size DualAR's one-row products, measured on the GPU at hand.

For each product of a decode step (weight shape and fused input, as model.layers.TransformerBlock and the heads call
it) every config of a small grid (BLOCK_N rows a program, K_CHUNKS unrolled pieces of the row, warps) runs in one
CUDA graph of R launches over R copies of the weight (together larger than the L2 cache, as the step's 56 layers
are), so each figure is a cold-weight launch with its gap, as inside the step. Each config's output is checked
against the eager ops in fp32 on the same bf16 values (gemv.reference) before it is timed. The best config per
product goes to `configs` in the JSON (what gemv.load_configs and `fishgate serve --gemv-configs` read), with
the rule of thumb's time and the bandwidth each reaches.
Usage: python -m bench.gemv_sweep --out sweep.json [--budget-s 200] [--products wqkv,wo,w13,w2,fast_head,token_head]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from typing import Any

import torch

from bench.fullsize import environment, write_json
from model import gemv

L2_BYTES = 60 << 20  # H200: 50 MiB of L2; the weights of one graph span at least 4× that


# the full-size Fish 1.5 DualAR's one-row products (DualARTransformer.one_row_products), and its text head
PRODUCTS = {
    "wqkv": gemv.Product(1280, 1024, "norm", rope_rows=1152, head_dim=64),
    "wo": gemv.Product(1024, 1024, "plain", residual=True),
    "w13": gemv.Product(8192, 1024, "norm"),
    "w2": gemv.Product(1024, 4096, "swiglu", residual=True),
    "fast_head": gemv.Product(1024, 1024, "norm"),
    "token_head": gemv.Product(102048, 1024, "norm"),
}


def grid(p: gemv.Product) -> list[tuple[int, int, int]]:
    """(BLOCK_N, K_CHUNKS, num_warps) candidates: tiles of 2-64 K elements per program, 2-128 per thread."""
    import triton

    k_pad = triton.next_power_of_2(p.k)
    out = []
    for block_n, k_chunks, warps in itertools.product((1, 2, 4, 8, 16, 32), (1, 2, 4), (2, 4, 8, 16)):
        tile = block_n * k_pad
        per_thread = block_n * (k_pad // k_chunks) // (32 * warps)
        programs = -(-p.n // block_n)
        if 2048 <= tile <= 65536 and 4 <= per_thread <= 128 and programs >= 64 and not (k_chunks > 1 and warps < 4):
            out.append((block_n, k_chunks, warps))
    if p.n > 65536:  # the 102,048-row head: a few only (each graph reads 4 × 209 MB)
        out = [c for c in out if c[0] in (8, 16, 32) and c[1] == 1]
    return out


def inputs(p: gemv.Product, copies: int, gen: torch.Generator) -> dict[str, Any]:
    dev, bf = "cuda", torch.bfloat16
    weights = [(torch.randn(p.n, p.k, device=dev, generator=gen) / p.k**0.5).to(bf) for _ in range(copies)]
    width = 2 * p.k if p.fused == "swiglu" else p.k
    return {
        "weights": weights,
        "x": torch.randn(width, device=dev, generator=gen).to(bf),
        "norm": (torch.rand(p.k, device=dev, generator=gen) + 0.5).to(bf) if p.fused == "norm" else None,
        "residual": torch.randn(p.n, device=dev, generator=gen).to(bf) if p.residual else None,
        "rope": torch.rand(p.head_dim, device=dev, generator=gen) if p.rope_rows else None,  # (cos, sin) stand-ins
    }


def check(p: gemv.Product, io: dict[str, Any], config: tuple[int, int, int] | None) -> float:
    """Relative error of the kernel against gemv.reference in fp32 on the same bf16 values."""
    w = io["weights"][0]
    swiglu, rope = p.fused == "swiglu", io["rope"]
    got = gemv.launch(io["x"], w, io["norm"], io["residual"], 1e-6, swiglu, config, rope, p.rope_rows).float()
    f = lambda t: None if t is None else t.float()  # noqa: E731
    want = gemv.reference(io["x"].float(), w.float(), f(io["norm"]), 1e-6, swiglu, f(io["residual"]), rope, p.rope_rows)
    return ((got - want).norm() / want.norm()).item()


def time_us(p: gemv.Product, io: dict[str, Any], config: tuple[int, int, int] | None, replays: int = 12) -> float:
    """Median µs per launch in a CUDA graph of one launch per weight copy."""

    def run() -> None:
        for w in io["weights"]:
            gemv.launch(
                io["x"], w, io["norm"], io["residual"], 1e-6, p.fused == "swiglu", config, io["rope"], p.rope_rows
            )

    run()  # compile
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / len(io["weights"]))
    del graph
    return statistics.median(times)


@torch.inference_mode()
def sweep(name: str, p: gemv.Product, deadline: float) -> dict[str, Any]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    weight_bytes = p.n * p.k * 2
    copies = max(2, min(64, -(-4 * L2_BYTES // weight_bytes)))
    io = inputs(p, copies, gen)
    rule = gemv.config_for(p.n, p.k, p.fused)
    rows: list[dict[str, Any]] = []
    for config in [None, *grid(p)]:
        if time.monotonic() > deadline and config is not None:
            break
        row: dict[str, Any] = {"config": list(config or rule), "rule_of_thumb": config is None}
        try:
            row["rel_err"] = check(p, io, config)
            if row["rel_err"] > 2e-2:
                row["error"] = "wrong result"
            else:
                row["us"] = time_us(p, io, config)
                row["tb_s"] = weight_bytes / row["us"] / 1e6
        except Exception as e:  # a config Triton cannot build (registers, shared memory): skip it
            row["error"] = f"{type(e).__name__}: {str(e)[:120]}"
        rows.append(row)
    timed = [r for r in rows if "us" in r]
    best = min(timed, key=lambda r: r["us"]) if timed else None
    del io
    torch.cuda.empty_cache()
    return {
        "product": {"name": name, **p._asdict()},
        "copies": copies,
        "rows": rows,
        "best": best,
        "rule_of_thumb": rows[0],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="gemv_sweep.json")
    ap.add_argument("--products", default=",".join(PRODUCTS))
    ap.add_argument("--budget-s", type=float, default=200.0, help="stop trying configs after this (every product)")
    args = ap.parse_args()
    names = args.products.split(",")
    t0 = time.monotonic()
    results, configs = [], []
    for i, name in enumerate(names):
        p = PRODUCTS[name]
        share = (args.budget_s - (time.monotonic() - t0)) / (len(names) - i)
        r = sweep(name, p, time.monotonic() + share)
        results.append(r)
        best, rule = r["best"], r["rule_of_thumb"]
        if best is not None:
            configs.append({"n": p.n, "k": p.k, "fused": p.fused, "block_n": best["config"][0],
                            "k_chunks": best["config"][1], "num_warps": best["config"][2], "us": best["us"]})  # fmt: skip
        tried = sum("us" in row for row in r["rows"])
        print(
            f"{name:>10} {p.n:>6}x{p.k:<5} {p.fused:>6}{'+res' if p.residual else '    '}  tried {tried:>3}  "
            f"rule {rule.get('us', float('nan')):6.2f} us  best {best['us'] if best else float('nan'):6.2f} us "
            f"{best['config'] if best else ''} {best['tb_s'] if best else 0:4.2f} TB/s",
            flush=True,
        )
    write_json(args.out, {"env": environment(), "what": "gemv_sweep", "results": results, "configs": configs,
                          "total_s": time.monotonic() - t0})  # fmt: skip


if __name__ == "__main__":
    main()

"""Decode steps routed to a faster larger bucket (model.stepper.fastest_bucket), on the GPU: the engine's step path.

Run 31's sweep timed the compiled step at 64 rows slower than at 128 (5.46-5.69 against 4.93-4.94 ms: two of the
sampler's vocabulary reductions took 1.6 ms at 64 rows). The stepper now times each decode graph when it captures it
and runs a step in the fastest captured bucket that holds its rows. This builds the throughput servers' step (every
bucket compiled, the length-aware attention, one 4,096-position length), captures the buckets up to --max-rows,
prints each graph's replay time at capture, then times `DecodeStepper.step` (the engine's call: commit flags up,
frames down) at several row counts with routing on and off, and compares the frames of 4 committed steps from one
state both ways (bf16 kernels at another batch size round differently: equal frames are counted, not required).

    python -m bench.decode_routing [--max-rows 128] [--rows 33,48,64,65,96,128] [--out routing.json]
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from bench.bench_decode import fill_rows, make_stepper, run_frames
from bench.fullsize import environment, random_model, wall_ms, write_json
from bench.step_variants import VARIANTS, apply
from model.stepper import DecodeStepper

LENGTH = 4096  # the engine's one decode length with the length-aware attention
CHECK_STEPS = 4


def step_once(st: DecodeStepper, rows: int) -> None:
    st.set_commit([False] * rows)  # timed steps compute and discard: every call does the same work
    st.step(rows, int(st.pos[:rows].max()))


@torch.inference_mode()
def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-rows", type=int, default=128)
    ap.add_argument("--rows", default="33,48,64,65,96,128")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    model = random_model("cuda", torch.bfloat16, seed=0)
    apply(model, VARIANTS["compiled_length_4096"])
    torch.manual_seed(0)
    st = make_stepper(
        model, args.max_rows, LENGTH, use_cuda_graphs=True, compile_backend="inductor", compile_max_batch=args.max_rows
    )
    fill_rows(st, args.max_rows, seed=1)
    res: dict[str, Any] = {"env": environment(), "what": "decode_routing", "buckets": {}, "rows": []}
    for bucket in st.batch_buckets:
        if bucket < 16:
            continue
        c0 = time.perf_counter()
        st.capture(bucket, LENGTH)
        b = res["buckets"][bucket] = {
            "replay_ms": st.replay_ms[(bucket, LENGTH)],
            "capture_s": time.perf_counter() - c0,
        }
        print(
            f"bucket {bucket}: {b['replay_ms']:.3f} ms a replay at capture (capture {b['capture_s']:.1f} s)", flush=True
        )
    timed = dict(st.replay_ms)
    for rows in [int(x) for x in args.rows.split(",") if x]:
        r: dict[str, Any] = {"rows": rows}
        for way, times in (("routed", timed), ("own", {})):
            st.replay_ms = times
            r[f"{way}_bucket"] = st.route(st.bucket_for(rows, 0)[0], LENGTH)
            r[f"{way}_step_ms"] = wall_ms(lambda rows=rows: step_once(st, rows), "cuda", iters=30, warmup=3)
            fill_rows(st, args.max_rows, seed=rows)
            r[f"{way}_frames"] = run_frames(
                st, rows, lambda rows=rows: st.step(rows, int(st.pos[:rows].max())), CHECK_STEPS
            )
        st.replay_ms = timed
        routed, own = r.pop("routed_frames"), r.pop("own_frames")
        r["frames_equal"] = float((routed == own).all(-1).float().mean())
        r["codes_equal"] = float((routed == own).float().mean())
        res["rows"].append(r)
        print(f"{rows} rows: own bucket {r['own_bucket']} {r['own_step_ms']:.3f} ms, routed to {r['routed_bucket']} "
              f"{r['routed_step_ms']:.3f} ms; frames equal {r['frames_equal']:.2f}", flush=True)  # fmt: skip
    res["total_s"] = time.perf_counter() - t0
    print("\n| rows | own bucket | step() ms | routed bucket | step() ms | routed ÷ own | frames equal |")
    print("|---|---|---|---|---|---|---|")
    for r in res["rows"]:
        print(f"| {r['rows']} | {r['own_bucket']} | {r['own_step_ms']:.2f} | {r['routed_bucket']} | "
              f"{r['routed_step_ms']:.2f} | {r['routed_step_ms'] / r['own_step_ms']:.2f} | {r['frames_equal']:.2f} |")  # fmt: skip
    write_json(args.out, res)
    return res


if __name__ == "__main__":
    main()

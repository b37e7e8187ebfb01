"""What one static prefill pass costs (model.prefill_graphs: one CUDA graph per (rows, chunk, attention length)
bucket), on the full-size Fish 1.5 model in bf16 with random weights: graph replay time per bucket, and per prompt.

Why: H200 run 18's turns that started 28-81 segments at ~300 decoding rows spent 40-50 ms in prefill. The worker
writes up to 1,024 prompt tokens a turn, and a pass held at most 4 prompts (`PREFILL_ROW_BUCKETS`), so ~20 short
prompts took ~5 passes. If a pass's time is set by its ~3,000 kernels rather than its tokens, a rows bucket of 8
would halve such a turn's prefill. This measures rows 1-8 (the engine's default stops at 4; `--prefill-max-rows 8`
adds 8). Run 19: 8 prompts of 64 tokens 4.66 ms a pass against 3.86 ms for 4.
Usage: python -m bench.prefill_passes [--out r.json] [--rows 1,2,4,8] [--chunks 64,256] [--lengths 1024,2048]
       [--tiny] (a CPU smoke run on the tiny config, eager)
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

import model.prefill_graphs as prefill_graphs
from bench.fullsize import SEMANTIC_BEGIN_ID, environment, event_ms, random_model, wall_ms, write_json
from model.stepper import DecodeStepper


def prompt_tokens(codebooks: int, codebook_size: int, length: int, seed: int) -> torch.Tensor:
    """(1+nc, length) random semantic frames: a stand-in prompt chunk (a pass's cost does not depend on the values)."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, codebook_size, (codebooks, length), generator=g)
    return torch.cat([SEMANTIC_BEGIN_ID + codes[:1], codes])


def main(argv: list[str] | None = None) -> int:
    measure(argv)
    return 0


@torch.inference_mode()
def measure(argv: list[str] | None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument("--chunks", default="64,256")
    ap.add_argument("--lengths", default="1024,2048")
    ap.add_argument("--tiny", action="store_true")
    args = ap.parse_args(argv)
    rows_list = [int(x) for x in args.rows.split(",")]
    chunks = [int(x) for x in args.chunks.split(",")]
    lengths = [int(x) for x in args.lengths.split(",")]
    cuda = torch.cuda.is_available() and not args.tiny
    device = "cuda" if cuda else "cpu"
    if args.tiny:  # its context is short
        lengths, chunks = [128, 256], [64]
    assert set(chunks) <= set(prefill_graphs.PREFILL_CHUNK_BUCKETS), (
        f"chunks are {prefill_graphs.PREFILL_CHUNK_BUCKETS}"
    )
    model = random_model(device, torch.bfloat16 if cuda else torch.float32, tiny=args.tiny)
    c = model.config
    n_rows = max(rows_list) + 1  # the last row is the scratch row padding writes to
    stepper = DecodeStepper(
        model, n_rows, max_seq_len=max(lengths) * 2, length_buckets=lengths, use_cuda_graphs=cuda,
        prefill_scratch_row=n_rows - 1, prefill_row_buckets=sorted({*prefill_graphs.PREFILL_ROW_BUCKETS, *rows_list}),
    )  # fmt: skip
    static = stepper.static_prefill
    assert static is not None
    res: dict[str, Any] = {"env": environment(), "what": "prefill_passes", "rows": []}
    print(f"{'rows':>5} {'chunk':>6} {'length':>7} {'pass ms':>9} {'ms a prompt':>12} {'µs a token':>11}")
    for length in lengths:
        for chunk in chunks:
            for rows in rows_list:
                start = length - chunk - 1  # every row's end inside this attention bucket, past the one below
                prompts = [prompt_tokens(c.num_codebooks, c.codebook_size, chunk, seed=r) for r in range(rows)]
                row_ids, starts = list(range(rows)), [start] * rows
                bucket = static.bucket_for([chunk] * rows, [start + chunk] * rows)
                assert bucket == (rows, chunk, length), (bucket, rows, chunk, length)
                static.prefill_many(row_ids, prompts, starts)  # captures the bucket's graph (GPU)
                if cuda:
                    ms = event_ms(static.graphs[bucket].replay, iters=20)
                else:
                    ms = wall_ms(lambda r=row_ids, p=prompts, s=starts: static.prefill_many(r, p, s), "cpu", iters=3)
                row = {"rows": rows, "chunk": chunk, "length": length, "pass_ms": ms, "ms_per_prompt": ms / rows}
                res["rows"].append(row)
                per_token_us = ms * 1e3 / (rows * chunk)
                print(f"{rows:>5} {chunk:>6} {length:>7} {ms:>9.2f} {ms / rows:>12.2f} {per_token_us:>11.1f}")
    write_json(args.out, res)


if __name__ == "__main__":
    raise SystemExit(main())

"""Does cuDNN's autotuner (torch.backends.cudnn.benchmark) speed up the graph-captured streaming vocoder?

The vocoder runs fixed chunk shapes (captured once per shape), so a one-time algorithm search per shape is free at
serving time. For each setting: a fresh StreamingDecoder over the official codec config (bf16, random weights),
one graph per (batch, frames), median replay time; the output is compared with the default setting's.

    python -m bench.vocoder_cudnn --out $OUT/vocoder_cudnn.json     (GPU only)
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from bench.bench_decode import capture_vocoder
from bench.fullsize import environment, event_ms, random_codec, write_json
from model.vocoder_stream import StreamingDecoder

SHAPES = ((1, 8), (64, 24))


@torch.inference_mode()
def run(benchmark: bool, reference: dict[tuple[int, int], torch.Tensor]) -> list[dict[str, Any]]:
    torch.backends.cudnn.benchmark = benchmark
    codec = random_codec("cuda", torch.bfloat16, tiny=False)
    dec = StreamingDecoder(codec, max_slots=max(b for b, _ in SHAPES))
    rows = []
    for b, f in SHAPES:
        g = torch.Generator(device="cuda").manual_seed(b * 100 + f)
        codes = torch.randint(0, 1000, (b, codec.config.rows, f), generator=g, device="cuda")
        slots = torch.arange(b, device="cuda")
        graph, _, out = capture_vocoder(dec, codes, slots)
        ms = event_ms(graph.replay, iters=20)
        dec.reset(slots)
        graph.replay()
        audio = out.float().clone()
        key = (b, f)
        diff = float((audio - reference[key]).abs().max()) if key in reference else 0.0
        reference.setdefault(key, audio)
        audio_s = b * f * codec.config.samples_per_frame / codec.config.sample_rate
        row = {"cudnn_benchmark": benchmark, "batch": b, "frames": f, "graph_ms": ms,
               "x_realtime": audio_s / (ms / 1e3), "max_abs_diff_vs_default": diff}  # fmt: skip
        print(row, flush=True)
        rows.append(row)
        del graph
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out")
    args = ap.parse_args()
    reference: dict[tuple[int, int], torch.Tensor] = {}
    rows = run(False, reference) + run(True, reference) + run(False, reference)
    if args.out:
        write_json(args.out, {"environment": environment(), "rows": rows})


if __name__ == "__main__":
    main()

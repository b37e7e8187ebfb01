"""The decode step timed alone: a checkpoint loaded by the source tree under test, its step built as that tree's
engine builds it on a GPU (w1/w3 fused, the length-aware attention over one 4,096-position cache, compiled regions,
the one-row bucket tuned or not and small buckets symbolic or static as that tree's engine defaults say; GEMV kernels
and programmatic launch at their defaults), rows at positions 1,000-1,900 with random frames, repetition windows and
sampling (every 4th row greedy). A step's CUDA graph is replayed with commit off, so every replay does the same work;
the figure is the median of REPLAYS between CUDA events.

It imports nothing from bench/: bench.gpu runs this file with another tree first on PYTHONPATH, so the same
measuring code times that tree's model. On CPU it times the eager step (no graphs, no compile): a check of the
script, not a figure.

    python bench/step.py --checkpoint DIR --out step.json [--batches 1,64,256]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from model import decode_attention
from model.checkpoint import load_dual_ar
from model.frame import PENALTY_WINDOW_FRAMES
from model.stepper import DecodeStepper

try:  # the engine's rule in the tree under test (trees before it compiled every bucket static in this script)
    from streaming.backend import symbolic_batch_above as engine_symbolic_batch_above
except ImportError:
    engine_symbolic_batch_above = None
try:  # the engine's default in the tree under test (trees before BackendConfig tuned the one-row bucket)
    from streaming.config import BackendConfig

    ENGINE_TUNES_SINGLE_ROW = bool(getattr(BackendConfig(), "tune_single_row", True))
except ImportError:
    ENGINE_TUNES_SINGLE_ROW = True

CACHE_LEN = 4096  # the throughput servers' --max-seq-len: the step's one attention length with the length kernel
POSITIONS = (1000, 1900)  # where a stream cloned from a ~30 s reference voice decodes
REPLAYS = 30
FRAME_RATE_HZ = 44100 / 2048  # 21.53 frames a second of audio


def fill_rows(st: DecodeStepper, rows: int, seed: int, semantic_begin_id: int) -> None:
    """Random frames, windows, positions and sampling for rows [0, rows); every 4th row samples greedily."""
    c, dev = st.model.config, st.device
    g = torch.Generator(device=dev).manual_seed(seed)

    def codes(*shape: int) -> torch.Tensor:
        return torch.randint(0, c.codebook_size, shape, generator=g, device=dev)

    frame_codes = codes(rows, c.num_codebooks)
    st.frame[:rows, 1:] = frame_codes
    st.frame[:rows, 0] = semantic_begin_id + frame_codes[:, 0]
    window_codes = codes(rows, c.num_codebooks, PENALTY_WINDOW_FRAMES)
    st.window[:rows, 1:] = window_codes
    st.window[:rows, 0] = semantic_begin_id + window_codes[:, 0]
    st.pos[:rows] = torch.randint(*POSITIONS, (rows,), generator=g, device=dev)
    st.loop_step[:rows] = torch.randint(0, 64, (rows,), generator=g, device=dev)
    st.seed[:rows] = torch.arange(rows, device=dev) + 1000 * seed
    st.noise_step[:rows] = seed
    greedy = (torch.arange(rows, device=dev) + seed) % 4 == 0
    st.temperature[:rows] = torch.where(greedy, 0.0, 0.7)
    st.top_p[:rows] = 0.7
    st.repetition_penalty[:rows] = 1.2
    st.commit.zero_()  # timed steps compute and discard: the state never moves


def wall_ms(fn: Callable[[], object], iters: int, warmup: int = 2) -> float:
    """Median host wall time of fn() with a device sync after each call."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def event_ms(fn: Callable[[], object], iters: int = REPLAYS, warmup: int = 3) -> float:
    """Median device time of fn() between CUDA events (right for graph replays)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    pairs = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        pairs.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in pairs)


def build_stepper(
    checkpoint: Path,
    batches: list[int],
    device: torch.device,
    tune_single_row: bool = ENGINE_TUNES_SINGLE_ROW,
    symbolic_batch_above: int | None = None,
) -> tuple[DecodeStepper, int, float]:
    """(stepper, semantic begin id, load seconds): the model as the engine loads it on this device (buckets above
    `symbolic_batch_above` rows compiled with a symbolic batch; None: the engine's rule for the largest batch)."""
    if symbolic_batch_above is None and engine_symbolic_batch_above is not None:
        symbolic_batch_above = engine_symbolic_batch_above(max(batches))
    cuda = device.type == "cuda"
    t0 = time.perf_counter()
    loaded = load_dual_ar(checkpoint, device=device, dtype=torch.bfloat16 if cuda else torch.float32,
                          max_seq_len=CACHE_LEN)  # fmt: skip
    model = loaded.model
    model.fuse_feed_forward()
    model.use_length_attention(cuda and decode_attention.supported(device))
    load_s = time.perf_counter() - t0
    st = DecodeStepper(
        model, max(batches), max_seq_len=CACHE_LEN, use_cuda_graphs=cuda, length_buckets=[CACHE_LEN],
        compile_backend="inductor" if cuda else None, compile_max_batch=max(batches) if cuda else None,
        tune_single_row=cuda and tune_single_row, symbolic_batch_above=symbolic_batch_above,
    )  # fmt: skip
    g = torch.Generator(device=device).manual_seed(0)
    for cache in (st.cache.k, st.cache.v):
        cache.normal_(0, 0.5, generator=g)  # keys and values the rows attend over (no prefill)
    return st, loaded.tokenizer.semantic_begin_id, load_s


@torch.inference_mode()
def time_batches(st: DecodeStepper, batches: list[int], semantic_begin_id: int) -> list[dict[str, Any]]:
    rows = []
    for b in batches:
        fill_rows(st, b, seed=b, semantic_begin_id=semantic_begin_id)
        max_pos = int(st.pos[:b].max())
        r: dict[str, Any] = {"batch": b}
        if st.use_cuda_graphs:
            t0 = time.perf_counter()
            graph = st.capture(b, CACHE_LEN)  # compiles the bucket's regions first (inductor's cache, if warm)
            r["capture_s"] = round(time.perf_counter() - t0, 1)
            r["graph_ms"] = round(event_ms(graph.replay), 3)
        # the engine's call: the replay plus the frames' copy to the host
        iters = 20 if st.use_cuda_graphs else 3  # eager on CPU: a check of the script, not a figure
        r["step_call_ms"] = round(wall_ms(lambda b=b, m=max_pos: st.step(b, m), iters=iters), 3)
        r["realtime_streams"] = round(b * 1e3 / r.get("graph_ms", r["step_call_ms"]) / FRAME_RATE_HZ, 1)
        print(f"decode step, batch {b}: {r}", flush=True)
        rows.append(r)
    return rows


def environment() -> dict[str, Any]:
    env: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
                           "python": platform.python_version(), "cuda": torch.version.cuda}  # fmt: skip
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
    return env


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", type=Path, required=True, help="a folder bench/make_checkpoint.py wrote")
    ap.add_argument("--out", type=Path, required=True, help="the JSON to write")
    ap.add_argument("--batches", default="1", help="comma-separated batch buckets, e.g. 1,64,256")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tune-single-row", choices=("on", "off"), default=("off", "on")[ENGINE_TUNES_SINGLE_ROW],
                    help="compile the one-row bucket with coordinate-descent tuning (default: as the tree's engine "
                         "does)")  # fmt: skip
    ap.add_argument("--symbolic-batch-above", type=int, default=None,
                    help="buckets above this many rows compile with a symbolic batch, one compilation for all of "
                         "them (default: the engine's rule for the largest of --batches; a number past every bucket "
                         "compiles each one static)")  # fmt: skip
    args = ap.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    tree = Path(decode_attention.__file__).resolve().parents[1]  # whose model/ this process imported
    result: dict[str, Any] = {"what": "decode_step", "env": environment(), "tree": str(tree)}
    t0 = time.perf_counter()
    try:
        st, semantic_begin_id, load_s = build_stepper(
            args.checkpoint, batches, torch.device(args.device), args.tune_single_row == "on", args.symbolic_batch_above
        )
        result["load_s"] = round(load_s, 1)
        result["graphs"] = st.use_cuda_graphs
        result["tuned_single_row"] = st.tune_single_row  # as compiled: the CPU never tunes, whatever the flag says
        result["symbolic_batch_above"] = st.symbolic_batch_above
        result["batches"] = time_batches(st, batches, semantic_begin_id)
    except Exception as e:  # the JSON says what failed (bench.gpu prints it in its table)
        result["error"] = f"{type(e).__name__}: {e}"
        result["traceback"] = traceback.format_exc()[-4000:]
        print(result["traceback"], flush=True)
    result["total_s"] = round(time.perf_counter() - t0, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 1 if "error" in result else 0


if __name__ == "__main__":
    raise SystemExit(main())

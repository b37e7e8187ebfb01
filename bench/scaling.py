"""Throughput against batch, vocoder included: one decode-step sweep and one vocoder sweep, measured in the same device
call (bench/run_scaling_gpu.sh), combined into what one engine turn costs at each batch.

A turn advances every stream one frame (46.4 ms of audio) and vocodes what the streams' chunks completed. At steady
state a stream sends a 24-frame chunk (the last size of every chunk schedule) every 24 turns, so a turn at batch B
vocodes B/24 rows × 24 frames on average, in calls of r = ⌈B/24⌉ rows (at most the engine's 64-row vocoder batch),
each planned as the engine plans it (model.graph_timing.cheapest_plan): its own bucket (the smallest measured row
count that holds r) once, or another bucket's graph replayed where that is much cheaper — the engine's way round
cuDNN's pathological conv shapes (run 31: 32 × 24 frames took 107 ms, 64 × 24 took 30). So

    turn(B)      = step(B) + (B/24) / r × plan_ms(r)
    sustained(B) = B × 46.4 ms / turn(B)          real-time streams the GPU work of one turn can carry
    schedule line: turn ≤ 2/3 × 46.4 = 31.0 ms     what the chunk schedules need while streams ramp up
                                                   (streaming.chunking.sustainable_turn_fraction)

The model leaves out the host's share of a turn (scheduling, sockets: bench/host_ceiling.py) and the prompts'
prefill; the end-to-end runs through the server measure those. Usage:

    python -m bench.scaling STEP_JSON VOCODER_JSON [--out scaling.json] [--step-variant compiled_length_4096]
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

from bench.fullsize import FRAME_RATE_HZ
from model.graph_timing import cheapest_plan
from model.vocoder_graphs import REROUTE_BELOW

FRAME_MS = 1000.0 / FRAME_RATE_HZ  # 46.4 ms of audio a frame
STEADY_CHUNK_FRAMES = 24  # every chunk schedule's last size (streaming.chunking.SCHEDULES)
VOCODER_MAX_ROWS = 64  # streaming.backend.VOCODER_MAX_BATCH
SCHEDULE_TURN_MS = FRAME_MS * 2 / 3  # streaming.chunking.sustainable_turn_fraction of every schedule


def step_times(step: dict[str, Any], variant: str) -> dict[int, dict[str, float]]:
    """batch → {graph_ms, step_call_ms} of one step_variants variant."""
    for v in step["variants"]:
        if v["variant"] == variant:
            return {b["batch"]: {"graph_ms": b["graph_ms"], "step_call_ms": b["step_call_ms"]} for b in v["batches"]}
    raise KeyError(f"no variant {variant!r} in the step sweep (has {[v['variant'] for v in step['variants']]})")


def vocoder_times(vocoder: dict[str, Any], frames: int = STEADY_CHUNK_FRAMES) -> dict[int, float]:
    """rows → ms of one vocoder call of `frames` frames (the first variant that measured the shape)."""
    out: dict[int, float] = {}
    for r in vocoder["rows"]:
        if r["frames"] == frames and r["batch"] not in out:
            out[r["batch"]] = r["ms"]
    return out


def vocoder_ms_per_turn(batch: int, calls: dict[int, float]) -> tuple[float, str]:
    """(ms, the call's plan: rows, or rows→bucket×replays where rerouted) of the vocoder work one turn at `batch` streams
    carries on average."""
    need = min(math.ceil(batch / STEADY_CHUNK_FRAMES), VOCODER_MAX_ROWS)
    fits = [r for r in calls if r >= need]
    own = min(fits) if fits else max(calls)
    rows = min(need, own)
    bucket, replays = cheapest_plan(rows, own, calls, REROUTE_BELOW)
    plan = str(own) if (bucket, replays) == (own, 1) else f"{own}→{replays}×{bucket}"
    return batch / STEADY_CHUNK_FRAMES / rows * replays * calls[bucket], plan


def combine(step: dict[int, dict[str, float]], calls: dict[int, float]) -> list[dict[str, float]]:
    rows = []
    for b in sorted(step):
        voc, voc_plan = vocoder_ms_per_turn(b, calls)
        turn = step[b]["step_call_ms"] + voc
        rows.append({
            "batch": b,
            "graph_ms": step[b]["graph_ms"],
            "step_call_ms": step[b]["step_call_ms"],
            "decode_frames_per_s": b * 1e3 / step[b]["graph_ms"],
            "decode_streams": b * FRAME_MS / step[b]["graph_ms"],
            "vocoder_ms_per_turn": voc,
            "vocoder_plan": voc_plan,
            "turn_ms": turn,
            "frames_per_s": b * 1e3 / turn,
            "sustained_streams": b * FRAME_MS / turn,
            "within_schedule_line": turn <= SCHEDULE_TURN_MS,
        })  # fmt: skip
    return rows


def largest_batch_within(rows: list[dict[str, float]], turn_ms: float) -> float | None:
    """The batch at which turn_ms is reached, linear between measured batches (None: no measured batch is within)."""
    prev = None
    for r in rows:
        if r["turn_ms"] > turn_ms:
            if prev is None:
                return None
            frac = (turn_ms - prev["turn_ms"]) / (r["turn_ms"] - prev["turn_ms"])
            return prev["batch"] + frac * (r["batch"] - prev["batch"])
        prev = r
    return prev["batch"] if prev else None


def table(rows: list[dict[str, float]], anchor: dict[int, dict[str, float]] | None) -> str:
    head = (
        "| batch | step graph ms | plain graph ms (same call) | decode-only streams | vocoder ms a turn (rows a call) |"
    )
    head += " turn ms | frames/s | sustained real-time streams | turn ≤ 31.0 ms |"
    lines = [head, "|" + "---|" * 9]
    for r in rows:
        plain = f"{anchor[r['batch']]['graph_ms']:.2f}" if anchor and r["batch"] in anchor else "—"
        lines.append(
            f"| {r['batch']} | {r['graph_ms']:.2f} | {plain} | {r['decode_streams']:,.0f} | "
            f"{r['vocoder_ms_per_turn']:.2f} ({r['vocoder_plan']}) | {r['turn_ms']:.2f} | "
            f"{r['frames_per_s']:,.0f} | {r['sustained_streams']:,.0f} | {'yes' if r['within_schedule_line'] else 'no'} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("step_json")
    ap.add_argument("vocoder_json")
    ap.add_argument("--out")
    ap.add_argument("--step-variant", default="compiled_length_4096")
    ap.add_argument("--anchor-variant", default="eager", help="the plain captured step measured in the same call")
    args = ap.parse_args(argv)
    step = json.loads(Path(args.step_json).read_text())
    vocoder = json.loads(Path(args.vocoder_json).read_text())
    ours = step_times(step, args.step_variant)
    try:
        anchor = step_times(step, args.anchor_variant)
    except KeyError:
        anchor = None
    calls = vocoder_times(vocoder)
    if not calls:
        raise SystemExit(f"{args.vocoder_json}: no vocoder call of {STEADY_CHUNK_FRAMES} frames")
    rows = combine(ours, calls)
    result = {
        "date": (step.get("env") or {}).get("date") or time.strftime("%Y-%m-%d"),  # when the sweeps were measured
        "vocoder_date": (vocoder.get("environment") or vocoder.get("env") or {}).get("date"),
        "env": step.get("env"),
        "step_variant": args.step_variant,
        "vocoder_ms_24_frames": calls,
        "rows": rows,
        "plain_graph_ms": {b: t["graph_ms"] for b, t in (anchor or {}).items()},
        "largest_batch_turn_within_schedule_line": largest_batch_within(rows, SCHEDULE_TURN_MS),
        "largest_batch_turn_within_frame": largest_batch_within(rows, FRAME_MS),
    }
    print(table(rows, anchor))
    print(
        f"largest batch with a turn ≤ {SCHEDULE_TURN_MS:.1f} ms (the chunk schedules' line): "
        f"{result['largest_batch_turn_within_schedule_line']}; ≤ {FRAME_MS:.1f} ms (one frame): "
        f"{result['largest_batch_turn_within_frame']}"
    )
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()

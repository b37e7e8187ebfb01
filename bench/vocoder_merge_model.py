"""What merging a turn's vocoder chunks of different lengths (`--vocoder-merge-padding`) would save, by a model.

No device: the cost of a call of rows × frames is the H200's measured graph time for that shape (run 17,
`bench/results/run17_call5_engine_shapes_on.json`, on its cheapest plan, as bench/host_ceiling.py prices it). The
load is the end-to-end benchmark's: `streams` clients, each sending `waves` requests of `frames` frames one after
another, first requests spread over `ramp_s`, every stream advancing one frame a turn at `turn_ms`. Each turn makes
the engine's calls: the chunks that reached their schedule size (one call set), then the k-th tail piece of every
segment that ended (one call set per k), each call set grouped by `streaming.chunking.call_groups`.

    python -m bench.vocoder_merge_model --streams 300 --budgets 0 16 32 64 128
"""

from __future__ import annotations

import argparse
import random
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.host_ceiling import measured_vocoder_ms  # noqa: E402
from streaming.chunking import SCHEDULES, Latency, call_groups, split_tail  # noqa: E402

MAX_ROWS = 64  # streaming.backend VOCODER_MAX_BATCH


def stream_calls(frames: int, schedule: tuple[int, ...]) -> list[tuple[int, str, int]]:
    """(frame count at which it is vocoded, "ready" or "tail:k", chunk frames) for one segment of `frames`."""
    out, done, k = [], 0, 0
    while done + schedule[min(k, len(schedule) - 1)] <= frames:
        n = schedule[min(k, len(schedule) - 1)]
        done += n
        out.append((done, "ready", n))
        k += 1
    out += [(frames, f"tail:{i}", n) for i, n in enumerate(split_tail(frames - done))]
    return out


def per_turn(args: argparse.Namespace, budget: int, seed: int = 0) -> tuple[float, float, float]:
    """(vocoder ms, calls, padding share of the frames run) per turn with any vocoder work."""
    rng = random.Random(seed)
    cost = measured_vocoder_ms()
    ramp_turns = args.ramp_s * 1e3 / args.turn_ms
    turns: dict[int, dict[str, list[int]]] = defaultdict(lambda: defaultdict(list))
    for _ in range(args.streams):
        start = int(rng.random() * ramp_turns)
        for wave in range(args.waves):
            for at, kind, n in stream_calls(args.frames, SCHEDULES[Latency.BALANCED]):
                turns[start + wave * args.frames + at][kind].append(n)
    ms = calls = run = useful = 0.0
    for sets in turns.values():
        for kind in sorted(sets):  # "ready" first, then the tail pieces in order
            sizes = sets[kind]
            useful += sum(sizes)
            for frames, members in call_groups(sizes, budget, MAX_ROWS):
                for k in range(0, len(members), MAX_ROWS):
                    rows = len(members[k : k + MAX_ROWS])
                    ms += cost(rows, frames)
                    calls += 1
                    run += rows * frames
    n = len(turns)
    return ms / n, calls / n, 1 - useful / run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", type=int, default=300)
    p.add_argument("--waves", type=int, default=2)
    p.add_argument("--frames", type=int, default=200)
    p.add_argument("--ramp-s", type=float, default=9.0)
    p.add_argument("--turn-ms", type=float, default=33.0, help="turn time at this load (run 20: 32-35 ms at ~297)")
    p.add_argument("--budgets", type=int, nargs="+", default=[0, 16, 32, 64, 128])
    args = p.parse_args()
    print(f"{args.streams} streams, {args.waves} × {args.frames} frames, ramp {args.ramp_s} s, run 17's shape costs")
    print("| padding budget | vocoder ms a turn | calls a turn | padded frames |")
    print("|---|---|---|---|")
    for budget in args.budgets:
        ms, calls, pad = per_turn(args, budget)
        print(f"| {budget} | {ms:.2f} | {calls:.2f} | {pad:.1%} |")


if __name__ == "__main__":
    main()

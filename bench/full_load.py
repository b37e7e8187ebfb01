"""A load level at full load: its turns and first audio once every stream has arrived, apart from the ramp.

Run 29 found the line between a level that keeps real time and one whose young streams underrun: full-load turns
above ~2/3 of a frame (the chunk schedules' sustainable turn, `streaming.chunking.sustainable_turn_fraction`). This
prints, for the window [--from-s, --to-s) of a level: the turns' mean (weighted by turns) and worst interval from
its `bench.metrics_series` file, and first audio (p50 / p95, interpolated as the level summaries) with the requests
that underran among those that started in the window, from its `fishgate ttfa` JSON.

    python -m bench.full_load build/series_300.jsonl build/ttfa_300.json --from-s 8 --to-s 17
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.ttfa_by_time import first_audio
from streaming.chunking import SCHEDULES, Latency, sustainable_turn_fraction

FRAME_MS = 2048 / 44100 * 1e3  # one code frame of audio


def turns_in(rows: list[dict], from_s: float, to_s: float) -> dict[str, float]:
    """Turn time over the series intervals that end in [from_s, to_s): mean per turn and the worst interval's."""
    inside = [r for r in rows if from_s <= r["t"] < to_s and r.get("turns")]
    turns = sum(r["turns"] for r in inside)
    mean = sum(r["turn_ms"] * r["turns"] for r in inside) / turns if turns else 0.0
    return {"intervals": len(inside), "turns": turns, "turn_ms": mean, "worst_ms": max((r["turn_ms"] for r in inside), default=0.0)}  # fmt: skip


def first_audio_in(requests: list[dict], from_s: float, to_s: float) -> dict:
    """First audio of the requests that started in [from_s, to_s) and got audio: count, p50, p95, max, underran."""
    return first_audio([r for r in requests if from_s <= r["started_s"] < to_s and r.get("ttfa_ms") is not None])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("series", type=Path, help="a bench.metrics_series .jsonl file of one level")
    parser.add_argument("ttfa", type=Path, help="fishgate ttfa --json output of the same level")
    parser.add_argument("--from-s", type=float, default=8.0)
    parser.add_argument("--to-s", type=float, default=17.0)
    args = parser.parse_args(argv)
    rows = [json.loads(line) for line in args.series.read_text().splitlines() if line.strip()]
    turns = turns_in(rows, args.from_s, args.to_s)
    limit_ms = sustainable_turn_fraction(SCHEDULES[Latency.BALANCED]) * FRAME_MS
    print(
        f"{args.series.name}: {turns['turns']:.0f} turns in {args.from_s:g}-{args.to_s:g} s, {turns['turn_ms']:.1f} ms "
        f"a turn (worst interval {turns['worst_ms']:.1f}); the schedules keep real time under {limit_ms:.1f} ms"
    )
    for level in json.loads(args.ttfa.read_text())["levels"]:
        fa = first_audio_in(level["requests"], args.from_s, args.to_s)
        print(
            f"{args.ttfa.name}, {level['concurrency']} streams: {fa['requests']} requests started in the window, first "
            f"audio p50 {fa['p50_ms']:.0f} / p95 {fa['p95_ms']:.0f} ms, {fa['underran']} underran"
        )


if __name__ == "__main__":
    main()

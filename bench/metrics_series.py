"""The engine's state through a load level: poll `fishgate serve`'s /metrics and print one row per interval.

End-of-level metrics cannot say when in a level turns grew (e.g. past a frame after the real-time admission had
closed). This sampler records, every `--interval-s`, the gauges the admission reads (decoding rows, prefill queue,
the running turn average, capacity, waiting sessions, behind) and each interval's turns: how many, milliseconds per
turn by phase, and frames per turn. One JSON object per line, so a level's file can be read while it is written.

    python -m bench.metrics_series http://127.0.0.1:7860/metrics --out series.jsonl &   (stop it with a signal)
    python -m bench.metrics_series --table series.jsonl                                   (the rows as a table)

bench.gpu runs it through its streams level (OUT_DIR/*/streams_series.jsonl).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
import urllib.request
from pathlib import Path

from bench.turn_attribution import counters_from_text

GAUGES = (
    "decoding", "prefill_queue", "turn_avg_seconds", "admission_capacity", "admission_waiting", "step_batch_bucket",
    "step_length_bucket",
)  # fmt: skip
FLAGS = ("behind_real_time",)
PHASES = ("prefill", "step", "vocode")


def interval_row(t: float, before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """One interval between two scrapes: the gauges at its end and its turns by phase (ms per turn)."""
    row: dict[str, float] = {"t": round(t, 2)}
    for key in GAUGES + FLAGS:
        row[key] = after.get(key, 0.0)
    turns = after.get("turns", 0.0) - before.get("turns", 0.0)
    row["turns"] = turns
    per_turn = 1e3 / turns if turns else 0.0
    turn_s = after.get("turn_seconds", 0.0) - before.get("turn_seconds", 0.0)
    row["turn_ms"] = round(turn_s * per_turn, 1)
    for phase in PHASES:
        row[f"{phase}_ms"] = round(
            (after.get(f"{phase}_seconds", 0.0) - before.get(f"{phase}_seconds", 0.0)) * per_turn, 1
        )
    frames = after.get("frames", 0.0) - before.get("frames", 0.0)
    row["frames_per_turn"] = round(frames / turns, 1) if turns else 0.0
    row["slow_turns"] = after.get("slow_turns", 0.0) - before.get("slow_turns", 0.0)
    return row


def table(rows: list[dict[str, float]]) -> str:
    cols = ("t", "decoding", "prefill_queue", "admission_waiting", "admission_capacity", "behind_real_time", "turns",
            "turn_ms", "prefill_ms", "step_ms", "vocode_ms", "frames_per_turn", "slow_turns", "step_length_bucket")  # fmt: skip
    widths = [max(len(c), 8) for c in cols]
    lines = [" ".join(f"{c:>{w}}" for c, w in zip(cols, widths, strict=True))]
    lines += [" ".join(f"{r.get(c, 0):>{w}g}" for c, w in zip(cols, widths, strict=True)) for r in rows]
    return "\n".join(lines)


def poll(url: str, out: Path, interval_s: float) -> None:
    stop = False

    def done(*_: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, done)
    signal.signal(signal.SIGINT, done)
    t0 = time.monotonic()
    with urllib.request.urlopen(url, timeout=5) as r:
        before = counters_from_text(r.read().decode())
    with out.open("w") as f:
        while not stop:
            time.sleep(interval_s)
            try:
                with urllib.request.urlopen(url, timeout=5) as r:
                    after = counters_from_text(r.read().decode())
            except OSError:  # the server went away: the level is over
                break
            f.write(json.dumps(interval_row(time.monotonic() - t0, before, after)) + "\n")
            f.flush()
            before = after


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("url", nargs="?", default="http://127.0.0.1:7860/metrics")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--interval-s", type=float, default=0.5)
    ap.add_argument("--table", type=Path, help="print a written series as a table and exit")
    args = ap.parse_args(argv)
    if args.table is not None:
        print(table([json.loads(line) for line in args.table.read_text().splitlines() if line.strip()]))
        return 0
    if args.out is None:
        ap.error("--out is required when polling")
    poll(args.url, args.out, args.interval_s)
    return 0


if __name__ == "__main__":
    sys.exit(main())

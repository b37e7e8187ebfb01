"""First audio by when requests started: `fishgate ttfa` JSON results, binned by start time within the level.

A level's p95 mixes its ramp (few streams yet, short turns) with full load. This splits it, so a change that
shortens full-load turns shows where it acts:

    python -m bench.ttfa_by_time build/ttfa_300.json build/ttfa_warm_300.json --bin-s 2
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np


def first_audio(requests: list[dict]) -> dict:
    """Requests (each with a first audio): count, p50, p95, max and how many underran (zeros for none)."""
    if not requests:
        return {"requests": 0, "p50_ms": 0.0, "p95_ms": 0.0, "max_ms": 0.0, "underran": 0}
    ttfa = [r["ttfa_ms"] for r in requests]
    p50, p95 = np.percentile(ttfa, [50, 95])  # interpolated, as the level summaries (server.ttfa_report)
    return {"requests": len(ttfa), "p50_ms": float(p50), "p95_ms": float(p95), "max_ms": max(ttfa),
            "underran": sum(1 for r in requests if r.get("underruns"))}  # fmt: skip


def by_start_time(requests: list[dict], bin_s: float) -> list[dict]:
    """Requests with a first audio, grouped by started_s into bins of bin_s: count, p50, p95, max and underran."""
    bins: dict[int, list[dict]] = {}
    for r in requests:
        if r.get("ttfa_ms") is not None:
            bins.setdefault(int(r["started_s"] // bin_s), []).append(r)
    return [{"from_s": k * bin_s, "to_s": (k + 1) * bin_s, **first_audio(bins[k])} for k in sorted(bins)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path, nargs="+", help="fishgate ttfa --json outputs")
    parser.add_argument("--bin-s", type=float, default=2.0)
    args = parser.parse_args(argv)
    for path in args.results:
        for level in json.loads(path.read_text())["levels"]:
            print(f"{path.name}, {level['concurrency']} streams:")
            for row in by_start_time(level["requests"], args.bin_s):
                print(
                    f"  started {row['from_s']:4.0f}-{row['to_s']:<4.0f} s  {row['requests']:4d} requests  first audio "
                    f"p50 {row['p50_ms']:5.0f}  p95 {row['p95_ms']:5.0f}  max {row['max_ms']:5.0f} ms  "
                    f"underran {row['underran']}"
                )


if __name__ == "__main__":
    main()

"""How throughput scales with batch on the H200 (issue 3's plot), from results already measured — no new run.

Three curves against concurrent streams: what the captured decode step alone could sustain (run 3's graph sweep:
real-time streams = frames/s ÷ 21.5), and what `fishgate serve` delivered end to end with real WebSocket clients
(runs 4–6: aggregate real-time multiple = streams ÷ median per-request RTF), beside the line every stream needs
(y = x: at or above it nobody underruns). Writes docs/scaling.png and prints the points.

    python bench/plot_scaling.py
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

RESULTS = Path(__file__).with_name("results")
OUT = Path(__file__).resolve().parents[1] / "docs" / "scaling.png"


def decode_points() -> list[tuple[int, float]]:
    graph = json.loads((RESULTS / "run3_profile.json").read_text())["graph"]
    return [(g["batch"], g["realtime_streams"]) for g in graph]


def end_to_end_points() -> dict[str, list[tuple[int, float]]]:
    runs = json.loads((RESULTS / "e2e_server_summary.json").read_text())
    out: dict[str, list[tuple[int, float]]] = {}
    for run, levels in runs.items():
        points = []
        for key, rows in levels.items():
            if not key.isdigit() or not rows or rows[0].get("rtf_p50") is None:
                continue
            r = rows[0]
            points.append((int(r["concurrency"]), r["concurrency"] / r["rtf_p50"]))
        out[run.split("_")[0]] = sorted(points)
    return out


def main() -> None:
    decode = decode_points()
    e2e = end_to_end_points()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    xs = [x for x, _ in decode]
    ax.plot(xs, xs, "k:", label="needed: every stream at 1× real time")
    ax.plot(*zip(*decode, strict=True), "o-", label="decode step alone (run 3, CUDA graph)")
    for run, points in e2e.items():
        if points:
            ax.plot(*zip(*points, strict=True), "s--", label=f"end to end, fishgate serve + ttfa ({run})")
    ax.axhline(300, color="tab:red", lw=0.8, label="issue 3 pass: 300 streams")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("concurrent streams (batch)")
    ax.set_ylabel("real-time streams sustained")
    ax.set_title("H200, full-size Fish 1.5 config, bf16 (measured 2026-11)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(OUT, dpi=110)
    print("decode:", [(x, round(y, 1)) for x, y in decode])
    for run, points in e2e.items():
        print(f"{run}:", [(x, round(y, 1)) for x, y in points])
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()

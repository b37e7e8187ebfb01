"""How throughput scales with batch on the H200 (issue 3's plot), from results already measured — no new run.

Curves against concurrent streams (batch), all from one device call's sweep (bench/run_scaling_gpu.sh →
bench.scaling's JSON): the real-time streams the plain captured step alone could carry (the anchor's yardstick,
measured in the same call), those our decode step alone could carry, and those one engine turn — step plus the
vocoder work it carries — could carry; beside the line every stream needs (y = x). Points: what `fishgate serve`
carried end to end with real WebSocket clients (bench/run_first_audio_gpu.sh's ttfa summaries): filled where no
request underran and p95 first audio met 150 ms, hollow where not. Writes docs/scaling.png and prints the points.

    python bench/plot_scaling.py bench/results/run31/scaling.json \\
        bench/results/run29/call3/ttfa_summaries.json:ttfa_300,ttfa_warm2_300,ttfa_warm2_384
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

FRAME_MS = 1000 * 2048 / 44100  # 46.4 ms of audio a frame
OUT = Path(__file__).resolve().parents[1] / "docs" / "scaling.png"
P95_PASS_MS = 150.0


def sweep_curves(scaling: dict) -> dict[str, list[tuple[int, float]]]:
    rows = scaling["rows"]
    curves = {
        "decode step alone (ours)": [(r["batch"], r["decode_streams"]) for r in rows],
        "engine turn: step + vocoder (ours)": [(r["batch"], r["sustained_streams"]) for r in rows],
    }
    plain = {int(b): ms for b, ms in scaling.get("plain_graph_ms", {}).items()}
    if plain:
        curves["plain captured step alone (anchor's yardstick)"] = [
            (b, b * FRAME_MS / ms) for b, ms in sorted(plain.items())
        ]
    return curves


def end_to_end_points(paths: list[str]) -> list[tuple[int, bool, str]]:
    """(streams, carried: no underrun and p95 ≤ 150 ms, label) of the levels in the ttfa summary files: each argument is
    FILE or FILE:NAME,NAME (only those levels, e.g. `ttfa_warm2_300`: the servers that ran the defaults)."""
    out = []
    for arg in paths:
        path, _, only = arg.partition(":")
        wanted = {n if n.endswith(".json") else f"{n}.json" for n in only.split(",") if n}
        for name, level in json.loads(Path(path).read_text()).items():
            if wanted and name not in wanted:
                continue
            for s in level.get("summaries", []):
                if s["concurrency"] < 100:
                    continue
                ok = s["underrun_rate"] == 0 and s["ttfa_p95_ms"] <= P95_PASS_MS
                out.append(
                    (
                        s["concurrency"],
                        ok,
                        f"{path}:{name} p95 {s['ttfa_p95_ms']:.0f} ms, underran {s['underrun_rate']:.1%}",
                    )
                )
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("scaling_json")
    ap.add_argument("ttfa_summaries", nargs="*")
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args(argv)
    scaling = json.loads(Path(args.scaling_json).read_text())
    curves = sweep_curves(scaling)
    e2e = end_to_end_points(args.ttfa_summaries)
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    xs = [x for x, _ in next(iter(curves.values()))]
    ax.plot(xs, xs, "k:", label="needed: every stream at 1× real time")
    # while a stream's chunks grow, a turn must take at most 2/3 of a frame (streaming.chunking)
    ax.plot(xs, [1.5 * x for x in xs], ":", color="grey", label="needed while chunks grow: 1.5× real time")
    for (label, points), style in zip(curves.items(), ("o-", "s-", "^--"), strict=False):
        ax.plot(*zip(*points, strict=True), style, label=label)
    carried = [(c, c) for c, ok, _ in e2e if ok]
    missed = [(c, c) for c, ok, _ in e2e if not ok]
    if carried:
        ax.plot(
            *zip(*carried, strict=True),
            "D",
            color="tab:green",
            ms=8,
            label="served end to end: 0 underruns, p95 ≤ 150 ms",
        )
    if missed:
        ax.plot(
            *zip(*missed, strict=True),
            "D",
            color="tab:red",
            mfc="none",
            ms=8,
            label="served end to end: underruns or p95 > 150 ms",
        )
    ax.axhline(300, color="tab:red", lw=0.8, label="issue 3 pass: 300 streams")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("concurrent streams (batch)")
    ax.set_ylabel("real-time streams sustained")
    date = scaling.get("date", "2026-12")
    if scaling.get("vocoder_date") not in (None, date):
        date = f"{date}, vocoder {scaling['vocoder_date']}"
    ax.set_title(f"H200, full-size Fish 1.5 config, bf16 (sweep {date})")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    for label, points in curves.items():
        print(f"{label}:", [(x, round(y)) for x, y in points])
    for c, ok, label in e2e:
        print(f"end to end {c}: {'carried' if ok else 'missed'} ({label})")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

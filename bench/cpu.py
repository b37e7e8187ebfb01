"""The embedded default voice on a CPU, end to end, for this tree and, side by side, a baseline tree:

    python -m bench.cpu --out OUT_DIR [--baseline-tree PATH]

Per tree: `fishgate serve --device cpu` on the default model (no checkpoint), start -> ready, two warm-up requests,
then `fishgate ttfa` (its built-in English corpus, the client at its defaults) at each concurrency level, requests
one level after another: first audio, underruns and real-time factor. A table in OUT_DIR/summary.md, everything in
OUT_DIR/summary.json and each level's ttfa.json. A 2-core machine gives numbers that move 2-3x with other load on
it: compare trees within one call, on an otherwise idle machine. ~1-2 minutes a tree.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from bench.serving import (
    Server,
    ServerFailed,
    Tree,
    add_tree_arguments,
    number,
    run_level,
    side_by_side,
    trees_from,
)

SERVE_ARGS = ("--device", "cpu", "--max-sessions", "8", "--rate-limit-per-min", "1000000", "--log-level", "warning")
READY_LIMIT_S = 120.0
LEVEL_TIMEOUT_S = 600.0


def measure_tree(tree: Tree, index: int, out: Path, levels: list[int], requests: int) -> dict[str, Any]:
    tree_out = out / f"{index}-{tree.label.replace('+', '-')}"
    res: dict[str, Any] = {"label": tree.label, "path": str(tree.path), "levels": {}}
    try:
        with Server(tree.path, list(SERVE_ARGS), tree_out / "server.log") as server:
            res["ready_s"] = round(server.start(READY_LIMIT_S), 1)
            run_level(server.live_url, tree_out / "warm_up", concurrency=1, requests=2, args=[], timeout_s=120)
            for c in levels:
                res["levels"][c] = run_level(server.live_url, tree_out / f"level_{c}", concurrency=c,
                                             requests=requests, args=[], timeout_s=LEVEL_TIMEOUT_S)  # fmt: skip
    except (ServerFailed, OSError) as e:
        res["error"] = f"{type(e).__name__}: {e}"
    return res


def cells(res: dict[str, Any]) -> dict[str, str]:
    out = {"start → ready": number(res.get("ready_s"), "{:.1f} s")}
    for c, s in res["levels"].items():
        if not s:
            out[f"concurrency {c}"] = "no result"
            continue
        rate = s["underrun_rate"]
        out[f"concurrency {c}: first audio p50 / p95 ms"] = f"{number(s['ttfa_p50_ms'])} / {number(s['ttfa_p95_ms'])}"
        out[f"concurrency {c}: real-time factor p50"] = number(s["rtf_p50"], "{:.2f}")
        out[f"concurrency {c}: requests that underran"] = number(None if rate is None else 100 * rate, "{:.0f} %")
    if "error" in res:
        out["error"] = res["error"].splitlines()[0][:120]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="output folder")
    add_tree_arguments(ap)
    ap.add_argument("--concurrency", default="1,2", help="comma-separated levels [1,2]")
    ap.add_argument("--requests", type=int, default=10, help="requests a level [10]")
    args = ap.parse_args(argv)
    trees = trees_from(args, ap)
    levels = [int(c) for c in args.concurrency.split(",")]
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    results = []
    for i, tree in enumerate(trees, 1):
        results.append(measure_tree(tree, i, out, levels, args.requests))
        (out / "summary.json").write_text(json.dumps({"what": "bench.cpu", "trees": results}, indent=1) + "\n")
    text = side_by_side([r["label"] for r in results], [cells(r) for r in results])
    text += f"\n\n{time.monotonic() - t0:.0f} s in all; {out / 'summary.json'}"
    (out / "summary.md").write_text(text + "\n")
    print(text)
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    raise SystemExit(main())

"""One decode step's kernels in launch order, from a profiler Chrome trace (`step_variants --trace-dir`): each
kernel's time, the idle gap before it, its exposed time (the part not overlapped by the kernels before it, which
launched with PDL can start early and wait inside), its grid and block, so a slow kernel can be told apart from a starved one
(a GEMV on a handful of CTAs) and from the gaps between kernels. Prints the sequence and a by-name summary.
Usage: python -m bench.step_anatomy TRACE.json [--first N]
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from typing import Any


def kernels(trace_path: str) -> list[dict[str, Any]]:
    """The trace's GPU kernels and copies, in start order: name, start and duration (µs), grid and block."""
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    out = [
        {
            "name": e["name"],
            "ts": float(e["ts"]),
            "dur": float(e["dur"]),
            "grid": tuple(e.get("args", {}).get("grid", ())),
            "block": tuple(e.get("args", {}).get("block", ())),
            "regs": e.get("args", {}).get("registers per thread"),
        }
        for e in events
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
    ]
    return sorted(out, key=lambda k: k["ts"])


def ctas(grid: tuple[int, ...]) -> int:
    n = 1
    for g in grid:
        n *= int(g)
    return n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--first", type=int, default=120, help="print this many kernels of the sequence")
    args = ap.parse_args()
    ks = kernels(args.trace)
    if not ks:
        raise SystemExit("no kernels in the trace")
    span = ks[-1]["ts"] + ks[-1]["dur"] - ks[0]["ts"]
    exposed = exposed_times(ks)
    busy = sum(exposed)
    print(f"{len(ks)} kernels, span {span:.1f} us, busy {busy:.1f} us, idle {span - busy:.1f} us "
          f"(kernel durations add up to {sum(k['dur'] for k in ks):.1f} us)")  # fmt: skip
    print(f"{'#':>4s} {'gap':>6s} {'us':>6s} {'exposed':>7s} {'CTAs':>6s} {'block':>12s}  name")
    frontier = ks[0]["ts"]
    for i, (k, shown) in enumerate(zip(ks, exposed, strict=True)):
        gap = k["ts"] - frontier  # negative: it started before the kernels in front of it had ended (PDL)
        frontier = max(frontier, k["ts"] + k["dur"])
        if i < args.first:
            block = "x".join(str(b) for b in k["block"])
            print(
                f"{i:4d} {gap:6.1f} {k['dur']:6.1f} {shown:7.1f} {ctas(k['grid']):6d} {block:>12s}  {k['name'][:110]}"
            )
    by_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0, 0.0])
    frontier = ks[0]["ts"]
    for k, shown in zip(ks, exposed, strict=True):
        row = by_name[k["name"][:110]]
        row[0] += 1
        row[1] += k["dur"]
        row[2] += shown
        row[3] += max(0.0, k["ts"] - frontier)
        frontier = max(frontier, k["ts"] + k["dur"])
    print(f"\n{'count':>5s} {'us':>8s} {'exposed':>8s} {'us/call':>8s} {'gaps':>7s}  name")
    for name, (n, us, shown, gaps) in sorted(by_name.items(), key=lambda kv: -kv[1][2]):
        print(f"{int(n):5d} {us:8.1f} {shown:8.1f} {shown / n:8.2f} {gaps:7.1f}  {name}")


def exposed_times(ks: list[dict[str, Any]]) -> list[float]:
    """Each kernel's time on the step's critical path as the trace shows it: how far its end moves the latest end so
    far. Without overlap that is its duration; with programmatic dependent launch (model.launch_overlap) a kernel
    starts while the one before it runs and waits inside, so its duration counts that wait and only this part is its
    own. They add up to the time the GPU had a kernel running."""
    out = []
    frontier = ks[0]["ts"]
    for k in ks:
        end = k["ts"] + k["dur"]
        out.append(max(0.0, end - max(k["ts"], frontier)))
        frontier = max(frontier, end)
    return out


if __name__ == "__main__":
    main()

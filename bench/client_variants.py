"""One row per `fishgate ttfa` result file: how the clients connected and what they got (served, first audio,
underruns, real-time factor, connections), for comparing client behaviours against one server:

    python -m bench.client_variants /tmp/client-defaults/ttfa_300.json /tmp/client-defaults/ttfa_300_bare.json \
        --json "$OUT/client_variants.json"

A variant is named by its file (ttfa_300_bare.json: 300_bare). Numbers are the level summaries' (server.ttfa_report);
served = requests without an error (a refused, timed-out or dropped request is not served).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from server.ttfa_report import client_label


def variant_row(path: Path) -> dict[str, Any]:
    """The first level's summary of a ttfa.json, reduced to what the comparison prints."""
    level = json.loads(path.read_text(encoding="utf-8"))["levels"][0]
    s = level["summary"]
    return {
        "variant": path.stem.removeprefix("ttfa_"),
        "concurrency": level["concurrency"],
        "client": client_label(s),
        "requests": s["requests"],
        "served": s["ok"],
        "served_pct": 100.0 * s["ok"] / s["requests"] if s["requests"] else None,
        "ttfa_p50_ms": s["ttfa_p50_ms"],
        "ttfa_p95_ms": s["ttfa_p95_ms"],
        "underran_pct": None if s["underrun_rate"] is None else 100.0 * s["underrun_rate"],
        "underruns_per_request": s["underruns_per_request"],
        "rtf_p50": s["rtf_p50"],
        "connections": s["connections"],
        "reconnects": s["reconnects"],
        "errors": s["error_messages"][:3],
    }


def _cell(v: float | None, spec: str) -> str:
    return "-" if v is None else spec.format(v)


def format_rows(rows: list[dict[str, Any]]) -> str:
    head = "| variant | client | served | p50 ms | p95 ms | underran | underruns/req | RTF p50 | conns (re) |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        cells = [
            r["variant"], r["client"], f"{r['served']}/{r['requests']} ({_cell(r['served_pct'], '{:.0f}')} %)",
            _cell(r["ttfa_p50_ms"], "{:.0f}"), _cell(r["ttfa_p95_ms"], "{:.0f}"),
            _cell(r["underran_pct"], "{:.1f} %"), _cell(r["underruns_per_request"], "{:.2f}"),
            _cell(r["rtf_p50"], "{:.2f}"), f"{r['connections']} ({r['reconnects']})",
        ]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path, nargs="+", help="fishgate ttfa JSON files (missing ones are named)")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = parser.parse_args(argv)
    rows = []
    for path in args.results:
        if path.is_file():
            rows.append(variant_row(path))
        else:
            print(f"{path}: missing (the level did not run or was cut off)")
    print(format_rows(rows))
    for r in rows:
        for message in r["errors"]:
            print(f"  {r['variant']}: {message[:200]}")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()

"""`fishgate ttfa` results: per-level summaries, the printed table, the JSON document and the PNG plots.

Pure functions of `ttfa.RequestResult` lists; matplotlib is imported only when plots are drawn (Agg canvas, no
pyplot state). Percentiles interpolate linearly between order statistics (numpy's default). Errored requests are
counted, and left out of every latency statistic. Knows nothing about sockets.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .ttfa import ProbeConfig, RequestResult

JSON_NAME = "ttfa.json"
CDF_PNG = "ttfa_cdf.png"
TIMELINE_PNG = "underrun_timeline.png"
PERCENTILES = (50, 95, 99)
PLOT_DPI = 110


def _pct(values: Sequence[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def summarize(concurrency: int, results: Sequence[RequestResult]) -> dict[str, Any]:
    ok = [r for r in results if r.ok and r.ttfa_ms is not None]
    ttfa = [r.ttfa_ms for r in ok if r.ttfa_ms is not None]
    stalls = [gap for r in ok for _, gap in r.underrun_events]
    server = [r.server_first_audio_ms for r in ok if r.server_first_audio_ms is not None]
    gaps = [g for r in ok for g in r.chunk_gaps_ms]
    rtf = [r.rtf for r in ok if r.rtf is not None]
    return {
        "concurrency": concurrency,
        "requests": len(results),
        "ok": len(ok),
        "errors": len(results) - len(ok),
        **{f"ttfa_p{q}_ms": _pct(ttfa, q) for q in PERCENTILES},
        "ttfa_max_ms": max(ttfa) if ttfa else None,
        "ttfa_mean_ms": float(np.mean(ttfa)) if ttfa else None,
        "requests_with_underrun": sum(1 for r in ok if r.underruns),
        "underrun_rate": sum(1 for r in ok if r.underruns) / len(ok) if ok else None,
        "underruns_per_request": sum(r.underruns for r in ok) / len(ok) if ok else None,
        "underrun_mean_gap_ms": float(np.mean(stalls)) if stalls else 0.0 if ok else None,
        "underrun_total_ms": sum(stalls),
        "chunk_gap_p50_ms": _pct(gaps, 50),
        "chunk_gap_max_ms": max(gaps) if gaps else None,
        "rtf_p50": _pct(rtf, 50),
        "audio_s_total": sum(r.audio_s for r in ok),
        "audio_s_mean": float(np.mean([r.audio_s for r in ok])) if ok else None,
        "server_first_audio_p50_ms": _pct(server, 50),
        "error_messages": sorted({r.error for r in results if r.error}),
        **client_behaviour(results),
    }


def client_behaviour(results: Sequence[RequestResult]) -> dict[str, Any]:
    """How the client connected: its settings (`compression` offered, `sockets` mode), the extensions its
    connections negotiated, connections opened and, of those, reconnects (a pooled socket found closed)."""
    return {
        "compression": "/".join(sorted({r.compression for r in results})) or None,
        "sockets": "/".join(sorted({r.sockets for r in results})) or None,
        "extensions": sorted({ext for r in results for ext in r.extensions}),
        "connections": sum(1 for r in results if r.fresh_connection),
        "reconnects": sum(1 for r in results if r.reconnect),
    }


def client_label(summary: Mapping[str, Any]) -> str:
    """E.g. "deflate, reuse"; "deflate refused" when it was offered and no connection negotiated it."""
    compression = summary.get("compression") or "-"
    if compression == "deflate" and "permessage-deflate" not in summary.get("extensions", []):
        compression = "deflate refused"
    return f"{compression}, {summary.get('sockets') or '-'}"


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}"


def _num(v: float | None, spec: str) -> str:
    return "-" if v is None else spec.format(v)


def format_table(summaries: Sequence[Mapping[str, Any]]) -> str:
    """The per-level table the CLI prints (Markdown, so it pastes into docs)."""
    head = (
        "| conc | n | err | TTFA p50 ms | p95 | p99 | max | underrun | underruns/req | mean stall ms "
        "| RTF p50 | audio s/req | server p50 ms | client | conns (re) |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for s in summaries:
        cells = [
            str(s["concurrency"]), str(s["requests"]), str(s["errors"]),
            *(_ms(s[k]) for k in ("ttfa_p50_ms", "ttfa_p95_ms", "ttfa_p99_ms", "ttfa_max_ms")),
            _num(s["underrun_rate"], "{:.0%}"), _num(s["underruns_per_request"], "{:.2f}"),
            _ms(s["underrun_mean_gap_ms"]), _num(s["rtf_p50"], "{:.2f}"), _num(s["audio_s_mean"], "{:.1f}"),
            _ms(s["server_first_audio_p50_ms"]), client_label(s), f"{s['connections']} ({s['reconnects']})",
        ]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def build_document(config: ProbeConfig, results: Mapping[int, Sequence[RequestResult]]) -> dict[str, Any]:
    """Everything measured, raw per request, plus the per-level summaries (the API key is never written)."""
    cfg = dataclasses.asdict(config)
    cfg["api_key"] = "set" if config.api_key else None
    return {
        "tool": "fishgate ttfa",
        "written_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "config": cfg,
        "definitions": {
            "ttfa_ms": "first text frame sent → first byte of samples received (a WAV header is not audio)",
            "playout": "a real-time player starts at the first audio byte; an underrun is its buffer running dry "
            "before the next chunk arrives; playback resumes on arrival",
            "rtf": "first text frame → last audio byte, divided by the audio's duration",
            "client": "compression: deflate = permessage-deflate offered (what negotiated: extensions), off = none; "
            "sockets: reuse = each worker's requests on one socket (a new start after finish), per-request = one "
            "connection each; connections: requests that opened one (connect_ms is not part of ttfa_ms); "
            "reconnects: those whose worker's socket had been closed",
        },
        "levels": [
            {"concurrency": c, "summary": summarize(c, rs), "requests": [dataclasses.asdict(r) for r in rs]}
            for c, rs in results.items()
        ],
    }


def write_json(path: Path, document: Mapping[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=1) + "\n", encoding="utf-8")
    return path


def plot_ttfa_cdf(path: Path, results: Mapping[int, Sequence[RequestResult]]) -> Path:
    """Empirical CDF of TTFA, one step line per concurrency level."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.2), layout="constrained")
    ax = fig.add_subplot()
    for c, rs in results.items():
        ttfa = sorted(r.ttfa_ms for r in rs if r.ok and r.ttfa_ms is not None)
        if ttfa:
            y = np.arange(1, len(ttfa) + 1) / len(ttfa)
            ax.step([0.0, *ttfa], [0.0, *y], where="post", label=f"concurrency {c} (n={len(ttfa)})")
    ax.set_xlabel("time to first audio (ms)")
    ax.set_ylabel("share of requests")
    ax.set_ylim(0, 1.02)
    ax.set_xlim(left=0)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize="small")
    ax.set_title("TTFA CDF (first text frame → first audio byte)")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=PLOT_DPI)
    return path


def plot_underrun_timeline(path: Path, results: Mapping[int, Sequence[RequestResult]]) -> Path:
    """One panel per level, one row per request: waiting for first audio (grey), playing (green), dry (red)."""
    from matplotlib.figure import Figure

    levels = list(results)
    rows = max(1, len(levels))
    height = sum(max(1.2, 0.18 * len(results[c]) + 0.8) for c in levels) if levels else 2.0
    fig = Figure(figsize=(8, min(height, 40.0)), layout="constrained")
    axes = fig.subplots(rows, 1, squeeze=False)[:, 0]
    for ax, c in zip(axes, levels, strict=False):
        rs = results[c]
        for y, r in enumerate(rs):
            if r.ttfa_ms is None or r.playout_end_s is None:
                ax.plot([0], [y], marker="x", color="black")
                continue
            first_s = r.ttfa_ms / 1000.0
            ax.broken_barh([(0.0, first_s)], (y - 0.35, 0.7), color="0.8")
            ax.broken_barh([(first_s, r.playout_end_s - first_s)], (y - 0.35, 0.7), color="tab:green")
            dry = [(at_s, gap_ms / 1000.0) for at_s, gap_ms in r.underrun_events]
            if dry:  # bars show each stall's length; a tick marks its start, so a 5 ms stall is still visible
                ax.broken_barh(dry, (y - 0.35, 0.7), color="tab:red")
                ax.plot([at_s for at_s, _ in dry], [y] * len(dry), "|", color="tab:red", markersize=9)
        ax.set_ylim(-0.8, max(len(rs), 1) - 0.2)
        ax.set_yticks(range(len(rs)), [str(r.index) for r in rs], fontsize="x-small")
        ax.set_ylabel(f"concurrency {c}\nrequest")
        ax.set_xlim(left=0)
        ax.grid(axis="x", alpha=0.3)
    axes[-1].set_xlabel("seconds since the request's first text frame (grey: waiting, green: playing, red: dry)")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=PLOT_DPI)
    return path


def write_outputs(
    out_dir: Path, config: ProbeConfig, results: Mapping[int, Sequence[RequestResult]], *, plots: bool = True
) -> list[Path]:
    """ttfa.json, and unless `plots` is False the two PNGs; returns the paths written."""
    written = [write_json(out_dir / JSON_NAME, build_document(config, results))]
    if plots:
        written.append(plot_ttfa_cdf(out_dir / CDF_PNG, results))
        written.append(plot_underrun_timeline(out_dir / TIMELINE_PNG, results))
    return written

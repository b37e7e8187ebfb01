"""bench.cpu's table from results as it writes them (its server and clients are bench.serving's, which
tests/test_bench_gpu.py runs end to end)."""

from __future__ import annotations

from bench.cpu import cells
from bench.serving import side_by_side


def test_levels_side_by_side() -> None:
    level = {"ttfa_p50_ms": 91.2, "ttfa_p95_ms": 108.0, "rtf_p50": 0.404, "underrun_rate": 0.0}
    new = {"label": "52b0aaf", "ready_s": 4.1, "levels": {1: level, 2: {**level, "ttfa_p50_ms": 112.0}}}
    old = {"label": "old", "levels": {1: None}, "error": "ServerFailed: not ready after 120 s:\n..."}
    lines = side_by_side(["52b0aaf", "old"], [cells(new), cells(old)]).splitlines()
    assert lines[:3] == ["| figure | 52b0aaf | old |", "|---|---|---|", "| start → ready | 4.1 s | - |"]
    assert "| concurrency 1: first audio p50 / p95 ms | 91 / 108 | - |" in lines
    assert "| concurrency 2: first audio p50 / p95 ms | 112 / 108 | - |" in lines
    assert "| concurrency 1: real-time factor p50 | 0.40 | - |" in lines
    assert (
        "| concurrency 1 | - | no result |" in lines
        and lines[-1] == "| error | - | ServerFailed: not ready after 120 s: |"
    )

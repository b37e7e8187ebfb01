"""bench/step_anatomy.py reads a profiler Chrome trace: the GPU kernels and copies of one step in start order (CPU
events left out), with durations, grids and the idle gap before each, and a by-name summary."""

from __future__ import annotations

import json
import subprocess
import sys

from bench.step_anatomy import ctas, exposed_times, kernels

TRACE = {
    "traceEvents": [
        {"ph": "X", "cat": "kernel", "name": "triton_w2", "ts": 20.0, "dur": 5.0, "args": {"grid": [256, 1, 1], "block": [512, 1, 1]}},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 1.0, "dur": 50.0, "args": {}},
        {"ph": "X", "cat": "kernel", "name": "_length_attention_merge", "ts": 10.0, "dur": 3.0, "args": {"grid": [1, 2, 8], "block": [128, 1, 1]}},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoD", "ts": 14.0, "dur": 1.0, "args": {}},
        {"ph": "X", "cat": "kernel", "name": "triton_w2", "ts": 26.0, "dur": 4.0, "args": {"grid": [256, 1, 1], "block": [512, 1, 1]}},
        {"ph": "i", "cat": "kernel", "name": "an instant, not a span", "ts": 11.0},
    ]
}  # fmt: skip


def test_kernels_in_start_order_with_grids(tmp_path) -> None:
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(TRACE))
    ks = kernels(str(path))
    assert [k["name"] for k in ks] == ["_length_attention_merge", "Memcpy DtoD", "triton_w2", "triton_w2"]
    assert [ctas(k["grid"]) for k in ks] == [16, 1, 256, 256]
    assert ks[0]["dur"] == 3.0 and ks[2]["ts"] == 20.0


def test_the_printout_has_span_busy_idle_and_the_summary(tmp_path) -> None:
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(TRACE))
    out = subprocess.run(
        [sys.executable, "-m", "bench.step_anatomy", str(path)], capture_output=True, text=True, check=True
    ).stdout
    # span 10 → 30 µs, busy 3 + 1 + 5 + 4 = 13, idle 7 (gaps 1, 5, 1)
    assert (
        out.splitlines()[0] == "4 kernels, span 20.0 us, busy 13.0 us, idle 7.0 us (kernel durations add up to 13.0 us)"
    )
    summary = out.split("name\n")[-1].splitlines()
    # 2 calls, 9 µs, all of it exposed (no overlap): 4.5 a call, gaps 5 + 1
    assert summary[0].split()[:6] == ["2", "9.0", "9.0", "4.50", "6.0", "triton_w2"]


def test_overlapping_kernels_count_only_their_exposed_part() -> None:
    """Kernels launched with programmatic dependent launch start before the one in front has ended and wait inside:
    each counts only how far it moves the latest end, so the parts add up to the time a kernel ran (not 2 × it)."""
    ks = [
        {"ts": 0.0, "dur": 5.0},  # alone: all of it
        {"ts": 2.0, "dur": 6.0},  # started inside the first: 5 → 8, 3 of its own
        {"ts": 3.0, "dur": 2.0},  # wholly inside the ones before: nothing of its own
        {"ts": 10.0, "dur": 1.0},  # after a 2 µs gap: all of it
    ]
    assert exposed_times(ks) == [5.0, 3.0, 0.0, 1.0]

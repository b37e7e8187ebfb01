"""bench/plot_scaling.py: the sweep's curves and the end-to-end points it draws, and the figure it writes."""

from __future__ import annotations

import json

import pytest

from bench.plot_scaling import FRAME_MS, end_to_end_points, main, sweep_curves

SCALING = {
    "date": "2026-12-03",
    "vocoder_date": "2026-12-04",
    "rows": [
        {"batch": 8, "decode_streams": 108.0, "sustained_streams": 87.0},
        {"batch": 256, "decode_streams": 1768.0, "sustained_streams": 816.0},
    ],
    "plain_graph_ms": {"8": 7.34, "256": 16.06},
}


def level(concurrency: int, p95: float, underrun: float) -> dict:
    return {"concurrency": concurrency, "ttfa_p95_ms": p95, "underrun_rate": underrun}


def test_the_curves_come_from_one_sweep() -> None:
    curves = sweep_curves(SCALING)
    assert curves["decode step alone (ours)"] == [(8, 108.0), (256, 1768.0)]
    assert curves["engine turn: step + vocoder (ours)"] == [(8, 87.0), (256, 816.0)]
    plain = curves["plain captured step alone (anchor's yardstick)"]
    assert plain == [(8, pytest.approx(8 * FRAME_MS / 7.34)), (256, pytest.approx(256 * FRAME_MS / 16.06))]


def test_a_level_is_carried_only_without_underruns_and_within_150_ms(tmp_path) -> None:
    summaries = {
        "ttfa_warm_300.json": {"summaries": [level(300, 127.0, 0.0)]},  # another server's flag: not named below
        "ttfa_warm2_300.json": {"summaries": [level(300, 131.0, 0.0)]},
        "ttfa_warm2_384.json": {"summaries": [level(384, 184.0, 0.014)]},
        "ttfa_warm2_1.json": {"summaries": [level(1, 35.0, 0.0)]},  # a warm-up level: under 100 streams, left out
    }
    path = tmp_path / "ttfa_summaries.json"
    path.write_text(json.dumps(summaries))
    points = end_to_end_points([f"{path}:ttfa_warm2_300,ttfa_warm2_384,ttfa_warm2_1"])
    assert [(n, ok) for n, ok, _ in points] == [(300, True), (384, False)]
    assert [(n, ok) for n, ok, _ in end_to_end_points([str(path)])] == [(300, True), (300, True), (384, False)]
    summaries["ttfa_warm2_300.json"]["summaries"] = [level(300, 151.0, 0.0)]  # p95 just over
    path.write_text(json.dumps(summaries))
    assert end_to_end_points([f"{path}:ttfa_warm2_300"])[0][1] is False


def test_the_figure_is_written(tmp_path, capsys) -> None:
    sweep = tmp_path / "scaling.json"
    sweep.write_text(json.dumps(SCALING))
    out = tmp_path / "scaling.png"
    main([str(sweep), "--out", str(out)])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "engine turn" in capsys.readouterr().out

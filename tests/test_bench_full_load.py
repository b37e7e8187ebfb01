"""bench.full_load: a level's turns and first audio inside its full-load window, apart from the ramp."""

from __future__ import annotations

import json

import pytest

from bench.full_load import first_audio_in, main, turns_in


def test_turns_are_weighted_by_count_inside_the_window() -> None:
    rows = [
        {"t": 7.5, "turns": 50, "turn_ms": 10.0},  # the ramp: outside
        {"t": 8.0, "turns": 10, "turn_ms": 40.0},
        {"t": 8.5, "turns": 30, "turn_ms": 20.0},
        {"t": 9.0, "turns": 0, "turn_ms": 0.0},  # an interval without turns says nothing
        {"t": 17.0, "turns": 5, "turn_ms": 90.0},  # the end is outside
    ]
    got = turns_in(rows, 8.0, 17.0)
    assert got["intervals"] == 2 and got["turns"] == 40 and got["worst_ms"] == 40.0
    assert got["turn_ms"] == pytest.approx((10 * 40 + 30 * 20) / 40)


def test_first_audio_counts_only_requests_started_in_the_window() -> None:
    requests = [{"started_s": 8.0 + 0.1 * i, "ttfa_ms": 100.0 + i, "underruns": int(i == 2)} for i in range(10)]
    requests += [{"started_s": 1.0, "ttfa_ms": 5.0}, {"started_s": 9.0, "ttfa_ms": None}]
    got = first_audio_in(requests, 8.0, 17.0)
    assert (got["requests"], got["p50_ms"], got["underran"]) == (10, 104.5, 1)
    assert first_audio_in(requests, 20.0, 30.0)["requests"] == 0


def test_the_command_reads_a_series_and_a_ttfa_file(tmp_path, capsys) -> None:
    series = tmp_path / "series_384.jsonl"
    series.write_text("\n".join(json.dumps({"t": t, "turns": 10, "turn_ms": 35.0}) for t in (8.5, 9.0)) + "\n")
    ttfa = tmp_path / "ttfa_384.json"
    level = {"concurrency": 384, "summary": {}, "requests": [{"started_s": 9.0, "ttfa_ms": 300.0, "underruns": 1}]}
    ttfa.write_text(json.dumps({"levels": [level]}))
    main([str(series), str(ttfa)])
    out = capsys.readouterr().out
    assert "35.0 ms a turn" in out and "under 31.0 ms" in out and "384 streams" in out and "1 underran" in out

"""bench.scaling: a decode sweep and a vocoder sweep combined into the turn at each batch."""

from __future__ import annotations

import json

import pytest

from bench.scaling import FRAME_MS, combine, largest_batch_within, main, vocoder_ms_per_turn


def test_a_turn_carries_a_24th_of_its_rows_in_calls_of_the_smallest_bucket_that_holds_them() -> None:
    calls = {1: 1.2, 8: 2.0, 64: 5.0}
    assert vocoder_ms_per_turn(1, calls) == (pytest.approx(1.2 / 24), "1")
    # 2 rows a turn: one call of the 8-row bucket, padded
    assert vocoder_ms_per_turn(48, calls) == (pytest.approx(2 / 2 * 2.0), "8")
    assert vocoder_ms_per_turn(300, calls) == (pytest.approx(12.5 / 13 * 5.0), "64")
    # beyond the engine's 64-row batch: several 64-row calls
    assert vocoder_ms_per_turn(3072, calls) == (pytest.approx(128 / 64 * 5.0), "64")


def test_a_pathological_bucket_is_planned_round_as_the_engine_does() -> None:
    # run 31: 32 × 24 frames took 107 ms (cuDNN's bad conv shape); the engine runs a 32-row call as the cheapest
    # other plan (model.graph_timing.cheapest_plan): two replays of the 16-row graph
    calls = {16: 7.6, 32: 107.3, 64: 29.7}
    ms, plan = vocoder_ms_per_turn(768, calls)
    assert plan == "32→2×16"
    assert ms == pytest.approx(32 / 32 * 2 * 7.6)
    assert vocoder_ms_per_turn(768, {16: 20.0, 32: 107.3, 64: 29.7}) == (pytest.approx(29.7), "32→1×64")
    # a healthy bucket keeps its own graph
    assert vocoder_ms_per_turn(384, calls) == (pytest.approx(16 / 16 * 7.6), "16")


def test_sustained_streams_and_the_schedule_line() -> None:
    step = {8: {"graph_ms": 3.0, "step_call_ms": 3.5}, 256: {"graph_ms": 7.0, "step_call_ms": 7.5}}
    rows = combine(step, {1: 1.0, 16: 4.0})
    assert rows[0]["turn_ms"] == pytest.approx(3.5 + 8 / 24 * 1.0)
    assert rows[1]["turn_ms"] == pytest.approx(7.5 + 256 / 24 / 11 * 4.0)  # 11 rows a call, in the 16-row bucket
    assert rows[1]["sustained_streams"] == pytest.approx(256 * FRAME_MS / rows[1]["turn_ms"])
    assert rows[1]["decode_streams"] == pytest.approx(256 * FRAME_MS / 7.0)
    assert all(r["within_schedule_line"] for r in rows)


def test_the_largest_batch_within_a_turn_is_interpolated() -> None:
    rows = [{"batch": 256, "turn_ms": 20.0}, {"batch": 512, "turn_ms": 40.0}]
    assert largest_batch_within(rows, 30.0) == pytest.approx(384)
    assert largest_batch_within(rows, 10.0) is None
    assert largest_batch_within(rows, 50.0) == 512


def test_the_command_reads_both_sweeps(tmp_path, capsys) -> None:
    step = {
        "variants": [
            {"variant": "eager", "batches": [{"batch": 64, "graph_ms": 8.0, "step_call_ms": 8.4}]},
            {"variant": "compiled_length_4096", "batches": [{"batch": 64, "graph_ms": 5.0, "step_call_ms": 5.3}]},
        ]
    }
    vocoder = {"rows": [{"batch": 8, "frames": 24, "ms": 3.0}, {"batch": 8, "frames": 8, "ms": 1.0}]}
    (tmp_path / "step.json").write_text(json.dumps(step))
    (tmp_path / "vocoder.json").write_text(json.dumps(vocoder))
    out = tmp_path / "scaling.json"
    main([str(tmp_path / "step.json"), str(tmp_path / "vocoder.json"), "--out", str(out)])
    printed = capsys.readouterr().out
    assert "| 64 | 5.00 | 8.00 |" in printed
    saved = json.loads(out.read_text())
    assert saved["rows"][0]["turn_ms"] == pytest.approx(5.3 + 64 / 24 / 3 * 3.0)  # 3 rows a call, in the 8-row bucket
    with pytest.raises(KeyError, match="no variant"):
        main([str(tmp_path / "step.json"), str(tmp_path / "vocoder.json"), "--step-variant", "missing"])

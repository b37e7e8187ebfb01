"""bench/prefill_passes.py runs end to end on the tiny config (CPU, eager; CI never times) and leaves the engine's
default prefill buckets as they were."""

from __future__ import annotations

import json

import model.prefill_graphs as prefill_graphs
from bench.prefill_passes import main


def test_the_prefill_pass_bench_measures_every_bucket_and_restores_the_engines(tmp_path, capsys) -> None:
    engine_rows = prefill_graphs.PREFILL_ROW_BUCKETS
    out = tmp_path / "passes.json"
    assert main(["--tiny", "--rows", "1,8", "--out", str(out)]) == 0
    got = json.loads(out.read_text())["rows"]
    buckets = [(r["rows"], r["chunk"], r["length"]) for r in got]
    assert buckets == [(1, 64, 128), (8, 64, 128), (1, 64, 256), (8, 64, 256)]
    assert all(r["pass_ms"] > 0 and r["ms_per_prompt"] == r["pass_ms"] / r["rows"] for r in got)
    assert prefill_graphs.PREFILL_ROW_BUCKETS == engine_rows == (1, 2, 4)
    assert "ms a prompt" in capsys.readouterr().out

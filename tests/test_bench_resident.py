"""bench.resident end to end on the CPU's default model: every phase runs through the real commands (cold start,
gateway restart, engine restarts) and lands in resident.json with its table (the figures themselves are the script's
to report, never asserted)."""

from __future__ import annotations

import json
from pathlib import Path

from bench.resident import main


def test_every_phase_runs_and_is_written(tmp_path: Path, capsys) -> None:
    assert main(["--out", str(tmp_path), "--frames", "20", "--engine-args", "--max-sessions 16"]) == 0
    result = json.loads((tmp_path / "resident.json").read_text())
    for key in ("cold_ready_s", "gateway_ready_s", "gateway_first_tts_s", "engine_restart_ready_s",
                "engine_restart_compile_after_ready_ready_s"):  # fmt: skip
        assert result[key] > 0, key
    for level in ("steady", "after_gateway_restart", "after_engine_restart", "after_engine_restart_burst"):
        assert result[level]["ok"] == result[level]["requests"] > 0, level
    assert result["gateway_exit"] == 0 and result["engine_exit"] == 0  # both drained on SIGTERM
    assert "engine_restart_again_ready_s" not in result  # a GPU-only variant
    for launch in ("engine", "engine_restart", "engine_restart_compile_after_ready"):  # each start-up line, parsed
        startup = result[f"{launch}_startup"]
        assert startup["total"] > 0 and startup["decode_graphs"] == 0, launch  # no CUDA graphs on the CPU
        assert startup["fx_graphs_compiled"] == startup["tuning_benchmarks"] == 0, launch  # the CPU compiles nothing
        assert result[f"{launch}_tuned_configs"] == {"coordesc": 0, "other": 0}, launch
    assert result["table"] in capsys.readouterr().out
    for log in ("engine.log", "engine_restart.log", "engine_restart_compile_after_ready.log"):  # every launch
        assert "--max-sessions 16" in (tmp_path / log).read_text().splitlines()[0], log

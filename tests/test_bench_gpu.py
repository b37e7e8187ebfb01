"""bench.gpu end to end on CPU with a tiny model (`--tiny`): the checkpoint, the step of each tree, each tree's real
`fishgate serve` under real `fishgate ttfa` clients, and the side-by-side table; this checks the script, not a
figure. Plus the table's cells from a result as a GPU run writes it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.gpu import THROUGHPUT_SERVE_ARGS, main, table
from bench.serving import keep_known, server_flags

ROOT = Path(__file__).resolve().parents[1]


def test_two_trees_are_measured_one_after_the_other_and_shown_side_by_side(tmp_path, capsys) -> None:
    out = tmp_path / "out"
    args = ["--out", str(out), "--tiny", "--skip-check", "--streams", "2", "--waves", "1", "--ramp-s", "0.2",
            "--frames", "4", "--baseline-tree", str(ROOT), "--baseline-label", "baseline"]  # fmt: skip
    assert main(args) == 0
    summary = json.loads((out / "summary.json").read_text())
    trees = summary["trees"]
    assert [t["label"] for t in trees][1] == "baseline" and trees[1]["path"] == str(ROOT)
    for t in trees:
        assert t["step"]["batches"][0]["step_call_ms"] > 0 and t["step"]["tree"] == str(ROOT)
        assert t["start"]["ready_s"] > 0 and "restart" not in t  # with a baseline: no restart row
        assert t["flags_dropped"] == []
        assert t["first_audio"]["ok"] == 2 and t["streams"]["2"]["summary"]["ok"] == 2
        assert (
            t["streams"]["2"]["turns"]["turns"] > 0
            and t["streams"]["2"]["cpu"]["cpu_s"] > 0
            and Path(t["out"], "streams-2", "ttfa.json").is_file()
        )
    assert trees[0]["start"]["compile_cache"] == "empty"
    printed = capsys.readouterr().out
    header = next(line for line in printed.splitlines() if line.startswith("| figure |"))
    assert header == f"| figure | {trees[0]['label']} | baseline |"
    assert "| 2 streams: served | 2 / 2 | 2 / 2 |" in printed
    assert (out / "summary.md").read_text().startswith(header)


def test_a_baseline_that_is_no_source_tree_is_named(tmp_path, capsys) -> None:
    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path), "--baseline-tree", str(tmp_path)])
    assert "holds no server/cli.py" in capsys.readouterr().err


def test_settings_a_tree_lacks_are_left_out_and_named() -> None:
    args = ("--max-sessions", "512", "--vocoder-channels-last", "on", "--bare-flag", "--x", "1")
    kept, dropped = keep_known(args, {"--max-sessions", "--x"})
    assert kept == ["--max-sessions", "512", "--x", "1"] and dropped == ["--vocoder-channels-last", "--bare-flag"]
    # this tree's server takes the throughput settings, save what it made the default
    assert {"--max-sessions", "--compile-max-batch", "--admission-turn-fraction"} <= server_flags(ROOT)
    assert set(keep_known(THROUGHPUT_SERVE_ARGS, server_flags(ROOT))[1]) <= {"--vocoder-channels-last"}


def test_the_table_of_a_gpu_run() -> None:
    summary = {"ok": 600, "requests": 600, "ttfa_p50_ms": 109.4, "ttfa_p95_ms": 142.2, "underrun_rate": 0.0,
               "server_first_audio_p50_ms": 14.8}  # fmt: skip
    turns = {"turn_ms": 16.6, "prefill_ms": 4.1, "step_ms": 4.4, "vocode_ms": 6.3, "rest_ms": 1.8}
    cpu = {"cores_per_stream": 0.00412, "busiest_process_cores": 0.97, "processes": 1}
    gpu = {
        "label": "932177b", "step": {"batches": [{"batch": 1, "graph_ms": 1.446, "step_call_ms": 1.515}]},
        "start": {"ready_s": 145.2, "compile_cache": "empty"}, "first_audio": {**summary, "ttfa_p50_ms": 17.2},
        "streams": {300: {"summary": summary, "turns": turns, "cpu": cpu}}, "gpu_memory_bytes": 28.96e9, "restart": {"ready_s": 35.4},
    }  # fmt: skip
    failed = {"label": "old", "step": {"error": "ImportError: x"}, "flags_dropped": ["--vocoder-channels-last"],
              "error": "ServerFailed: the server exited (1):\nlog"}  # fmt: skip
    lines = table([gpu, failed]).splitlines()
    assert lines[0] == "| figure | 932177b | old |"
    assert "| decode step, batch 1: graph replay / `step()` ms | 1.446 / 1.515 | failed: ImportError: x |" in lines
    assert "| settings this server lacks (left out) | - | --vocoder-channels-last |" in lines
    assert "| start → ready (compile cache) | 145 s (empty) | - |" in lines
    assert "| first audio, 1 stream: p50 / p95 ms (server side p50) | 17 / 142 (15) | - |" in lines
    assert "| 300 streams: first audio p50 / p95 ms | 109 / 142 | - |" in lines
    assert "| 300 streams: ms a turn = prefill + step + vocode + rest | 16.6 = 4.1 + 4.4 + 6.3 + 1.8 | - |" in lines
    assert "| 300 streams: server CPU per stream / busiest process (cores) | 0.0041 / 0.97 (1 processes) | - |" in lines
    assert (
        "| GPU memory allocated | 28.96 GB | - |" in lines
        and "| restart → ready (warm compile cache) | 35 s | - |" in lines
    )
    assert lines[-1] == "| error | - | ServerFailed: the server exited (1): |"

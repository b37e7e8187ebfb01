"""bench/step.py on CPU with a tiny checkpoint: it loads the model through the tree's loader, times the eager step
(no graphs on CPU) and writes its JSON; a failure is written down, not raised."""

from __future__ import annotations

import json

from bench import make_checkpoint, step
from streaming.config import BackendConfig


def test_the_step_is_timed_from_a_checkpoint(tmp_path) -> None:
    make_checkpoint.main([str(tmp_path / "ckpt"), str(tmp_path / "voices"), "--tiny"])
    out = tmp_path / "step.json"
    assert step.main(["--checkpoint", str(tmp_path / "ckpt"), "--out", str(out), "--device", "cpu"]) == 0
    result = json.loads(out.read_text())
    assert result["graphs"] is False and [r["batch"] for r in result["batches"]] == [1]
    assert result["batches"][0]["step_call_ms"] > 0 and "graph_ms" not in result["batches"][0]
    assert result["tuned_single_row"] is False  # what the stepper compiled: tuning is for CUDA only
    assert result["symbolic_batch_above"] == 1  # the engine's rule for one-row batches unless told otherwise
    assert step.ENGINE_TUNES_SINGLE_ROW is BackendConfig().tune_single_row  # --tune-single-row follows the engine


def test_a_failure_is_in_the_json(tmp_path) -> None:
    out = tmp_path / "step.json"
    assert step.main(["--checkpoint", str(tmp_path / "missing"), "--out", str(out), "--device", "cpu"]) == 1
    result = json.loads(out.read_text())
    assert result["error"].startswith("CheckpointError") and "batches" not in result

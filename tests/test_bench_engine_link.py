"""bench.engine_link end to end with one utterance a side: it runs, matches the audio of both sides, writes its JSON
(the figures themselves are the script's to report, never asserted)."""

from __future__ import annotations

import json
from pathlib import Path

from bench.engine_link import main


def test_one_utterance_a_side(tmp_path: Path, capsys) -> None:
    assert main(["--out", str(tmp_path), "--utterances", "1", "--device", "cpu"]) == 0
    result = json.loads((tmp_path / "engine_link.json").read_text())
    assert result["device"] == "cpu" and result["chunk_added_ms"]["n"] > 0
    assert result["first_audio_ms"]["in_process"]["n"] == result["first_audio_ms"]["engine_process"]["n"] == 1
    assert "| same audio (seeded) |  | yes |  |" in capsys.readouterr().out

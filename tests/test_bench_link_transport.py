"""bench.link_transport with --quick: every transport runs between its two processes and lands in the JSON (the
figures themselves are the script's to report, never asserted). Without pyzmq the ZeroMQ variant is skipped with a
note, and the others still run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import bench.link_transport as lt

WORKLOADS = {"single_64k", "single_192k", "load_300"}


def test_quick_run_writes_every_variant(tmp_path: Path, capsys) -> None:
    assert lt.main(["--out", str(tmp_path), "--quick"]) == 0
    result = json.loads((tmp_path / "link_transport.json").read_text())
    assert set(result["variants"]) == set(lt.VARIANTS)
    measured = {v for v, status in result["variants"].items() if "skipped" not in status}
    if not lt.zmq_available():
        assert "pyzmq is not installed" in result["variants"]["zmq"]["skipped"]
    assert measured == set(lt.VARIANTS) - ({"zmq"} if not lt.zmq_available() else set())
    assert set(result["summary"]) == WORKLOADS
    for workload in WORKLOADS:
        assert set(result["summary"][workload]) == measured
    for variant in measured:
        phases = result["runs"][0][variant]["phases"]
        assert set(phases) == WORKLOADS
        for phase in phases.values():
            assert phase["chunks"] == phase["chunks_sent"] > 0 and phase["latency_ms"]["n"] > 0
    out = capsys.readouterr().out
    assert "| load_300 | socket |" in out and "| load_300 | shm |" in out


def test_zmq_is_skipped_with_a_note_without_pyzmq(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.setattr(lt, "zmq_available", lambda: False)
    assert lt.main(["--out", str(tmp_path), "--quick", "--variants", "zmq"]) == 0
    result = json.loads((tmp_path / "link_transport.json").read_text())
    assert result["variants"] == {"zmq": {"skipped": lt.ZMQ_MISSING}}
    assert result["summary"] == {} and result["machine"]["pyzmq"] is None
    assert lt.ZMQ_MISSING in capsys.readouterr().out

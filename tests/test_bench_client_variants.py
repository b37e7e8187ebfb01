"""bench.client_variants: one row per ttfa result file, with the client behaviour that produced it."""

from __future__ import annotations

import json

from bench.client_variants import main
from server.ttfa import ProbeConfig, RequestResult
from server.ttfa_report import build_document


def result(index: int, ttfa_ms: float | None, *, fresh: bool, error: str | None = None) -> RequestResult:
    r = RequestResult(300, index, "t", 1, ttfa_ms=ttfa_ms, fresh_connection=fresh, error=error)
    r.rtf, r.audio_s = 0.8, 9.3
    return r


def test_rows_name_the_variant_and_how_it_connected(tmp_path, capsys) -> None:
    reuse = [result(0, 100.0, fresh=True), result(1, 120.0, fresh=False), result(2, None, fresh=False, error="x")]
    for r in reuse:
        r.extensions = ["permessage-deflate"]
    bare = [result(i, 90.0, fresh=True) for i in range(3)]
    for r in bare:
        r.compression, r.sockets = "off", "per-request"
    paths = [tmp_path / "ttfa_300.json", tmp_path / "ttfa_300_bare.json"]
    for path, rs in zip(paths, (reuse, bare), strict=True):
        path.write_text(json.dumps(build_document(ProbeConfig(), {300: rs})))
    main([*map(str, paths), str(tmp_path / "ttfa_500.json"), "--json", str(tmp_path / "rows.json")])
    out = capsys.readouterr().out
    assert "| 300 | deflate, reuse | 2/3 (67 %) | 110 |" in out and "| 1 (0) |" in out
    assert "| 300_bare | off, per-request | 3/3 (100 %) | 90 | 90 |" in out and "| 3 (0) |" in out
    assert "ttfa_500.json: missing" in out and "300: x" in out
    rows = json.loads((tmp_path / "rows.json").read_text())
    assert [r["variant"] for r in rows] == ["300", "300_bare"] and rows[0]["served_pct"] == 200 / 3

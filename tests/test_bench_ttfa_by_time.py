"""bench.ttfa_by_time: first audio binned by when each request started (a level's ramp apart from its full load)."""

from __future__ import annotations

import json

from bench.ttfa_by_time import by_start_time, main


def request(started_s: float, ttfa_ms: float | None, underruns: int = 0) -> dict:
    return {"started_s": started_s, "ttfa_ms": ttfa_ms, "underruns": underruns}


def test_requests_are_binned_by_start_and_summarised() -> None:
    requests = [request(0.1 * i, 50.0 + i) for i in range(20)]  # 0.0-1.9 s: 50..69 ms
    requests += [request(2.0 + 0.1 * i, 200.0 - i, underruns=int(i == 3)) for i in range(10)]  # 2.0-2.9 s
    requests.append(request(1.0, None))  # failed before any audio: not counted
    rows = by_start_time(requests, 2.0)
    assert [(r["from_s"], r["requests"]) for r in rows] == [(0.0, 20), (2.0, 10)]
    # percentiles interpolate between order statistics, as the level summaries do (server.ttfa_report)
    assert (rows[0]["p50_ms"], rows[0]["p95_ms"], rows[0]["max_ms"], rows[0]["underran"]) == (59.5, 68.05, 69.0, 0)
    assert (rows[1]["p50_ms"], rows[1]["max_ms"], rows[1]["underran"]) == (195.5, 200.0, 1)


def test_the_command_reads_ttfa_json(tmp_path, capsys) -> None:
    path = tmp_path / "ttfa_300.json"
    level = {"concurrency": 300, "summary": {}, "requests": [request(0.5, 40.0), request(3.0, 90.0)]}
    path.write_text(json.dumps({"levels": [level]}))
    main([str(path), "--bin-s", "2"])
    out = capsys.readouterr().out
    assert "300 streams" in out and "p50    40" in out and "p50    90" in out

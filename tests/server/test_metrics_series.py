"""bench/metrics_series.py against a real server: it samples /metrics while the engine speaks, one row per interval
with the admission's gauges and that interval's turns by phase, and prints them as a table."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]


def rows_in(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


def wait_for_rows(path: Path, n: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while rows_in(path) < n:
        assert time.monotonic() < deadline, f"the sampler wrote {rows_in(path)} of {n} rows"
        time.sleep(0.05)


def test_the_sampler_records_the_turns_of_a_request(server, tmp_path) -> None:
    out = tmp_path / "series.jsonl"
    sampler = subprocess.Popen(
        [sys.executable, "-m", "bench.metrics_series", f"{server.base_url}/metrics", "--out", str(out),
         "--interval-s", "0.2"],
        cwd=ROOT,
    )  # fmt: skip
    try:
        wait_for_rows(out, 1)  # the sampler's first scrape (and its signal handler) came before the request
        body = {"text": "The sampler watches this sentence being spoken.", "format": "wav"}
        assert httpx.post(f"{server.base_url}/v1/tts", json=body, timeout=60).status_code == 200
        # two whole intervals after the request: every turn of it is counted; and at least 5 rows in all
        wait_for_rows(out, max(5, rows_in(out) + 2))
    finally:
        sampler.send_signal(signal.SIGTERM)
        assert sampler.wait(timeout=10) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) >= 5 and all(r["t"] > 0 for r in rows)
    assert {"decoding", "prefill_queue", "turn_avg_seconds", "admission_capacity", "behind_real_time"} <= set(rows[0])
    busy = [r for r in rows if r["turns"] > 0]
    # the step's buckets: rows decoding need a batch bucket of at least one row and a length bucket past position 0
    assert all(r["step_length_bucket"] > 0 and r["step_batch_bucket"] >= 1 for r in busy)
    assert busy and sum(r["frames_per_turn"] * r["turns"] for r in busy) > 0
    # a turn straddling two scrapes puts its step in one interval and its turn time in the next: compare totals
    assert sum(r["turn_ms"] * r["turns"] for r in busy) >= sum(r["step_ms"] * r["turns"] for r in busy) > 0
    printed = subprocess.run(
        [sys.executable, "-m", "bench.metrics_series", "--table", str(out)], cwd=ROOT, capture_output=True, text=True,
        check=True,
    ).stdout.splitlines()  # fmt: skip
    assert printed[0].split()[:3] == ["t", "decoding", "prefill_queue"] and len(printed) == len(rows) + 1

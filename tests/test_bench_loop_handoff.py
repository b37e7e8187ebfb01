"""bench/loop_handoff.py runs end to end and measures both ways of each hand-off (small repeat counts: CI never times)."""

from __future__ import annotations

import json

from bench.loop_handoff import main


def test_the_handoff_bench_writes_every_figure(tmp_path, capsys) -> None:
    out = tmp_path / "handoff.json"
    assert main(["--repeats", "5", "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    assert [r["samples"] for r in got["encode"]] == [4096, 49_152]
    assert all(r[k] > 0 for r in got["encode"] for k in ("s16_plain_us", "s16_now_us", "push_via_thread_us",
                                                          "push_on_loop_us"))  # fmt: skip
    assert [r["batched"] for r in got["posting"]] == [False, True, False, True]
    assert all(r["posting_ms_per_turn"] > 0 and r["cpu_s"] > 0 for r in got["posting"])
    assert "| posting |" in capsys.readouterr().out

"""bench.ray_cost and its stand-in engine: the stand-in speaks a request's exact length through the real Engine, and
`--quick` runs both sides end to end (fishgate alone, then a local Ray Serve) and writes its JSON (the figures are the
script's to report, never asserted; skipped where Ray is not installed)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from bench import standin
from bench.process_tree import cpu_spent
from bench.ray_cost import main
from bench.standin_backend import StandInBackend
from streaming.config import BackendConfig
from streaming.engine import Engine, EngineConfig
from streaming.session import SynthesisSettings, Voice
from tests.streaming.engine_helpers import speak

FRAMES = 30


def test_the_stand_in_speaks_max_new_tokens_frames_through_the_real_engine() -> None:
    async def run() -> tuple[int, int]:
        engine = Engine(EngineConfig(BackendConfig(max_sessions=4), backend_factory=StandInBackend))
        engine.start()
        try:
            assert await asyncio.to_thread(engine.wait_ready, 60), engine.fault
            assert engine.info is not None and engine.info.device == "stand-in"
            session = await engine.admit(Voice(), SynthesisSettings(max_new_tokens=FRAMES))
            utterance = await speak(session, "One sentence for the stand-in engine to speak.")
            return len(utterance.pcm), engine.info.samples_per_frame
        finally:
            engine.stop()

    samples, per_frame = asyncio.run(run())
    assert samples == FRAMES * per_frame


def test_install_makes_engine_configs_build_the_stand_in() -> None:
    from streaming import engine as engine_module

    real = engine_module.EngineConfig
    try:
        standin.install()
        assert engine_module.EngineConfig().backend_factory is StandInBackend
    finally:
        engine_module.EngineConfig = real  # type: ignore[misc]


def test_cpu_is_counted_per_process_and_by_role() -> None:
    before = {1: ("raylet", 2.0), 2: ("replica Gateway", 5.0)}
    after = {1: ("raylet", 2.5), 2: ("replica Gateway", 9.0), 3: ("IDLE", 0.25)}
    assert cpu_spent(before, after) == {
        "cpu_s": 4.75, "processes": 3, "by_role": {"replica Gateway": 4.0, "raylet": 0.5, "IDLE": 0.25},
    }  # fmt: skip


def test_quick_run_of_both_sides(tmp_path: Path) -> None:
    pytest.importorskip("ray.serve")
    assert main(["--out", str(tmp_path), "--quick"]) == 0
    result = json.loads((tmp_path / "ray_cost.json").read_text())
    runs = {r["side"]: r for r in result["runs"]}
    assert set(runs) == {"alone", "ray"}
    for run in runs.values():
        level = run["levels"]["4"]
        assert level["summary"]["requests"] == 4 and level["server_cpu"]["processes"] >= 1
    roles = runs["ray"]["levels"]["4"]["server_cpu"]["by_role"]
    assert {"replica Gateway", "replica EngineReplica", "raylet"} <= set(roles) and "ProxyActor" not in roles
    assert "| 4 | ray |" in result["table"] and "ray@4" in result["checks"]

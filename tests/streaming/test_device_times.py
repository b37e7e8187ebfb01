"""streaming.device_times off (the CPU engine): spans cost nothing and count nothing; the engine's /metrics keys exist
as zeros. The GPU side is tests/streaming/test_engine_gpu.py::test_device_times_add_up_the_gpu_work_of_each_span."""

from __future__ import annotations

import asyncio

from streaming.device_times import DeviceTimes
from streaming.engine import DEVICE_PARTS
from streaming.session import SynthesisSettings, Voice
from tests.streaming.engine_helpers import running_engine, speak


def test_disabled_spans_record_nothing_and_still_run_their_block() -> None:
    times = DeviceTimes(enabled=False)
    ran = []
    with times.span("step"):
        ran.append(1)
    times.settle()
    assert ran == [1] and times.pending == 0 and not times.seconds


def test_a_cpu_engine_reports_zero_device_seconds() -> None:
    async def main() -> dict:
        with running_engine(max_sessions=1) as engine:
            await speak(engine.open_session(Voice(), SynthesisSettings(seed=1, max_new_tokens=8)), "Hi.")
            return engine.stats()

    stats = asyncio.run(main())
    assert stats["steps"] > 0
    assert DEVICE_PARTS == ("prefill", "step", "vocode")
    assert [stats[f"{p}_device_seconds"] for p in DEVICE_PARTS] == [0.0, 0.0, 0.0]

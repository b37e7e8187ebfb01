"""bench/host_ceiling.py's stand-in device: the real engine runs on it and its cost model matches the measured points.

No timing assertions (benchmarks are measured, not asserted): this keeps the bench runnable as the engine changes.
"""

from __future__ import annotations

import asyncio

import pytest

from bench.host_ceiling import DECODE_MS, TimedStandIn, decode_ms, stand_in_capacity, vocoder_ms
from streaming.config import BackendConfig
from streaming.engine import Engine, EngineConfig
from streaming.session import SynthesisSettings, Voice
from tests.streaming.engine_helpers import speak

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


def test_cost_model_passes_through_the_measured_points() -> None:
    for bucket, ms in DECODE_MS.items():
        assert decode_ms(bucket) == ms
    assert DECODE_MS[8] < decode_ms(32) < DECODE_MS[64] and decode_ms(4096) == DECODE_MS[1024]
    assert vocoder_ms(64, 24) == pytest.approx(78.3, abs=1.0)  # run 1 measured 78.7 ms
    assert stand_in_capacity(64) < 1 < stand_in_capacity(1024)


def test_the_run17_cost_model_reads_the_measured_graphs_and_routes_around_the_bad_ones() -> None:
    """--cost-model run17: the compiled step's buckets, and each vocoder call at its cheapest plan among run 17's 72
    measured graphs, as the engine's timed dispatch runs it (24 × 24 was 80.5 ms on its own graph, 13 ms as two
    12-row replays)."""
    from bench.host_ceiling import DECODE_MS_RUN17, measured_vocoder_ms, use_cost_model

    call = measured_vocoder_ms()
    assert call(1, 8) == pytest.approx(1.34, abs=0.05) and call(64, 24) == pytest.approx(29.5, abs=0.2)
    assert call(24, 24) < 20 and call(20, 24) == call(24, 24)  # rerouted; a call pays its bucket's plan
    assert decode_ms(256, DECODE_MS_RUN17) == 8.93
    try:
        use_cost_model("run17")
        assert TimedStandIn.vocoder_call_ms is not None and stand_in_capacity(256) < stand_in_capacity(512) < 1
        backend = TimedStandIn.__new__(TimedStandIn)  # read through an instance, as vocode() does
        assert backend.vocoder_call_ms(64, 24) == call(64, 24)
    finally:
        use_cost_model("run7")
    assert TimedStandIn.vocoder_call_ms is None and TimedStandIn.decode_table is DECODE_MS


def test_the_engine_speaks_whole_utterances_on_the_stand_in() -> None:
    # half-step vocoder buckets: the stand-in pads calls to the backend's own bucket list
    engine = Engine(
        EngineConfig(BackendConfig(max_sessions=4, vocoder_half_step_buckets=True), backend_factory=TimedStandIn)
    )
    engine.start()
    try:
        assert engine.wait_ready(120), engine.fault

        async def main():
            sessions = [engine.open_session(Voice(), SynthesisSettings(max_new_tokens=30)) for _ in range(3)]
            return await asyncio.gather(*(speak(s, "Three streams at once on a pretend device.") for s in sessions))

        utterances = asyncio.run(main())
        backend = engine._worker.b
        assert backend.vocoder_buckets == [1, 2, 3, 4] and backend.vocode_calls > 0
        assert backend.vocode_frames_run >= engine.stats()["vocoded_frames"]
    finally:
        engine.stop()
    for utt in utterances:
        assert utt.done is not None and utt.done.reason == "stop" and not utt.errors
        # random codes never end early: every stream runs to max_new_tokens, all of it vocoded
        assert utt.codes.shape[1] == 30 and len(utt.pcm) == 30 * 2048 == utt.done.audio_samples


def test_turn_attribution_reports_vocoder_calls_and_padding_from_the_engines_counters() -> None:
    """bench/turn_attribution.py reads the engine's vocoder counters from /metrics: calls per turn, and the share of
    the frames the vocoder ran that were graph padding (frames run − frames asked for)."""
    from bench.turn_attribution import attribution, counters_from_text
    from streaming.session import SynthesisSettings, Voice
    from tests.streaming.engine_helpers import running_engine, speak

    def dump(stats: dict) -> str:
        return "\n".join(f'fishgate_engine{{what="{k}"}} {v}' for k, v in stats.items() if isinstance(v, int | float))

    async def main() -> tuple[dict, dict]:
        with running_engine(max_sessions=2) as engine:
            before = engine.stats()
            await speak(engine.open_session(Voice(), SynthesisSettings(seed=4, max_new_tokens=30)), "Counting calls.")
            return before, engine.stats()

    before, after = asyncio.run(main())
    assert after["vocode_calls"] > before["vocode_calls"]
    assert (
        after["vocode_frames_run"] - before["vocode_frames_run"] == after["vocoded_frames"] - before["vocoded_frames"]
    )
    a = attribution(counters_from_text(dump(before)), counters_from_text(dump(after)))
    assert a["vocode_calls_per_turn"] > 0 and a["vocode_padding"] == 0.0  # CPU: no graphs, so no padding rows
    assert a["first_audio_utterances"] == 1 and a["first_audio_decode_ms"] > 0  # the one utterance's way to audio
    padded = dict(
        after, vocode_frames_run=after["vocode_frames_run"] + (after["vocoded_frames"] - before["vocoded_frames"])
    )
    assert attribution(counters_from_text(dump(before)), counters_from_text(dump(padded)))["vocode_padding"] == 0.5
    assert a["step_device_ms"] == a["vocode_device_ms"] == a["vocode_graph_ms"] == 0.0  # CPU: no events, no graphs
    timed = dict(after, turns=before["turns"] + 10, step_device_seconds=0.05, vocode_device_seconds=0.2)
    timed["vocode_graph_seconds"] = 0.1
    b = attribution(counters_from_text(dump(before)), counters_from_text(dump(timed)))
    per_turn = [round(b[f"{k}_ms"], 6) for k in ("step_device", "vocode_device", "vocode_graph")]
    assert per_turn == [5.0, 20.0, 10.0]  # per turn

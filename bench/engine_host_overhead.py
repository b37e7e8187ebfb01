"""Engine host overhead on CPU: what one scheduling turn costs beyond the model's own work, per active session.

The H200 end-to-end runs (docs/BENCHMARKS.md) saturated at 9–13 engine turns/s with 256 sessions although one
decode step took 15.6 ms: the time went to the host. This bench reproduces the host side on a CPU with the tiny
fixture checkpoint (its step and vocoder cost little), N sessions that each speak a long text, and readers that drain
every event on the asyncio loop as a server would. It reports per turn: total, prefill, step, vocode and the rest
("host": Python scheduling, row bookkeeping, event posting), and the rest per active session. `--profile` prints the
worker thread's top functions by own time.

    python bench/engine_host_overhead.py --sessions 1 64 256 --seconds 8 [--profile] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from streaming.config import BackendConfig, WorkerLimits
from streaming.engine import Engine, EngineConfig
from streaming.session import AudioChunk, SynthesisSettings, UtteranceDone, Voice
from streaming.worker import Worker
from tests.streaming.engine_helpers import fixture_checkpoint

TEXT = "This sentence keeps the engine busy while we count what every turn costs on the host. " * 4


async def drive(engine: Engine, sessions: int, seconds: float) -> dict[str, float]:
    settings = SynthesisSettings(seed=0, max_new_tokens=2000)
    opened = [engine.open_session(Voice(), settings) for _ in range(sessions)]
    chunks = 0

    async def reader(s) -> None:
        nonlocal chunks
        while True:
            ev = await s.next_event()
            if isinstance(ev, AudioChunk):
                chunks += 1
            elif isinstance(ev, UtteranceDone):
                s.speak(TEXT)
                s.end_utterance()

    for s in opened:
        s.speak(TEXT)
        s.end_utterance()
    tasks = [asyncio.create_task(reader(s)) for s in opened]
    await asyncio.sleep(2.0)  # past the prefills
    before = dict(engine.stats())
    t0 = time.perf_counter()
    await asyncio.sleep(seconds)
    after = dict(engine.stats())
    wall = time.perf_counter() - t0
    for t in tasks:
        t.cancel()
    for s in opened:
        s.close()
    d = {k: after[k] - before[k] for k in ("turns", "turn_seconds", "prefill_seconds", "step_seconds",
                                           "vocode_seconds", "frames", "steps")}  # fmt: skip
    turns = max(d["turns"], 1)
    host = d["turn_seconds"] - d["prefill_seconds"] - d["step_seconds"] - d["vocode_seconds"]
    return {
        "sessions": sessions, "turns_per_s": d["turns"] / wall, "frames_per_s": d["frames"] / wall,
        "turn_ms": 1000 * d["turn_seconds"] / turns, "prefill_ms": 1000 * d["prefill_seconds"] / turns,
        "step_ms": 1000 * d["step_seconds"] / turns, "vocode_ms": 1000 * d["vocode_seconds"] / turns,
        "host_ms": 1000 * host / turns, "host_us_per_session": 1e6 * host / turns / sessions,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    tmp = Path("build/bench_host")
    tmp.mkdir(parents=True, exist_ok=True)
    ckpt = tmp / "ckpt"
    if not ckpt.exists():
        fixture_checkpoint(tmp)
    rows = []
    for n in args.sessions:
        profiler = cProfile.Profile() if args.profile else None
        if profiler is not None:
            turn = Worker.turn

            def profiled(self: Worker, _turn=turn, _p=profiler) -> None:
                _p.enable()
                try:
                    _turn(self)
                finally:
                    _p.disable()

            Worker.turn = profiled  # type: ignore[method-assign]
        engine = Engine(EngineConfig(BackendConfig(checkpoint=ckpt, max_sessions=max(n, 1)), WorkerLimits()))
        engine.start()
        assert engine.wait_ready(300), engine.fault
        try:
            rows.append(asyncio.run(drive(engine, n, args.seconds)))
        finally:
            engine.stop()
            if profiler is not None:
                Worker.turn = turn  # type: ignore[method-assign]
        r = rows[-1]
        print(f"{n:5d} sessions: {r['turns_per_s']:7.1f} turns/s  turn {r['turn_ms']:7.2f} ms = prefill "
              f"{r['prefill_ms']:.2f} + step {r['step_ms']:.2f} + vocode {r['vocode_ms']:.2f} + host "
              f"{r['host_ms']:.2f} ms ({r['host_us_per_session']:.1f} µs/session)", flush=True)  # fmt: skip
        if profiler is not None:
            pstats.Stats(profiler).sort_stats("tottime").print_stats(18)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()

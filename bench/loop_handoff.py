"""Hand-offs between the engine's worker thread and the server's event loop, on the host's CPU (no GPU needed).

Two costs the H200 run 17 profile showed at 384 streams, measured each way in one process:
- encoding one audio chunk on the loop vs through `asyncio.to_thread` (what the server did for every chunk), and
  `float_to_s16le` against the `nan_to_num` formula it replaced;
- posting a turn's events one `call_soon_threadsafe` each (what the worker did before `Outbox`) vs one per flush:
  the worker's time posting and the process's CPU time while a loop reads every event.

    python -m bench.loop_handoff [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time
from pathlib import Path

import numpy as np

from streaming.audio_encoders import float_to_s16le
from streaming.audio_out import AudioOutput, OutputFormat
from streaming.session import AudioChunk, Outbox, Session, SynthesisSettings, Voice

CHUNKS = (4096, 49_152)  # 2 and 24 frames of 2,048 samples: the engine's smallest and largest scheduled chunks


def _per_call_us(fn, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


def _plain_s16(x: np.ndarray) -> bytes:
    y = np.nan_to_num(np.asarray(x, dtype=np.float32).reshape(-1), nan=0.0)
    return np.rint(np.clip(y, -1.0, 1.0) * 32767.0).astype("<i2").tobytes()


def encode_costs(repeats: int) -> list[dict[str, float]]:
    rows = []
    for samples in CHUNKS:
        x = (np.random.default_rng(0).standard_normal(samples) * 0.3).astype(np.float32)
        out = AudioOutput(OutputFormat(format="pcm"))

        async def through(thread: bool, x=x, out=out) -> float:
            t0 = time.perf_counter()
            for _ in range(repeats):
                if thread:
                    await asyncio.to_thread(out.push, x)
                else:
                    out.push(x)
            return (time.perf_counter() - t0) / repeats * 1e6

        rows.append({
            "samples": samples,
            "s16_plain_us": round(_per_call_us(lambda x=x: _plain_s16(x), repeats), 1),
            "s16_now_us": round(_per_call_us(lambda x=x: float_to_s16le(x), repeats), 1),
            "push_via_thread_us": round(asyncio.run(through(True)), 1),
            "push_on_loop_us": round(asyncio.run(through(False)), 1),
        })  # fmt: skip
    return rows


def posting_cost(batched: bool, sessions: int = 300, turns: int = 200, events: int = 30) -> dict[str, float]:
    """A worker thread posts `events` audio chunks a turn (2 ms of "GPU" sleep between turns) to sessions whose
    readers drain them on the loop; returns the worker's posting ms a turn and the process CPU seconds."""

    async def main() -> dict[str, float]:
        loop = asyncio.get_running_loop()
        opened = [Session(Voice(), SynthesisSettings(), lambda cmd: None, loop) for _ in range(sessions)]
        pcm = np.zeros(4096, np.float32)
        done = asyncio.Event()
        posting = [0.0]

        async def reader(s: Session) -> None:
            while True:
                await s.next_event()

        tasks = [asyncio.create_task(reader(s)) for s in opened]

        def worker() -> None:
            box = Outbox()
            for t in range(turns):
                t0 = time.perf_counter()
                for i in range(events):
                    s = opened[(t * events + i) % sessions]
                    if batched:
                        box.post(s, AudioChunk(0, pcm))
                    else:  # the old way: each event its own wake-up of the loop
                        ev = AudioChunk(0, pcm)
                        s.count_posted(ev)
                        loop.call_soon_threadsafe(s.deliver, ev)
                box.flush()
                posting[0] += time.perf_counter() - t0
                time.sleep(0.002)
            loop.call_soon_threadsafe(done.set)

        cpu0 = time.process_time()
        thread = threading.Thread(target=worker)
        thread.start()
        await done.wait()
        thread.join()
        cpu = time.process_time() - cpu0
        for task in tasks:
            task.cancel()
        return {"batched": batched, "posting_ms_per_turn": round(posting[0] / turns * 1e3, 3), "cpu_s": round(cpu, 3)}

    return asyncio.run(main())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=1000)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    encode = encode_costs(args.repeats)
    posting = [posting_cost(batched) for batched in (False, True, False, True)]
    print("| samples | s16 plain µs | s16 now µs | push via thread µs | push on loop µs |")
    print("|---|---|---|---|---|")
    for r in encode:
        print(f"| {r['samples']} | {r['s16_plain_us']} | {r['s16_now_us']} | {r['push_via_thread_us']} | "
              f"{r['push_on_loop_us']} |")  # fmt: skip
    print("\n| posting | worker ms a turn | process CPU s |\n|---|---|---|")
    for r in posting:
        print(f"| {'one call a flush' if r['batched'] else 'one call an event'} | {r['posting_ms_per_turn']} | "
              f"{r['cpu_s']} |")  # fmt: skip
    if args.json is not None:
        args.json.write_text(json.dumps({"encode": encode, "posting": posting}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

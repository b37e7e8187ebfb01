"""What an audio chunk's trip costs from an engine replica to a gateway replica on Ray Serve: through a streaming
deployment-handle call (the design docs/DECISIONS.md turned down) against the engine link's framing over TCP (the
one fishgate uses):

    python -m bench.ray_stream --out OUT_DIR [--streams 1,16,64] [--seconds 6]

A local Ray (2 CPUs) runs two deployments: `Producer` (an engine stand-in) and `Consumer` (a gateway stand-in).
For each level, the consumer opens that many streams at once, each getting one AUDIO_SAMPLES-sample float32 chunk
every CHUNK_PERIOD_S (a real-time stream's pace at 44.1 kHz), first through `producer.options(stream=True)`
(one streaming call per stream, as Serve's own WebSocket and response streaming do), then through one TCP connection
carrying every stream in `streaming.engine_link.protocol` frames (AUDIO messages, as the link's host sends them).
A chunk's latency: from the producer taking its timestamp just before handing the chunk over to the consumer having
it (CLOCK_MONOTONIC is one clock for both processes). CPU: seconds both replica processes spent per chunk. Prints a
table, writes OUT_DIR/ray_stream.json. Needs `pip install -e '.[ray]'`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import struct
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np

AUDIO_SAMPLES = 4096  # two codec frames at 44.1 kHz: an early chunk of a stream
CHUNK_PERIOD_S = AUDIO_SAMPLES / 44_100
STAMP = ">d"  # a format, not a struct.Struct: the deployments are pickled by value (this module runs as __main__)
STAMP_BYTES = struct.calcsize(STAMP)


def summary(latencies_s: list[float], cpu_s: float, seconds: float) -> dict[str, Any]:
    ms = np.asarray(latencies_s) * 1000
    return {
        "chunks": len(ms),
        "p50_ms": round(float(np.percentile(ms, 50)), 3),
        "p95_ms": round(float(np.percentile(ms, 95)), 3),
        "p99_ms": round(float(np.percentile(ms, 99)), 3),
        "max_ms": round(float(ms.max()), 3),
        "cpu_us_per_chunk": round(1e6 * cpu_s / max(len(ms), 1), 1),
        "cpu_share": round(cpu_s / seconds, 3),  # of one core, both processes together
    }


def cpu_now() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def build(streams_levels: list[int], seconds: float) -> Any:
    from ray import serve

    from streaming.engine_link.protocol import FrameDecoder, Op, frame

    chunk = np.zeros(AUDIO_SAMPLES, np.float32).tobytes()

    @serve.deployment(ray_actor_options={"num_cpus": 0.5}, max_ongoing_requests=1024)
    class Producer:
        async def __init__(self) -> None:
            self.server = await asyncio.start_server(self.serve_link, "127.0.0.1", 0)
            self.port = self.server.sockets[0].getsockname()[1]

        def link_port(self) -> int:
            return self.port

        def cpu(self) -> float:
            return cpu_now()

        async def stream(self, chunks: int) -> AsyncIterator[bytes]:
            """One stream over the deployment handle: each item a timestamp and the chunk's audio."""
            for _ in range(chunks):
                await asyncio.sleep(CHUNK_PERIOD_S)
                yield struct.pack(STAMP, time.monotonic()) + chunk

        async def serve_link(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            """Every stream the consumer asks for, as the link's host pumps them: one AUDIO frame per chunk."""
            streams, chunks = struct.unpack(STAMP + "d", await reader.readexactly(2 * STAMP_BYTES))

            async def pump(sid: int) -> None:
                for _ in range(int(chunks)):
                    await asyncio.sleep(CHUNK_PERIOD_S)
                    # an AUDIO message as the host sends it, its utterance field carrying the timestamp
                    writer.write(frame([Op.AUDIO, sid, time.monotonic(), chunk]))
                    await writer.drain()

            await asyncio.gather(*(pump(i) for i in range(int(streams))))
            writer.close()

    @serve.deployment(ray_actor_options={"num_cpus": 0.5})
    class Consumer:
        def __init__(self, producer: Any) -> None:
            self.producer = producer

        async def __call__(self, _: Any = None) -> dict[str, Any]:
            out: dict[str, Any] = {}
            chunks = max(1, round(seconds / CHUNK_PERIOD_S))
            port = await self.producer.link_port.remote()
            for streams in streams_levels:
                out[str(streams)] = {
                    "handle": await self.measure(self.over_handles(streams, chunks)),
                    "link": await self.measure(self.over_link(streams, chunks, port)),
                }
            return out

        async def measure(self, run: Any) -> dict[str, Any]:
            cpu0 = cpu_now() + await self.producer.cpu.remote()
            latencies = await run
            cpu_s = cpu_now() + await self.producer.cpu.remote() - cpu0
            return summary(latencies, cpu_s, seconds)

        async def over_handles(self, streams: int, chunks: int) -> list[float]:
            latencies: list[float] = []

            async def one() -> None:
                async for item in self.producer.options(stream=True).stream.remote(chunks):
                    latencies.append(time.monotonic() - struct.unpack_from(STAMP, item)[0])

            await asyncio.gather(*(one() for _ in range(streams)))
            return latencies

        async def over_link(self, streams: int, chunks: int, port: int) -> list[float]:
            latencies: list[float] = []
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(struct.pack(STAMP + "d", streams, chunks))
            decoder = FrameDecoder()
            while data := await reader.read(256 * 2**10):
                now = time.monotonic()
                latencies.extend(now - m[2] for m in decoder.feed(data))
            writer.close()
            return latencies

    return Consumer.bind(Producer.bind())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--streams", default="1,16,64", help="concurrent streams per level")
    parser.add_argument("--seconds", type=float, default=6.0, help="each stream's length")
    args = parser.parse_args()
    levels = [int(x) for x in args.streams.split(",")]

    import ray
    from ray import serve

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        handle = serve.run(build(levels, args.seconds), name="ray_stream", route_prefix=None)
        results = handle.remote().result(timeout_s=60 + 4 * len(levels) * args.seconds)
    finally:
        serve.shutdown()
        ray.shutdown()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "ray_stream.json").write_text(json.dumps(results, indent=2))
    print("| streams | path | chunks | p50 ms | p95 ms | p99 ms | max ms | CPU µs/chunk |")
    print("|---|---|---|---|---|---|---|---|")
    for streams, paths in results.items():
        for path, s in paths.items():
            print(f"| {streams} | {path} | {s['chunks']} | {s['p50_ms']} | {s['p95_ms']} | {s['p99_ms']} | "
                  f"{s['max_ms']} | {s['cpu_us_per_chunk']} |")  # fmt: skip


if __name__ == "__main__":
    main()

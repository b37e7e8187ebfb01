"""Which local transport the engine link should use: audio from an "engine" process to a "gateway" process (which
acknowledges it, as streaming.engine_link does), three ways, measured between two processes on this machine:

    python -m bench.link_transport --out OUT_DIR [--runs 3] [--load-s 10] [--consume none|s16] [--quick]

  socket  the current design: an asyncio Unix-socket stream of frames made by streaming.engine_link.protocol itself
          (`event_frame`: 4-byte length + MessagePack `[AUDIO, sid, utt, pcm bytes]`; the gateway reads like
          connection.Link: `reader.read(LINK_READ_BYTES)` → `FrameDecoder.feed` → `event_of`), ACKs batched per loop pass
  zmq     ZeroMQ ROUTER (engine) / DEALER (gateway) over ipc://, one MessagePack payload a message (the same list, no
          length prefix), zmq.asyncio on both sides, helped where it costs a future a message: the engine sends
          NOBLOCK through a plain shadow of its socket (awaiting only at the high-water mark), the gateway awaits one
          message and then drains what has arrived the same way (~25% less engine CPU under load than awaiting each
          send and receive); skipped, with a note in the JSON, without pyzmq
  shm     a shared-memory ring (multiprocessing.shared_memory) holding the PCM, plus a doorbell frame over the Unix
          socket: `[AUDIO, sid, utt, offset, nbytes, ring end]`; the gateway maps the samples in place (no copy) and its
          ACK also gives the ring back up to the last chunk it has consumed

Workloads, each variant one engine process and one gateway process (`--role`, started here), in one connection:
  single_64k / single_192k  one stream, chunks of 8 / 24 frames of 2048 samples (64 / 192 KiB float32), back to back
                            with a 2 ms gap (at the real rate, a chunk every 8/21.5 s, this would take minutes)
  load_300                  300 streams' worth for `--load-s` s: every 1/21.5 s (a decode step) the streams whose 8th
                            frame just completed send their chunk (~37 chunks a burst, ~806 chunks/s, ~53 MB/s)
A chunk's one-way latency: from the engine taking time.monotonic() just before encoding it (the stamp rides in its
first 8 bytes of samples) to the gateway holding it as an AudioChunk (CLOCK_MONOTONIC is one clock for both
processes); the first chunks of a single-stream workload are warm-up. CPU: each process's getrusage (all its threads,
so zmq's I/O thread counts) over the workload, per wall second and per chunk. `--consume s16` also makes the gateway
turn each chunk into s16le (streaming.audio_encoders.float_to_s16le), the least any output format costs it.

Prints a markdown table (with `--runs N`: medians, [min–max] across runs; the variants' order rotates from run to
run), writes OUT_DIR/link_transport.json (and the table as link_transport.md). A run takes ~40 s (`--quick`: a few seconds, checks the script and
measures nothing). A 2-core machine shared with other jobs gives numbers that move: compare across several runs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

from streaming.audio_encoders import float_to_s16le
from streaming.engine_link.connection import LINK_READ_BYTES
from streaming.engine_link.host import LINK_HIGH_WATER_BYTES
from streaming.engine_link.protocol import EVENT_OPS, FrameDecoder, Op, event_frame, event_of, frame
from streaming.session import AudioChunk

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("socket", "zmq", "shm")
SAMPLES_PER_FRAME = 2048
SAMPLE_RATE_HZ = 44_100
FRAMES_PER_S = SAMPLE_RATE_HZ / SAMPLES_PER_FRAME  # 21.5: one decode step a frame
RING_BYTES = 32 * 2**20  # the gateway's unacknowledged chunks: ~0.6 s of 300 streams' audio
CHILD_LIMIT_S = 120.0
ZMQ_MISSING = "pyzmq is not installed (pip install pyzmq): the ZeroMQ variant was not measured"


def plan_of(quick: bool, load_s: float) -> list[dict[str, Any]]:
    chunks, warm_up = (30, 5) if quick else (300, 20)
    return [
        {"name": "single_64k", "kind": "single", "frames": 8, "chunks": chunks, "warm_up": warm_up, "gap_s": 0.002},
        {"name": "single_192k", "kind": "single", "frames": 24, "chunks": chunks, "warm_up": warm_up, "gap_s": 0.002},
        {"name": "load_300", "kind": "load", "frames": 8, "streams": 300, "seconds": 0.3 if quick else load_s,
         "warm_up": 0},
    ]  # fmt: skip


def zmq_available() -> bool:
    return importlib.util.find_spec("zmq") is not None


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def stamp(pcm: np.ndarray, t: float) -> None:
    pcm[:2].view(np.float64)[0] = t


def stamp_of(pcm: np.ndarray) -> float:
    return float(pcm[:2].view(np.float64)[0])


def summary_ms(values_s: list[float]) -> dict[str, Any]:
    if not values_s:
        return {"n": 0, "p50": None, "p95": None, "max": None, "mean": None}
    ms = np.asarray(values_s) * 1000
    return {"n": len(ms), "p50": float(np.percentile(ms, 50)), "p95": float(np.percentile(ms, 95)),
            "max": float(ms.max()), "mean": float(ms.mean())}  # fmt: skip


# ---- the engine process ----------------------------------------------------------------------------------------------
class EngineSide:
    """What every variant's engine does: the workloads' schedule, the ACK count; `send_audio` / `send_control` are
    the variant's."""

    def __init__(self) -> None:
        self.sent_samples = 0
        self.acked_samples = 0
        self.acked = asyncio.Event()

    def ack(self, pairs: list[int]) -> None:
        self.acked_samples += sum(pairs[1::2])
        if self.acked_samples >= self.sent_samples:
            self.acked.set()

    async def send_audio(self, sid: int, utt: int, pcm: np.ndarray) -> None:
        raise NotImplementedError

    async def send_control(self, message: list[Any]) -> None:
        raise NotImplementedError

    async def run(self, plan: list[dict[str, Any]]) -> list[dict[str, Any]]:
        rng = np.random.default_rng(0)
        results = []
        for phase in plan:
            template = rng.uniform(-0.5, 0.5, phase["frames"] * SAMPLES_PER_FRAME).astype(np.float32)
            await asyncio.sleep(0.2)  # the link is quiet: the last workload's ACKs are in
            await self.send_control([Op.STATS, {"bench": "start", **phase}, 0])
            chunks = 0
            c0, m0, t0 = cpu_s(), time.thread_time(), time.monotonic()
            if phase["kind"] == "single":
                for i in range(phase["chunks"]):
                    stamp(template, time.monotonic())
                    await self.send_audio(1, i, template)
                    await asyncio.sleep(phase["gap_s"])
                chunks = phase["chunks"]
            else:
                tick_s, frames, streams = 1 / FRAMES_PER_S, phase["frames"], phase["streams"]
                for k in range(round(phase["seconds"] * FRAMES_PER_S)):
                    delay = t0 + k * tick_s - time.monotonic()
                    if delay > 0:
                        await asyncio.sleep(delay)
                    for s in range(streams):
                        if (k + s) % frames == frames - 1:  # this stream's chunk is complete at this step
                            stamp(template, time.monotonic())
                            await self.send_audio(s + 1, k // frames, template)
                            chunks += 1
            await self.send_control([Op.STATS, {"bench": "end"}, 0])
            self.acked.clear()
            if self.acked_samples < self.sent_samples:
                await asyncio.wait_for(self.acked.wait(), 30)
            wall, cpu, main_cpu = time.monotonic() - t0, cpu_s() - c0, time.thread_time() - m0
            results.append({"name": phase["name"], "chunks": chunks, "wall_s": wall, "cpu_s": cpu,
                            "main_thread_cpu_s": main_cpu})  # fmt: skip
        await self.send_control([Op.STATS, {"bench": "bye"}, 0])
        return results


class SocketEngine(EngineSide):
    """The current link: streaming.engine_link.protocol's frames on an asyncio Unix-socket stream (as host.py)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        super().__init__()
        self.reader, self.writer = reader, writer
        writer.transport.set_write_buffer_limits(high=LINK_HIGH_WATER_BYTES)

    async def read_acks(self) -> None:
        decoder = FrameDecoder()
        while data := await self.reader.read(LINK_READ_BYTES):
            for m in decoder.feed(data):
                if m[0] == Op.ACK:
                    self.on_ack(m)

    def on_ack(self, m: list[Any]) -> None:
        self.ack(m[1])

    async def send_audio(self, sid: int, utt: int, pcm: np.ndarray) -> None:
        self.writer.write(event_frame(sid, AudioChunk(utt, pcm)))
        self.sent_samples += len(pcm)
        await self.writer.drain()  # waits only above the high-water mark (host.py's pumps)

    async def send_control(self, message: list[Any]) -> None:
        self.writer.write(frame(message))
        await self.writer.drain()


class ShmEngine(SocketEngine):
    """PCM into a shared-memory ring, a doorbell frame (offset, length) on the Unix socket; the ring is given back by
    the gateway's ACKs (their last item: the ring position it has consumed up to)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, shm: Any) -> None:
        super().__init__(reader, writer)
        self.shm = shm
        self.ring = np.ndarray((shm.size,), dtype=np.uint8, buffer=shm.buf)
        self.ring[:] = 0  # its pages exist before the workloads (an engine would do this once, at start)
        self.head = 0  # bytes written since the start, padding at the ring's end included
        self.released = 0  # the ring position the gateway has consumed up to
        self.room = asyncio.Event()
        self.ring_waits = 0

    def on_ack(self, m: list[Any]) -> None:
        self.released = max(self.released, m[2])
        self.room.set()
        self.ack(m[1])

    async def send_audio(self, sid: int, utt: int, pcm: np.ndarray) -> None:
        n, size = pcm.nbytes, self.ring.size
        off = self.head % size
        if off + n > size:  # a chunk never wraps: skip the ring's tail
            self.head += size - off
            off = 0
        while self.head + n - self.released > size:
            self.ring_waits += 1
            self.room.clear()
            await self.room.wait()
        self.ring[off : off + n] = pcm.view(np.uint8)
        self.head += n
        self.writer.write(frame([Op.AUDIO, sid, utt, off, n, self.head]))
        self.sent_samples += len(pcm)
        await self.writer.drain()


class ZmqEngine(EngineSide):
    """ROUTER at ipc://: one MessagePack payload a message, to the gateway that said HELLO."""

    def __init__(self, sock: Any, identity: bytes) -> None:
        import zmq

        super().__init__()
        self.sock, self.identity = sock, identity
        self.again = zmq.Again
        self.sync = zmq.Socket.shadow(sock.underlying)  # the same socket without asyncio's per-message future
        self.noblock = zmq.NOBLOCK

    async def read_acks(self) -> None:
        while True:
            _, payload = await self.sock.recv_multipart(copy=False)
            m = msgpack.unpackb(payload.buffer, raw=False)
            if m[0] == Op.ACK:
                self.ack(m[1])

    async def send_audio(self, sid: int, utt: int, pcm: np.ndarray) -> None:
        payload = msgpack.packb([Op.AUDIO, sid, utt, np.ascontiguousarray(pcm, dtype=np.float32).tobytes()],
                                use_bin_type=True)  # fmt: skip
        self.sent_samples += len(pcm)
        try:
            self.sync.send_multipart([self.identity, payload], self.noblock)
        except self.again:  # at its high-water mark: wait until it takes more
            await self.sock.send_multipart([self.identity, payload])

    async def send_control(self, message: list[Any]) -> None:
        await self.sock.send_multipart([self.identity, msgpack.packb(message, use_bin_type=True)])


async def serve_engine(variant: str, where: Path, plan: list[dict[str, Any]]) -> dict[str, Any]:
    done: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
    if variant == "zmq":
        import zmq
        import zmq.asyncio

        ctx = zmq.asyncio.Context()
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.LINGER, 1000)
        sock.bind(f"ipc://{where / 'zmq.sock'}")
        print("ready", flush=True)
        identity, _ = await asyncio.wait_for(sock.recv_multipart(), CHILD_LIMIT_S)
        engine = ZmqEngine(sock, identity)
        acks = asyncio.create_task(engine.read_acks())
        phases = await engine.run(plan)
        acks.cancel()
        sock.close()
        ctx.term()
        return {"phases": phases}

    from multiprocessing import shared_memory

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        shm = None
        engine: SocketEngine | None = None
        try:
            if variant == "shm":
                shm = shared_memory.SharedMemory(create=True, size=RING_BYTES)
                engine = ShmEngine(reader, writer, shm)
                await engine.send_control([Op.WELCOME, shm.name, shm.size])
            else:
                engine = SocketEngine(reader, writer)
            acks = asyncio.create_task(engine.read_acks())
            phases = await engine.run(plan)
            acks.cancel()
            extra = {"ring_waits": engine.ring_waits} if isinstance(engine, ShmEngine) else {}
            done.set_result({"phases": phases, **extra})
        except BaseException as e:
            if not done.done():
                done.set_exception(e)
            raise
        finally:
            writer.close()
            if shm is not None:
                if isinstance(engine, ShmEngine):
                    del engine.ring
                shm.close()
                shm.unlink()

    server = await asyncio.start_unix_server(handle, path=str(where / "link.sock"))
    print("ready", flush=True)
    try:
        return await asyncio.wait_for(done, CHILD_LIMIT_S)
    finally:
        server.close()


# ---- the gateway process ---------------------------------------------------------------------------------------------
class GatewaySide:
    """What every variant's gateway does with what arrives: each chunk's latency, the consumer, ACKs batched per loop
    pass (connection.Link), the workloads' CPU."""

    def __init__(self, send: Callable[[list[Any]], Any], consume: str) -> None:
        self.send = send
        self.consume = consume
        self.loop = asyncio.get_running_loop()
        self.acks: Counter[int] = Counter()
        self.acks_scheduled = False
        self.released = 0  # shm: the ring position consumed up to
        self.ring = False
        self.finished = False
        self.phase: dict[str, Any] | None = None
        self.results: list[dict[str, Any]] = []
        self.latencies: list[float] = []
        self.chunks = 0
        self.warm_up = 0
        self.c0 = self.m0 = self.t0 = 0.0
        self.s16_bytes = 0

    def audio(self, sid: int, ev: AudioChunk) -> None:
        now = time.monotonic()
        self.chunks += 1
        if self.chunks > self.warm_up:
            self.latencies.append(now - stamp_of(ev.pcm))
        if self.consume == "s16":
            self.s16_bytes += len(float_to_s16le(ev.pcm))
        self.acks[sid] += len(ev.pcm)
        if not self.acks_scheduled:
            self.acks_scheduled = True
            self.loop.call_soon(self.send_acks)

    def send_acks(self) -> None:
        self.acks_scheduled = False
        pairs = [x for sid, n in self.acks.items() for x in (sid, n)]
        self.acks.clear()
        if pairs:
            self.send([Op.ACK, pairs, self.released] if self.ring else [Op.ACK, pairs])

    def control(self, m: list[Any]) -> None:
        if m[0] != Op.STATS:
            raise RuntimeError(f"unexpected message {m[0]!r}")
        what = m[1]["bench"]
        if what == "start":
            self.phase = m[1]
            self.warm_up = self.phase["warm_up"]
            self.latencies, self.chunks = [], 0
            self.c0, self.m0, self.t0 = cpu_s(), time.thread_time(), time.monotonic()
        elif what == "end":
            self.send_acks()
            assert self.phase is not None
            self.results.append({"name": self.phase["name"], "chunks": self.chunks, "wall_s": time.monotonic() - self.t0,
                                 "cpu_s": cpu_s() - self.c0, "main_thread_cpu_s": time.thread_time() - self.m0,
                                 "latency_ms": summary_ms(self.latencies)})  # fmt: skip
        else:
            self.finished = True


async def gateway_socket(where: Path, consume: str) -> list[dict[str, Any]]:
    reader, writer = await asyncio.open_unix_connection(str(where / "link.sock"))
    g = GatewaySide(lambda m: writer.write(frame(m)), consume)
    decoder = FrameDecoder()
    while not g.finished and (data := await reader.read(LINK_READ_BYTES)):
        for m in decoder.feed(data):
            if m[0] in EVENT_OPS:
                sid, ev = event_of(m)
                g.audio(sid, ev)  # type: ignore[arg-type]
            else:
                g.control(m)
    writer.close()
    return g.results


async def gateway_shm(where: Path, consume: str) -> list[dict[str, Any]]:
    from multiprocessing import resource_tracker, shared_memory

    reader, writer = await asyncio.open_unix_connection(str(where / "link.sock"))
    g = GatewaySide(lambda m: writer.write(frame(m)), consume)
    g.ring = True
    decoder = FrameDecoder()
    shm = None
    while not g.finished and (data := await reader.read(LINK_READ_BYTES)):
        for m in decoder.feed(data):
            if m[0] == Op.AUDIO:
                _, sid, utt, off, n, end = m
                g.audio(sid, AudioChunk(utt, np.frombuffer(shm.buf, np.float32, n // 4, off)))
                g.released = end  # consumed: a real gateway would give it back once its client has read it
            elif m[0] == Op.WELCOME:
                shm = shared_memory.SharedMemory(name=m[1])
                resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]  # the engine's
                int(np.frombuffer(shm.buf, np.uint8)[::4096].sum())  # map its pages here too, before the workloads
            else:
                g.control(m)
    writer.close()
    if shm is not None:
        with contextlib.suppress(BufferError):
            shm.close()
    return g.results


async def gateway_zmq(where: Path, consume: str) -> list[dict[str, Any]]:
    import zmq
    import zmq.asyncio

    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.connect(f"ipc://{where / 'zmq.sock'}")
    g = GatewaySide(lambda m: sock.send(msgpack.packb(m, use_bin_type=True)), consume)
    await sock.send(msgpack.packb([Op.HELLO], use_bin_type=True))
    sync = zmq.Socket.shadow(sock.underlying)  # drains what has arrived without asyncio's per-message future
    while not g.finished:
        payloads = [await sock.recv(copy=False)]
        with contextlib.suppress(zmq.Again):
            while len(payloads) < 64:
                payloads.append(sync.recv(zmq.NOBLOCK, copy=False))
        for payload in payloads:
            m = msgpack.unpackb(payload.buffer, raw=False)
            if m[0] in EVENT_OPS:
                sid, ev = event_of(m)
                g.audio(sid, ev)  # type: ignore[arg-type]
            else:
                g.control(m)
    await asyncio.sleep(0.05)  # the last ACK leaves
    sock.close()
    ctx.term()
    return g.results


def child(role: str, variant: str, where: Path, plan: list[dict[str, Any]], consume: str) -> int:
    if role == "engine":
        result = asyncio.run(serve_engine(variant, where, plan))
    else:
        gateways = {"socket": gateway_socket, "zmq": gateway_zmq, "shm": gateway_shm}
        result = {"phases": asyncio.run(asyncio.wait_for(gateways[variant](where, consume), CHILD_LIMIT_S))}
    print(json.dumps(result), flush=True)
    return 0


# ---- the parent: both processes of each variant, the runs, the table ------------------------------------------------
def run_variant(variant: str, plan: list[dict[str, Any]], consume: str) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    with tempfile.TemporaryDirectory(prefix="fishgate-link-") as tmp:
        base = [sys.executable, "-m", "bench.link_transport", "--variant", variant, "--dir", tmp, "--plan",
                json.dumps(plan), "--consume", consume, "--role"]  # fmt: skip
        with subprocess.Popen([*base, "engine"], stdout=subprocess.PIPE, text=True, cwd=ROOT, env=env) as engine:
            try:
                assert engine.stdout is not None
                if engine.stdout.readline().strip() != "ready":
                    raise RuntimeError(f"the {variant} engine process did not start")
                gateway = subprocess.run([*base, "gateway"], capture_output=True, text=True, cwd=ROOT, env=env,
                                         timeout=CHILD_LIMIT_S, check=False)  # fmt: skip
                engine_out, _ = engine.communicate(timeout=30)
            except BaseException:
                engine.kill()
                raise
        if gateway.returncode or engine.returncode:
            raise RuntimeError(f"{variant}: gateway rc {gateway.returncode}, engine rc {engine.returncode}\n"
                               f"{gateway.stderr[-3000:]}")  # fmt: skip
    g = json.loads(gateway.stdout.strip().splitlines()[-1])
    e = json.loads(engine_out.strip().splitlines()[-1])
    phases = {}
    frames = {p["name"]: p["frames"] for p in plan}
    for gp, ep in zip(g["phases"], e["phases"], strict=True):
        chunks = gp["chunks"]
        chunk_bytes = frames[gp["name"]] * SAMPLES_PER_FRAME * 4
        phases[gp["name"]] = {
            "chunks": chunks,
            "chunks_sent": ep["chunks"],
            "latency_ms": gp["latency_ms"],
            "gateway_cpu_s_per_s": gp["cpu_s"] / gp["wall_s"],
            "engine_cpu_s_per_s": ep["cpu_s"] / ep["wall_s"],
            "gateway_cpu_us_per_chunk": 1e6 * gp["cpu_s"] / max(chunks, 1),
            "engine_cpu_us_per_chunk": 1e6 * ep["cpu_s"] / max(ep["chunks"], 1),
            # the rest of each process's CPU ran on its other threads (zmq's I/O thread)
            "gateway_main_thread_share": gp["main_thread_cpu_s"] / gp["cpu_s"] if gp["cpu_s"] else None,
            "engine_main_thread_share": ep["main_thread_cpu_s"] / ep["cpu_s"] if ep["cpu_s"] else None,
            "wall_s": gp["wall_s"],
            "mb_per_s": chunks * chunk_bytes / gp["wall_s"] / 1e6,
        }
    return {"phases": phases, **({"ring_waits": e["ring_waits"]} if "ring_waits" in e else {})}


FIGURES = {  # name → (how to get it from a phase's result, format)
    "p50 ms": (lambda p: p["latency_ms"]["p50"], "{:.2f}"),
    "p95 ms": (lambda p: p["latency_ms"]["p95"], "{:.2f}"),
    "max ms": (lambda p: p["latency_ms"]["max"], "{:.1f}"),
    "gateway CPU s/s": (lambda p: p["gateway_cpu_s_per_s"], "{:.3f}"),
    "gateway µs/chunk": (lambda p: p["gateway_cpu_us_per_chunk"], "{:.0f}"),
    "engine CPU s/s": (lambda p: p["engine_cpu_s_per_s"], "{:.3f}"),
    "engine µs/chunk": (lambda p: p["engine_cpu_us_per_chunk"], "{:.0f}"),
}


def summarize(runs: list[dict[str, Any]], plan: list[dict[str, Any]]) -> dict[str, Any]:
    """Per phase and variant, each figure's median and range across runs."""
    out: dict[str, Any] = {}
    for phase in (p["name"] for p in plan):
        for variant in VARIANTS:
            results = [r[variant]["phases"][phase] for r in runs if "phases" in r.get(variant, {})]
            if not results:
                continue
            figures = {}
            for name, (get, _) in FIGURES.items():
                values = [v for v in map(get, results) if v is not None]
                if values:
                    figures[name] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
            out.setdefault(phase, {})[variant] = figures
    return out


def table(summary: dict[str, Any], n_runs: int) -> str:
    def cell(f: dict[str, float], fmt: str) -> str:
        if n_runs == 1:
            return fmt.format(f["median"])
        return f"{fmt.format(f['median'])} [{fmt.format(f['min'])}–{fmt.format(f['max'])}]"

    head = "| workload | transport | " + " | ".join(FIGURES) + " |"
    lines = [head, "|" + "---|" * (len(FIGURES) + 2)]
    for phase, variants in summary.items():
        for variant, figures in variants.items():
            cells = [cell(figures[n], fmt) if n in figures else "" for n, (_, fmt) in FIGURES.items()]
            lines.append(f"| {phase} | {variant} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--load-s", type=float, default=10.0)
    ap.add_argument("--consume", choices=("none", "s16"), default="none")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--quick", action="store_true", help="a fraction of a second a workload: checks the script")
    # a child process's
    ap.add_argument("--role", choices=("engine", "gateway"), help=argparse.SUPPRESS)
    ap.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)
    ap.add_argument("--dir", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--plan", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.role:
        return child(args.role, args.variant, args.dir, json.loads(args.plan), args.consume)
    if args.out is None:
        ap.error("--out is required")
    variants = [v for v in args.variants.split(",") if v]
    if unknown := set(variants) - set(VARIANTS):
        ap.error(f"unknown variants {sorted(unknown)}")
    plan = plan_of(args.quick, args.load_s)
    skipped = {}
    if "zmq" in variants and not zmq_available():
        skipped["zmq"] = ZMQ_MISSING
        print(f"note: {skipped['zmq']}", file=sys.stderr)
    runnable = [v for v in variants if v not in skipped]
    loads = [os.getloadavg()[0]]
    started = time.monotonic()
    runs = []
    for i in range(args.runs):
        order = runnable[i % len(runnable) :] + runnable[: i % len(runnable)] if runnable else []
        run: dict[str, Any] = {"order": order}
        for variant in order:
            run[variant] = run_variant(variant, plan, args.consume)
        runs.append(run)
        loads.append(os.getloadavg()[0])
    summary = summarize(runs, plan)
    result = {
        "plan": plan,
        "consume": args.consume,
        "quick": args.quick,
        "variants": {v: {"skipped": skipped[v]} if v in skipped else {"measured": True} for v in variants},
        "summary": summary,
        "runs": runs,
        "seconds": time.monotonic() - started,
        "machine": {
            "cpus": os.cpu_count(),
            "load_avg_1m": loads,
            "python": platform.python_version(),
            "msgpack": msgpack.version,
            "pyzmq": _zmq_versions(),
        },
    }
    text = table(summary, args.runs)
    for v, why in skipped.items():
        text += f"\n\n{v}: {why}"
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "link_transport.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / "link_transport.md").write_text(text + "\n")
    return 0


def _zmq_versions() -> str | None:
    if not zmq_available():
        return None
    import zmq

    return f"pyzmq {zmq.__version__}, libzmq {zmq.zmq_version()}"


if __name__ == "__main__":
    raise SystemExit(main())

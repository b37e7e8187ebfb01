"""What the engine link costs: first audio at batch 1, and each audio chunk's added latency, through a resident engine
process (`fishgate engine` + streaming.engine_link.client.RemoteEngine) against an engine in this process:

    python -m bench.engine_link --out OUT_DIR [--utterances 20] [--device auto] [--checkpoint DIR]

Both sides speak the same seeded utterances one at a time (batch 1) on the device at hand, the in-process engine
first, then the engine process (started here, SIGTERM-ed at the end). First audio: from the utterance's text to its
first AudioChunk out of `Session.next_event()`, as the server reads it. A chunk's added latency: from the moment the
engine process starts encoding its AUDIO frame to the moment `next_event()` returns it here (CLOCK_MONOTONIC is one
clock for both processes); the in-process path has no such hop. Prints a table, writes OUT_DIR/engine_link.json.
A 2-core CPU gives numbers that move with other load: run it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import logging
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

TEXT = "Hello there, this is a short sentence for the benchmark."
WARM_UP_UTTERANCES = 2
READY_LIMIT_S = 300.0  # a full-size model compiles its decode step before ready (~100 s cold on an H100)


def percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def summary_ms(values_s: list[float]) -> dict[str, Any]:
    ms = [1000 * v for v in values_s]
    return {"n": len(ms), "p50": percentile(ms, 50), "p95": percentile(ms, 95), "max": max(ms, default=None),
            "mean": statistics.fmean(ms) if ms else None}  # fmt: skip


async def speak_once(
    engine: Any, seed: int, frames: int | None = None
) -> tuple[float, list[tuple[int, int, float]], np.ndarray]:
    """One utterance: (first audio s, [(session id, chunk index, arrival time)], its PCM)."""
    from streaming.session import AudioChunk, SessionError, SynthesisSettings, UtteranceDone, Voice

    limit = {} if frames is None else {"max_new_tokens": frames}
    session = await engine.admit(Voice(), SynthesisSettings(seed=seed, **limit))
    arrivals, pcm = [], []
    t0 = time.monotonic()
    session.speak(TEXT)
    session.end_utterance()
    while True:
        ev = await asyncio.wait_for(session.next_event(), 120)
        now = time.monotonic()
        if isinstance(ev, AudioChunk):
            arrivals.append((session.id, len(arrivals), now))
            pcm.append(ev.pcm)
        elif isinstance(ev, SessionError):
            raise RuntimeError(f"{ev.code}: {ev.message}")
        elif isinstance(ev, UtteranceDone):
            break
    session.close()
    return arrivals[0][2] - t0, arrivals, np.concatenate(pcm)


async def run_side(engine: Any, utterances: int, frames: int | None) -> dict[str, Any]:
    for i in range(WARM_UP_UTTERANCES):
        await speak_once(engine, 10_000 + i, frames)
    first, arrivals, audio = [], [], []
    for i in range(utterances):
        f, a, pcm = await speak_once(engine, i, frames)
        first.append(f)
        arrivals += a
        audio.append(pcm)
    return {"first_audio_s": first, "arrivals": arrivals, "audio": audio}


async def in_process(args: argparse.Namespace) -> dict[str, Any]:
    # the configuration `fishgate engine` runs (the default profile; its compile cache where the CLI's would be, so
    # that on a GPU the engine process below starts on the graphs this one compiled)
    from server.settings import Settings
    from streaming import profiles
    from streaming.engine import Engine, EngineConfig

    cache = Settings().resolved_compile_cache_dir
    backend = profiles.backend_config(checkpoint=args.checkpoint, device=args.device, compile_cache_dir=cache)
    engine = Engine(EngineConfig(backend, profiles.worker_limits()))
    engine.start()
    try:
        if not await asyncio.to_thread(engine.wait_ready, READY_LIMIT_S):
            raise RuntimeError(f"the engine did not start: {engine.fault}")
        out = await run_side(engine, args.utterances, args.frames)
        out["device"] = engine.info.device if engine.info else "?"
        return out
    finally:
        engine.stop()


async def remote(args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    from streaming.engine_link.client import RemoteEngine

    address, stamps = f"unix:{folder / 'engine.sock'}", folder / "stamps.json"
    cmd = [sys.executable, "-m", "bench.engine_link", "--engine-child", address, str(stamps), "--device", args.device]
    if args.checkpoint is not None:
        cmd += ["--checkpoint", str(args.checkpoint)]
    log = open(folder / "engine.log", "wb")  # noqa: SIM115 - the child's for its whole life
    child = subprocess.Popen(cmd, stdout=log, stderr=log)
    engine = RemoteEngine(address)
    engine.start()
    try:
        deadline = time.monotonic() + READY_LIMIT_S
        while not engine.ready:
            if child.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the engine process did not start; see {folder / 'engine.log'}")
            await asyncio.sleep(0.05)
        out = await run_side(engine, args.utterances, args.frames)
    finally:
        engine.stop()
        child.send_signal(signal.SIGTERM)
        child.wait(60)
        log.close()
    sent = {(sid, k): t for sid, k, t in json.loads(stamps.read_text())}
    out["added_s"] = [t - sent[(sid, k)] for sid, k, t in out["arrivals"] if (sid, k) in sent]
    return out


def engine_child(address: str, stamps: Path, rest: list[str]) -> int:
    """`fishgate engine` with each AUDIO frame's start time noted (session id, chunk index, CLOCK_MONOTONIC)."""
    from server.cli import main
    from streaming.engine_link import host
    from streaming.session import AudioChunk

    noted: list[tuple[int, int, float]] = []
    chunks: collections.Counter[int] = collections.Counter()
    encode = host.event_frame

    def event_frame(sid: int, ev: Any) -> bytes:
        if isinstance(ev, AudioChunk):
            noted.append((sid, chunks[sid], time.monotonic()))
            chunks[sid] += 1
        return encode(sid, ev)

    host.event_frame = event_frame  # type: ignore[assignment]
    code = main(["engine", "--listen", address, "--log-level", "warning", *rest])
    stamps.write_text(json.dumps(noted))
    return code


def table(local: dict[str, Any], far: dict[str, Any]) -> str:
    a, b = summary_ms(local["first_audio_s"]), summary_ms(far["first_audio_s"])
    c = summary_ms(far["added_s"])

    def f(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f}"

    same = all(np.array_equal(x, y) for x, y in zip(local["audio"], far["audio"], strict=True))
    rows = [
        ("first audio p50 (ms)", f(a["p50"]), f(b["p50"]), f(None if b["p50"] is None else b["p50"] - a["p50"])),
        ("first audio p95 (ms)", f(a["p95"]), f(b["p95"]), f(None if b["p95"] is None else b["p95"] - a["p95"])),
        ("chunk added latency p50 / p95 / max (ms)", "-", f"{f(c['p50'])} / {f(c['p95'])} / {f(c['max'])}", ""),
        ("chunks", str(len(local["arrivals"])), str(len(far["arrivals"])), ""),
        ("same audio (seeded)", "", "yes" if same else "NO", ""),
    ]
    lines = ["| | in-process | engine process | difference |", "|---|---|---|---|"]
    lines += [f"| {r[0]} | {r[1]} | {r[2]} | {r[3]} |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--engine-child"]:
        return engine_child(argv[1], Path(argv[2]), argv[3:])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="output folder")
    ap.add_argument("--utterances", type=int, default=20, help="measured utterances a side (after 2 warm-up ones)")
    ap.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    ap.add_argument("--checkpoint", type=Path, default=None, help="model folder (default: the embedded model)")
    ap.add_argument(
        "--frames",
        type=int,
        default=None,
        help="cap each utterance at this many frames (a random-weight "
        "checkpoint never ends alone; bench.make_checkpoint's needs it)",
    )
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)  # the gateway's "unreachable" while the engine process starts is expected
    args.out.mkdir(parents=True, exist_ok=True)
    local = asyncio.run(in_process(args))
    with tempfile.TemporaryDirectory(prefix="fg-bench-") as tmp:  # short: a Unix socket path has at most 107 bytes
        far = asyncio.run(remote(args, Path(tmp)))
        (args.out / "engine.log").write_bytes((Path(tmp) / "engine.log").read_bytes())
    text = table(local, far)
    result = {
        "what": "bench.engine_link", "device": local["device"], "cpus": os.cpu_count(), "utterances": args.utterances,
        "text": TEXT, "first_audio_ms": {"in_process": summary_ms(local["first_audio_s"]),
                                         "engine_process": summary_ms(far["first_audio_s"])},
        "chunk_added_ms": summary_ms(far["added_s"]), "table": text,
    }  # fmt: skip
    (args.out / "engine_link.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"device {local['device']}, {args.utterances} utterances a side, batch 1\n{text}")
    print(f"wrote {args.out / 'engine_link.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

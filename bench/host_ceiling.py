"""The gateway's host ceiling: `fishgate serve` with the GPU replaced by a timed stand-in, driven by `fishgate ttfa`.

On the H200 (docs/BENCHMARKS.md) the decode graphs alone sustain ~760 real-time streams at batch 256, yet the whole
server saturated at ~80–110× real time: the host (one Python process: event loop + engine worker thread) is the
bottleneck. This bench reproduces that host on any CPU. Everything real stays real — uvicorn, the live WebSocket
protocol, the segmenter, the engine's worker thread and scheduler, audio encoding, and `fishgate ttfa` clients in
their own process — and only the device work is replaced by sleeps of the H200's measured times (a sleep releases
the GIL, as a CUDA synchronize does): the decode step per batch bucket, each vocoder call by rows × frames, and
prefill per call and token, and first-frame sampling per call. Frames are random semantic codes (the end token never comes, as in the GPU runs), audio is
silence of the right length, and the embedded default model supplies tokenizer and prompt shapes.

If this server saturates far below what its stand-in device could carry, the ceiling is host work, and it can be
found and fixed on a CPU (add `--profile-level N` for a py-spy profile of the server during level N).

    python bench/host_ceiling.py --levels 16 64 128 --frames 200 --out build/host_ceiling
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import functools
import json
import math
import random
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.turn_attribution import attribution, counters_from_text  # noqa: E402
from model.stepper import decode_batch_buckets  # noqa: E402
from streaming.backend import Backend  # noqa: E402
from streaming.config import BackendConfig, WorkerLimits  # noqa: E402

# H200 graph times, bf16, full-size Fish 1.5 (docs/BENCHMARKS.md): decode step by batch bucket (run 3) ...
DECODE_MS = {1: 6.44, 8: 7.15, 64: 8.78, 256: 15.61, 1024: 44.22}
# ... and a vocoder call ≈ base + per frame × rows × frames (fit to run 1: 1×8 2.65, 8×24 10.81, 64×24 78.7 ms)
VOCODER_BASE_MS, VOCODER_FRAME_MS = 2.3, 0.0495
# eager prefill and first-frame sampling, fit to H200 run 7 (`fishgate_engine{what="prefill_seconds"}`): one
# ~103-token prompt after a cached voice prefix cost ~120 ms a request at concurrency 1, and a burst of 64 prompts
# 1.19 s in ~7 turns of ≤ 1,024 tokens (~170 ms a turn). Both are launch-bound eager calls (~36 µs a kernel on that
# host), so a call costs much the same whatever it holds: 60 ms + 50 µs a token for the prefill, 50 ms for the
# first frames. (Before run 7 this model assumed 8 ms + 20 µs a token and no first-frame cost.)
PREFILL_BASE_MS, PREFILL_TOKEN_MS = 60.0, 0.05
FIRST_FRAMES_MS = 50.0
FRAME_S = 2048 / 44100
# `--cost-model run17`: the device as the H200 measured it in runs 12-17, for today's defaults. Decode step: the
# compiled regions (run 12: 1, 8, 64, 256 rows; the one-row bucket tuned, run 14); 1,024 rows scaled from run 3's
# eager 256 → 1,024 ratio (never measured compiled). Vocoder: every graph the engine captures, timed in run 17
# (`bench.vocoder_variants --shapes engine`, the channels-last layout `on`), each call on its cheapest plan as the
# engine's timed dispatch picks it. Prefill: graph prefill, `--prefill-ms 5 3` unless given.
DECODE_MS_RUN17 = {1: 2.64, 8: 4.57, 64: 6.28, 256: 8.93, 1024: 8.93 * 44.22 / 15.61}
RUN17_VOCODER_SHAPES = ROOT / "bench" / "results" / "run17_call5_engine_shapes_on.json"
REROUTE_BELOW = 0.7  # model.vocoder_graphs: a call moves to another plan only when it costs under this share


def decode_ms(bucket: int, table: dict[int, float] = DECODE_MS) -> float:
    """Log-log interpolation between the measured buckets."""
    sizes = sorted(table)
    bucket = min(max(bucket, sizes[0]), sizes[-1])
    i = min(bisect.bisect_left(sizes, bucket), len(sizes) - 1)
    if sizes[i] == bucket:
        return table[bucket]
    lo, hi = sizes[i - 1], sizes[i]
    w = (math.log(bucket) - math.log(lo)) / (math.log(hi) - math.log(lo))
    return math.exp((1 - w) * math.log(table[lo]) + w * math.log(table[hi]))


def vocoder_ms(rows: int, frames: int) -> float:
    return VOCODER_BASE_MS + VOCODER_FRAME_MS * rows * frames


def measured_vocoder_ms(path: Path = RUN17_VOCODER_SHAPES) -> Callable[[int, int], float]:
    """A call of `rows` × `frames` (rows ≤ the largest bucket) at the cost of its cheapest plan among the measured
    graphs: its own bucket, a larger bucket, or several replays of a smaller one (model.vocoder_graphs)."""
    shapes = {(r["batch"], r["frames"]): r["ms"] for r in json.loads(path.read_text())["rows"]}

    @functools.cache
    def cost(rows: int, frames: int) -> float:
        buckets = sorted(b for b, f in shapes if f == frames)
        own = next(b for b in buckets if b >= rows)
        plans = [shapes[(b, frames)] for b in buckets if b > own]
        plans += [math.ceil(rows / b) * shapes[(b, frames)] for b in buckets if b < own]
        best = min(plans, default=math.inf)
        return best if best < REROUTE_BELOW * shapes[(own, frames)] else shapes[(own, frames)]

    return cost


def stand_in_capacity(streams: int) -> float:
    """Device seconds per second of audio that `streams` real-time streams need from the stand-in (24-frame chunks
    in calls of ≤ 64 rows); below 1 the stand-in device keeps up."""
    buckets = decode_batch_buckets(max(streams, 1024))  # the engine's graph sizes
    bucket = buckets[bisect.bisect_left(buckets, streams)]
    rows = min(streams, 64)
    call = TimedStandIn.vocoder_call_ms
    call_ms = call(rows, 24) if call is not None else vocoder_ms(rows, 24)
    per_frame_s = (decode_ms(bucket, TimedStandIn.decode_table) + streams * call_ms / (24 * rows)) / 1e3
    return per_frame_s / FRAME_S


def use_cost_model(name: str) -> None:
    """--cost-model: set the stand-in's device times (in the server process and the driver's table alike)."""
    if name == "run17":
        TimedStandIn.decode_table = DECODE_MS_RUN17
        TimedStandIn.vocoder_call_ms = staticmethod(measured_vocoder_ms())  # type: ignore[assignment]
    else:
        TimedStandIn.decode_table, TimedStandIn.vocoder_call_ms = DECODE_MS, None


class TimedStandIn(Backend):
    """The engine's backend with device work replaced by GIL-free sleeps of measured H200 times."""

    scale = 1.0  # every device time × this (--device-scale: a slower device, so that few streams load it)
    prefill_base_ms, first_frames_ms = PREFILL_BASE_MS, FIRST_FRAMES_MS  # --prefill-ms (graph prefill is far less)
    decode_table = DECODE_MS  # --cost-model
    vocoder_call_ms: Callable[[int, int], float] | None = None  # rows, frames → ms (None: the fit, padded)

    def __init__(self, config: BackendConfig) -> None:
        # as on the GPU: no batch invariance, so prompts of a turn share one prefill call
        super().__init__(dataclasses.replace(config, device="cpu", cuda_graphs=False, batch_invariant=False))
        c = self.model.config
        self._codes = (c.num_codebooks, c.codebook_size, self.model.semantic_begin_id)
        self._rng = np.random.default_rng(0)

    def _frames(self, rows: int) -> np.ndarray:
        nc, cs, begin = self._codes
        codes = self._rng.integers(0, cs, (rows, nc), dtype=np.int64)
        return np.concatenate([codes[:, :1] + begin, codes], axis=1)

    def prefill_many(
        self, rows: Sequence[int], prompts: Sequence[torch.Tensor], start_positions: Sequence[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(self.scale * (self.prefill_base_ms + PREFILL_TOKEN_MS * sum(p.shape[-1] for p in prompts)) / 1e3)
        placeholder = torch.zeros(len(rows), 1)  # start_segments below does not read them
        return placeholder, placeholder

    def start_segments(
        self, rows: Sequence[int], logits: torch.Tensor, hidden: torch.Tensor, next_positions: Sequence[int]
    ) -> np.ndarray:
        time.sleep(self.scale * self.first_frames_ms / 1e3)
        return self._frames(len(rows))

    def step(
        self, rows: int, commit: Sequence[bool], max_pos: int, while_running: Callable[[], None] | None = None
    ) -> np.ndarray:
        buckets = self.stepper.batch_buckets  # the GPU's captured graphs run padded to these
        time.sleep(self.scale * decode_ms(buckets[bisect.bisect_left(buckets, rows)], self.decode_table) / 1e3)
        if while_running is not None:  # serial on the stand-in (its vocoder runs in vocode): nothing is in flight
            while_running()
        return self._frames(rows)

    def vocode(self, slots: Sequence[int], codes: Sequence[np.ndarray]) -> list[np.ndarray]:
        groups: dict[int, int] = {}
        for c in codes:
            groups[c.shape[1]] = groups.get(c.shape[1], 0) + 1
        buckets = self.vocoder_buckets  # the GPU's vocoder graphs run padded to these
        for frames, rows in groups.items():  # one call per chunk length and per ≤ 64 rows, as the real backend
            for start in range(0, rows, self.vocoder_batch):
                n = min(self.vocoder_batch, rows - start)
                padded = buckets[bisect.bisect_left(buckets, n)]
                call = self.vocoder_call_ms
                time.sleep(self.scale * (call(n, frames) if call is not None else vocoder_ms(padded, frames)) / 1e3)
                self.vocode_calls += 1
                self.vocode_frames_run += padded * frames
        spf = self.info.samples_per_frame
        return [np.zeros(c.shape[1] * spf, dtype=np.float32) for c in codes]

    def swap_rows(self, a: int, b: int, length_a: int, length_b: int) -> None:
        pass  # a device-side copy: asynchronous on the GPU

    def permute_rows(self, dst: list[int], src: list[int], length: int) -> None:
        pass  # likewise (on this CPU it copied the stand-in's real KV cache: a fifth of the worker's time in py-spy)

    def copy_prefix(self, src: int, dst: int, length: int) -> None:
        pass

    def reset_vocoder(self, slot: int) -> None:
        pass

    def capture_graphs(self) -> int:
        return 0

    def capture_idle_graph(self, row_positions: Sequence[int]) -> bool:
        return False


# ---- the server process ------------------------------------------------------------------------------------------------
def serve(argv: list[str]) -> int:
    """`fishgate serve` arguments after a JSON object {"limits": WorkerLimits fields, "backend": BackendConfig
    fields} (the engine knobs this bench compares)."""
    from server import cli
    from server.settings import build_parser, settings_from
    from streaming.engine import Engine, EngineConfig

    spec = json.loads(argv[0])
    TimedStandIn.scale = float(spec.get("device_scale", 1.0))
    TimedStandIn.prefill_base_ms, TimedStandIn.first_frames_ms = spec.get(
        "prefill_ms", [PREFILL_BASE_MS, FIRST_FRAMES_MS]
    )
    use_cost_model(spec.get("cost_model", "run7"))
    limits = WorkerLimits(**spec["limits"])
    args = build_parser(argparse.ArgumentParser()).parse_args(argv[1:])
    settings = settings_from(args)
    config = BackendConfig(max_sessions=settings.max_sessions, max_seq_len=settings.max_seq_len, **spec["backend"])
    return cli.serve(args, Engine(EngineConfig(config, limits, backend_factory=TimedStandIn)))


# ---- the driver ----------------------------------------------------------------------------------------------------------
def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def write_texts(path: Path) -> None:
    rng = random.Random(0)
    words = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven", "bright", "stars",
             "shine", "above", "quiet", "hills"]  # fmt: skip
    lines = [f"Request {i}: " + " ".join(rng.choice(words) for _ in range(14)) + "." for i in range(2000)]
    path.write_text("\n".join(lines) + "\n")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_level(
    base: str, level: int, frames: int, texts: Path, out: Path, profile_s: float | None, server_pid: int,
    waves: int = 1, ramp_s: float = 0.0,
):  # fmt: skip
    before = counters_from_text(get(base + "/metrics"))
    spy = None
    if profile_s is not None and shutil.which("py-spy"):
        spy = subprocess.Popen(
            ["bash", "-c", f"sleep {min(8.0, frames * FRAME_S / 2):.1f}; exec py-spy record -p {server_pid} "
             f"-d {profile_s:.0f} -r 100 --threads --format raw -o {out / f'spy_{level}.txt'} --nonblocking"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
    t0 = time.perf_counter()
    ttfa_out = out / f"ttfa_{level}"
    cmd = [
        sys.executable, "-m", "server.cli", "ttfa", base.replace("http", "ws") + "/v1/tts/live",
        "--concurrency", str(level), "--requests", str(max(level * waves, 8)), "--max-new-tokens", str(frames),
        "--ramp-s", str(ramp_s),
        "--texts", str(texts), "--no-plots", "--timeout-s", "600", "--out", str(ttfa_out),
    ]  # fmt: skip
    # the admission's gauges and each half second's turns through the level (bench/metrics_series.py)
    series = out / f"series_{level}.jsonl"
    sampler = subprocess.Popen(
        [sys.executable, "-m", "bench.metrics_series", base + "/metrics", "--out", str(series)], cwd=ROOT
    )
    # fishgate ttfa exits 1 when any request failed (refusals under admission, say): its JSON still has them all
    subprocess.run(cmd, cwd=ROOT, check=False, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    sampler.terminate()
    sampler.wait(timeout=10)
    wall = time.perf_counter() - t0
    after = counters_from_text(get(base + "/metrics"))
    if spy is not None:
        spy.wait(timeout=120)
    summary = json.loads((ttfa_out / "ttfa.json").read_text())["levels"][0]["summary"]
    turns = attribution(before, after)
    device_s = sum(after.get(k, 0) - before.get(k, 0) for k in ("prefill_seconds", "step_seconds", "vocode_seconds"))
    return {
        "level": level, "wall_s": wall, "summary": summary, "turns": turns,
        "turns_per_s": turns["turns"] / wall, "device_busy": device_s / wall,
        "stand_in_need": stand_in_capacity(level) * TimedStandIn.scale,
        "streams_real_time": summary["audio_s_total"] / wall,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:
        return serve(argv[1:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--levels", type=int, nargs="+", default=[16, 64, 128])
    parser.add_argument("--frames", type=int, default=200, help="frames per request (9.3 s of audio at 200)")
    parser.add_argument("--max-sessions", type=int, default=256)
    parser.add_argument("--waves", type=int, default=1, help="requests per client worker (1: one burst per level)")
    parser.add_argument("--ramp-s", type=float, default=0.0, help="spread the workers' first requests (fishgate ttfa)")
    parser.add_argument(
        "--limit", action="append", default=[], metavar="FIELD=VALUE",
        help="a WorkerLimits field for the engine (JSON value, e.g. refill_below_s=null); repeatable",
    )  # fmt: skip
    parser.add_argument("--profile-level", type=int, help="py-spy the server during this level")
    parser.add_argument("--profile-s", type=float, default=10.0)
    parser.add_argument(
        "--half-step-vocoder-buckets", action="store_true", help="BackendConfig.vocoder_half_step_buckets"
    )
    parser.add_argument("--device-scale", type=float, default=1.0, help="every stand-in device time × this")
    parser.add_argument(
        "--cost-model",
        choices=("run7", "run17"),
        default="run7",
        help="the device's times: runs 1-7's (default, comparable with earlier stand-in runs) or runs 12-17's "
        "(compiled step, the channels-last vocoder's 72 graphs, graph prefill)",
    )
    parser.add_argument(
        "--prefill-ms",
        type=float,
        nargs=2,
        default=None,
        metavar=("CALL", "FIRST"),
        help="a prefill call's fixed cost and the first-frame sampling's (default: run 7's eager figures; 5 3, "
        "graph prefill, with --cost-model run17)",
    )
    parser.add_argument("--out", type=Path, default=ROOT / "build" / "host_ceiling")
    args = parser.parse_args(argv)
    if args.prefill_ms is None:
        args.prefill_ms = [5.0, 3.0] if args.cost_model == "run17" else [PREFILL_BASE_MS, FIRST_FRAMES_MS]
    TimedStandIn.scale = args.device_scale  # for the table's "stand-in need" (the server gets it in its spec)
    use_cost_model(args.cost_model)
    args.out.mkdir(parents=True, exist_ok=True)
    texts = args.out / "texts.txt"
    write_texts(texts)
    limits = {k: json.loads(v) for k, v in (item.split("=", 1) for item in args.limit)}
    WorkerLimits(**limits)  # unknown fields fail here, not in the server
    backend = {"vocoder_half_step_buckets": True} if args.half_step_vocoder_buckets else {}
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = (args.out / "server.log").open("w")
    server = subprocess.Popen(
        [sys.executable, __file__, "serve", json.dumps({"limits": limits, "backend": backend, "device_scale": args.device_scale, "prefill_ms": args.prefill_ms, "cost_model": args.cost_model}), "--port", str(port),
         "--max-sessions", str(args.max_sessions), "--max-seq-len", "1024", "--rate-limit-per-min", "1000000",
         "--log-level", "warning"],
        cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    rows = []
    try:
        for _ in range(300):
            try:
                if json.loads(get(base + "/readyz")).get("ready"):
                    break
            except OSError:
                pass
            if server.poll() is not None:
                raise SystemExit(f"server exited; see {args.out / 'server.log'}")
            time.sleep(0.5)
        print("| conc | RT streams | stand-in need | device busy | turns/s | ms/turn = step + vocode + prefill + rest "
              "| TTFA p50 / p95 ms | underrun |")  # fmt: skip
        print("|---|---|---|---|---|---|---|---|")
        for level in args.levels:
            profile = args.profile_s if level == args.profile_level else None
            r = run_level(base, level, args.frames, texts, args.out, profile, server.pid, args.waves, args.ramp_s)
            rows.append(r)
            s, t = r["summary"], r["turns"]
            print(
                f"| {level} | {r['streams_real_time']:.1f} | {r['stand_in_need']:.2f} | {r['device_busy']:.2f} | "
                f"{r['turns_per_s']:.1f} | {t['turn_ms']:.1f} = {t['step_ms']:.1f} + {t['vocode_ms']:.1f} + "
                f"{t['prefill_ms']:.1f} + {t['rest_ms']:.1f} | {s['ttfa_p50_ms']:.0f} / {s['ttfa_p95_ms']:.0f} | "
                f"{s['underrun_rate']:.0%} |",
                flush=True,
            )
    finally:
        server.terminate()
        server.wait(timeout=30)
        log.close()
    (args.out / "host_ceiling.json").write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

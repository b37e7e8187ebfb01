"""The headline GPU figures of docs/BENCHMARKS.md in one command, for this tree and, side by side, a baseline tree:

    python -m bench.gpu --out OUT_DIR [--baseline-tree PATH]

1. A full-size Fish 1.5 checkpoint with random weights and a stored voice (bench/make_checkpoint.py), written once
   into OUT_DIR and checked: its bf16 model against fp32 on the same weights (bench/gpu_model_check.py).
2. Per tree, one after the other: the decode step alone at batch 1 (bench/step.py, the tree's own model code);
   then that tree's `fishgate serve` with the throughput settings: start -> ready, first audio of one stream, N
   client-default streams (`fishgate ttfa` as browsers, pipecat and LiveKit connect: deflate offered, one socket
   per client; each client sends WAVES requests of FRAMES frames, the first ones spread over RAMP_S), the turn
   split and GPU memory under that load. Without a baseline the server is then started again on its warm
   compile cache (restart -> ready).
3. A table, the trees side by side, printed and written to OUT_DIR/summary.md; everything in OUT_DIR/summary.json
   (rewritten after each tree), each level's ttfa.json, the servers' logs.

The load client and the measuring scripts always come from this checkout; only the model and the server come
from each tree. One H100: about 7 minutes alone, about 9 with a baseline (two server start-ups: ~145 s on an empty
compile cache, less where the second tree's code compiles to what the first's did); `--limit-s` skips what no longer
fits.
`--tiny` runs the same plan on CPU with a tiny model: a check of the script, not a figure.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.serving import (
    ROOT,
    Server,
    ServerFailed,
    Tree,
    add_tree_arguments,
    client_env,
    engine_value,
    keep_known,
    number,
    run_level,
    server_flags,
    side_by_side,
    tree_env,
    trees_from,
)
from bench.step import FRAME_RATE_HZ
from bench.turn_attribution import attribution, counters_from_text

# The settings behind every stream figure in docs/BENCHMARKS.md (README "Performance"): every batch bucket up to
# 512 rows compiled, half-step vocoder buckets, the channels-last vocoder, real-time admission at 0.9 of a frame.
THROUGHPUT_SERVE_ARGS = (
    "--max-sessions", "512", "--max-seq-len", "4096", "--compile-max-batch", "512", "--compile-tune-single-row", "off",
    "--vocoder-half-step-buckets", "on", "--vocoder-channels-last", "on", "--admission-turn-fraction", "0.9",
)  # fmt: skip
DEFAULT_SERVE_ARGS = ("--max-sessions", "512", "--max-seq-len", "4096")  # the start-up figures' configuration
# the requests' texts: 14 random words each (a segment's length is set by --max-new-tokens: the bench checkpoint's
# end token is unreachable)
WORDS = ("the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven", "bright", "stars",
         "shine", "above", "quiet", "hills", "near", "river")  # fmt: skip
VOICE = "bench-voice"  # bench/make_checkpoint.py's stored voice: ~650 frames, so streams decode at positions 1,000+
ROWS = ("step", "first_audio", "streams", "restart")
READY_LIMIT_S = 400.0  # a cold start compiles every bucket up to 512 rows: 100-160 s on an H100 or H200
STEP_LIMIT_S = 420.0  # the tuned one-row step compiles for about a minute on an empty cache
WARM_UP_STREAMS, WARM_UP_FRAMES = 16, 80  # one request each: first-use captures happen before anything is timed
GRAPH_WAIT_S = 60.0  # then idle until the engine's idle-time captures are done, at most this long
FIRST_AUDIO_REQUESTS = 10  # one stream, requests one after another
TINY_REQUESTS = 2  # --tiny: warm-up streams and first-audio requests (a tiny model on CPU is slow to sample)
REQUEST_TIMEOUT_S = 30.0  # `fishgate ttfa --timeout-s`: a request that takes longer counts as not served


@dataclass(frozen=True, slots=True)
class Plan:
    """What one call measures, the same for every tree."""

    out: Path
    device: str
    serve_args: tuple[str, ...]  # the settings: a flag a tree's server lacks is dropped for that tree (and named)
    extra_serve_args: tuple[str, ...]  # the caller's: passed as they are
    client_args: tuple[str, ...]
    rows: frozenset[str]
    step_batches: str
    streams: tuple[int, ...]  # one level each, in turn on the same server
    waves: int
    ramp_s: float
    frames: int
    deadline: float | None  # time.monotonic() past which no phase starts
    warm_up: tuple[int, int] = (WARM_UP_STREAMS, WARM_UP_FRAMES)  # streams, frames
    first_audio_requests: int = FIRST_AUDIO_REQUESTS

    @property
    def checkpoint(self) -> Path:
        return self.out / "checkpoint"

    @property
    def refs(self) -> Path:
        return self.out / "voices"

    def left_s(self) -> float:
        return float("inf") if self.deadline is None else self.deadline - time.monotonic()


def prepare(plan: Plan, tiny: bool, check: bool) -> dict[str, Any]:
    """The checkpoint, its check and the request texts, once for every tree."""
    info: dict[str, Any] = {}
    if not (plan.checkpoint / "model.safetensors").is_file():
        t0 = time.perf_counter()
        cmd = [sys.executable, "-m", "bench.make_checkpoint", str(plan.checkpoint), str(plan.refs)]
        subprocess.run([*cmd, *(["--tiny"] if tiny else [])], cwd=ROOT, env=client_env(), check=True)
        info["checkpoint_write_s"] = round(time.perf_counter() - t0, 1)
    if check:
        path = plan.out / "check.json"
        cmd = [sys.executable, "-m", "bench.gpu_model_check", "--checkpoint", str(plan.checkpoint), "--out", str(path)]
        subprocess.run([*cmd, *(["--dry-run"] if tiny else [])], cwd=ROOT, env=client_env(), check=False)
        if path.is_file():
            result = json.loads(path.read_text())
            info["check"] = {"passed": result["passed"], "tolerance": result["tolerance"],
                             "bf16_vs_fp32": result["bf16_vs_fp32"]}  # fmt: skip
        else:
            info["check"] = {"passed": False, "error": "bench.gpu_model_check wrote no result"}
    rng = random.Random(0)
    texts = [f"Request {i}: " + " ".join(rng.choice(WORDS) for _ in range(14)) + "." for i in range(2000)]
    (plan.out / "texts.txt").write_text("\n".join(texts) + "\n")
    return info


def measure_step(plan: Plan, tree: Tree, tree_out: Path) -> dict[str, Any]:
    """bench/step.py of this checkout, run with the tree's packages first on the path."""
    path = tree_out / "step.json"
    env = {**tree_env(tree.path), "TORCHINDUCTOR_CACHE_DIR": str(plan.out / "cache" / "step")}
    # -P: bench/ itself stays off sys.path (the script imports only the tree's packages and torch)
    cmd = [sys.executable, "-P", str(ROOT / "bench" / "step.py"), "--checkpoint", str(plan.checkpoint), "--out",
           str(path), "--batches", plan.step_batches, "--device", plan.device]  # fmt: skip
    with (tree_out / "step.log").open("w") as log:
        try:
            subprocess.run(cmd, cwd=tree.path, env=env, stdout=log, stderr=subprocess.STDOUT, check=False,
                           timeout=min(STEP_LIMIT_S, plan.left_s()))  # fmt: skip
        except subprocess.TimeoutExpired:
            return {"error": "cut off (step.log)"}
    return json.loads(path.read_text()) if path.is_file() else {"error": "no result (step.log)"}


def ttfa_args(plan: Plan, frames: int) -> list[str]:
    return ["--reference-id", VOICE, "--texts", str(plan.out / "texts.txt"), "--max-new-tokens", str(frames),
            "--timeout-s", str(REQUEST_TIMEOUT_S)]  # fmt: skip


def measure_streams(plan: Plan, server: Server, tree_out: Path, streams: int) -> dict[str, Any]:
    """N client-default streams, with the engine's turns over the level, the CPU the server's processes spent and its
    /metrics series."""
    level_out = tree_out / f"streams-{streams}"
    before = server.metrics_text()
    series = subprocess.Popen(
        [sys.executable, "-m", "bench.metrics_series", f"{server.base_url}/metrics", "--out",
         str(level_out / "series.jsonl")], cwd=ROOT, env=client_env(),
    )  # fmt: skip
    request_s = plan.frames / FRAME_RATE_HZ + REQUEST_TIMEOUT_S
    cpu_before, t0 = server.cpu_seconds(), time.monotonic()
    try:
        summary = run_level(
            server.live_url, level_out, concurrency=streams, requests=streams * plan.waves,
            args=[*ttfa_args(plan, plan.frames), "--ramp-s", str(plan.ramp_s), *plan.client_args],
            timeout_s=min(plan.ramp_s + plan.waves * request_s + 60, plan.left_s()),
        )  # fmt: skip
    finally:
        wall_s = time.monotonic() - t0
        cpu_after = server.cpu_seconds()
        series.send_signal(signal.SIGTERM)
        series.wait(timeout=30)
    after = server.metrics_text()
    (level_out / "metrics_after.txt").write_text(after)
    turns = attribution(counters_from_text(before), counters_from_text(after))
    return {"summary": summary, "turns": turns, "cpu": cpu_use(cpu_before, cpu_after, wall_s, streams)}


def cpu_use(before: dict[int, float], after: dict[int, float], wall_s: float, streams: int) -> dict[str, Any]:
    """CPU the server's processes spent over a level: per stream (cores), and the busiest process's share of a core
    (near 1.0: that process's event loop bound the level)."""
    spent = {pid: after[pid] - before.get(pid, 0.0) for pid in after}
    total = sum(spent.values())
    return {
        "wall_s": round(wall_s, 1),
        "cpu_s": round(total, 1),
        "processes": len(spent),
        "cores_per_stream": round(total / wall_s / streams, 5) if wall_s > 0 else None,
        "busiest_process_cores": round(max(spent.values(), default=0.0) / wall_s, 2) if wall_s > 0 else None,
    }


def measure_server(plan: Plan, tree: Tree, tree_out: Path, res: dict[str, Any]) -> None:
    cache = plan.out / "cache" / "server"
    # a setting a later tree made the default may be gone as a flag (and an older tree lacks the newer flags)
    settings, res["flags_dropped"] = keep_known(plan.serve_args, server_flags(tree.path))
    args = [*settings, *plan.extra_serve_args, "--checkpoint", str(plan.checkpoint), "--references-dir", str(plan.refs),
            "--device", plan.device, "--rate-limit-per-min", "1000000", "--compile-cache-dir", str(cache),
            "--log-level", "warning"]  # fmt: skip
    cache_state = "warm" if cache.is_dir() and any(cache.iterdir()) else "empty"
    with Server(tree.path, args, tree_out / "server.log") as server:
        ready_s = server.start(min(READY_LIMIT_S, plan.left_s()))
        metrics = server.metrics()
        startup = {k: v for k, v in metrics.items() if k.startswith('fishgate_engine{what="startup_')}
        res["start"] = {"ready_s": round(ready_s, 1), "compile_cache": cache_state, "startup": startup}
        print(f"[{tree.label}] ready after {ready_s:.0f} s ({cache_state} compile cache)", flush=True)
        if plan.rows & {"first_audio", "streams"}:
            streams, frames = plan.warm_up
            run_level(server.live_url, tree_out / "warm_up", concurrency=streams, requests=streams,
                      args=ttfa_args(plan, frames), timeout_s=min(120, plan.left_s()))  # fmt: skip
            res["graphs_wait_s"] = server.wait_for_graphs(min(GRAPH_WAIT_S, plan.left_s()))
        if "first_audio" in plan.rows and plan.left_s() > 60:
            res["first_audio"] = run_level(
                server.live_url, tree_out / "first_audio", concurrency=1, requests=plan.first_audio_requests,
                args=ttfa_args(plan, plan.frames), timeout_s=min(180, plan.left_s()),
            )  # fmt: skip
            print(f"[{tree.label}] first audio: {brief(res['first_audio'])}", flush=True)
        for n in plan.streams if "streams" in plan.rows else ():
            if plan.left_s() < plan.ramp_s + plan.frames / FRAME_RATE_HZ + 30:
                break
            res.setdefault("streams", {})[n] = level = measure_streams(plan, server, tree_out, n)
            print(f"[{tree.label}] {n} streams: {brief(level['summary'])}, {level['cpu']}", flush=True)
        res["gpu_memory_bytes"] = server.metrics().get("fishgate_gpu_memory_bytes")
        res["slow_turns"] = engine_value(server.metrics(), "slow_turns")
    if "restart" in plan.rows and plan.left_s() > 60:
        with Server(tree.path, args, tree_out / "server_restart.log") as server:
            res["restart"] = {"ready_s": round(server.start(min(READY_LIMIT_S, plan.left_s())), 1)}
        print(f"[{tree.label}] restart: ready after {res['restart']['ready_s']:.0f} s", flush=True)


def measure_tree(plan: Plan, tree: Tree, index: int) -> dict[str, Any]:
    tree_out = plan.out / f"{index}-{tree.label.replace('+', '-')}"
    tree_out.mkdir(parents=True, exist_ok=True)
    res: dict[str, Any] = {"label": tree.label, "path": str(tree.path), "out": str(tree_out)}
    if "step" in plan.rows:
        res["step"] = measure_step(plan, tree, tree_out)
        print(f"[{tree.label}] decode step: {res['step'].get('batches', res['step'].get('error'))}", flush=True)
    if plan.rows & {"first_audio", "streams", "restart"}:
        try:
            measure_server(plan, tree, tree_out, res)
        except (ServerFailed, OSError, subprocess.SubprocessError) as e:
            res["error"] = f"{type(e).__name__}: {e}"
            print(f"[{tree.label}] {res['error']}", flush=True)
    return res


# ---- the table ---------------------------------------------------------------------------------------------------
def brief(s: dict[str, Any] | None) -> str:
    if not s:
        return "no result"
    underran = number(None if s["underrun_rate"] is None else 100 * s["underrun_rate"], "{:.1f} %")
    return (f"{s['ok']}/{s['requests']} served, first audio p50 {number(s['ttfa_p50_ms'])} / p95 "
            f"{number(s['ttfa_p95_ms'])} ms, {underran} underran")  # fmt: skip


def cells(res: dict[str, Any]) -> dict[str, str]:
    """One tree's column: row name → cell."""
    out: dict[str, str] = {}
    step = res.get("step")
    if step is not None:
        rows = step.get("batches") or []
        for r in rows:
            graph = number(r.get("graph_ms"), "{:.3f}")
            out[f"decode step, batch {r['batch']}: graph replay / `step()` ms"] = f"{graph} / {r['step_call_ms']:.3f}"
        if not rows:
            out["decode step, batch 1: graph replay / `step()` ms"] = f"failed: {step.get('error', '?')}"
    if res.get("flags_dropped"):
        out["settings this server lacks (left out)"] = " ".join(res["flags_dropped"])
    if "start" in res:
        out["start → ready (compile cache)"] = f"{res['start']['ready_s']:.0f} s ({res['start']['compile_cache']})"
    fa = res.get("first_audio")
    if "first_audio" in res:
        out["first audio, 1 stream: p50 / p95 ms (server side p50)"] = (
            f"{number(fa['ttfa_p50_ms'])} / {number(fa['ttfa_p95_ms'])} ({number(fa['server_first_audio_p50_ms'])})"
            if fa
            else "no result"
        )
    for n, level in res.get("streams", {}).items():
        s, t, cpu = level["summary"], level["turns"], level["cpu"]
        name = f"{n} streams"
        if s:
            out[f"{name}: served"] = f"{s['ok']} / {s['requests']}"
            out[f"{name}: first audio p50 / p95 ms"] = f"{number(s['ttfa_p50_ms'])} / {number(s['ttfa_p95_ms'])}"
            rate = s["underrun_rate"]
            out[f"{name}: requests that underran"] = number(None if rate is None else 100 * rate, "{:.1f} %")
        else:
            out[f"{name}: served"] = "no result (cut off)"
        out[f"{name}: ms a turn = prefill + step + vocode + rest"] = (
            f"{t['turn_ms']:.1f} = {t['prefill_ms']:.1f} + {t['step_ms']:.1f} + {t['vocode_ms']:.1f} + "
            f"{t['rest_ms']:.1f}"
        )
        out[f"{name}: server CPU per stream / busiest process (cores)"] = (
            f"{number(cpu['cores_per_stream'], '{:.4f}')} / {number(cpu['busiest_process_cores'], '{:.2f}')} "
            f"({cpu['processes']} processes)"
        )
    if res.get("gpu_memory_bytes"):  # 0 on CPU
        out["GPU memory allocated"] = f"{res['gpu_memory_bytes'] / 1e9:.2f} GB"
    if "restart" in res:
        out["restart → ready (warm compile cache)"] = f"{res['restart']['ready_s']:.0f} s"
    if "error" in res:
        out["error"] = res["error"].splitlines()[0][:120]
    return out


def table(results: list[dict[str, Any]]) -> str:
    return side_by_side([r["label"] for r in results], [cells(r) for r in results])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="output folder (the checkpoint is reused if it is there)")
    add_tree_arguments(ap)
    ap.add_argument("--rows", help=f"some of {','.join(ROWS)} (default: all; without restart with a baseline)")
    ap.add_argument("--streams", default="300", help="concurrent client-default streams, levels in turn: 300,500 [300]")
    ap.add_argument("--waves", type=int, default=2, help="requests each stream's client sends in turn [2]")
    ap.add_argument("--ramp-s", type=float, default=9.0, help="the first requests spread over this long [9]")
    ap.add_argument("--frames", type=int, default=200, help="frames a request (200: 9.3 s of audio) [200]")
    ap.add_argument("--step-batches", default="1", help="batch buckets the step row times, e.g. 1,64,256 [1]")
    ap.add_argument("--settings", choices=("throughput", "default"), default="throughput",
                    help="the server's flags: the throughput settings, or the defaults (start-up figures)")  # fmt: skip
    ap.add_argument("--extra-serve-args", default="", help='more `fishgate serve` flags, e.g. "--ws-compression on"')
    bare = "--compression off --sockets per-request"
    ap.add_argument("--client-args", default="", help=f'more `fishgate ttfa` flags for the streams, e.g. "{bare}"')
    ap.add_argument("--skip-check", action="store_true", help="skip the checkpoint's bf16-vs-fp32 check")
    ap.add_argument("--limit-s", type=float, default=0, help="start no phase after this many seconds (0: no limit)")
    ap.add_argument("--tiny", action="store_true", help="a tiny model on CPU: checks this script, measures nothing")
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    streams = tuple(int(n) for n in args.streams.split(","))
    trees = trees_from(args, ap)
    rows = frozenset(args.rows.split(",") if args.rows else set(ROWS) - ({"restart"} if len(trees) > 1 else set()))
    if rows - set(ROWS):
        ap.error(f"--rows: unknown {sorted(rows - set(ROWS))}; choose from {','.join(ROWS)}")
    base = DEFAULT_SERVE_ARGS if args.settings == "default" else THROUGHPUT_SERVE_ARGS
    if args.tiny:  # the CPU check of this script: a tiny model, no compile, few sessions
        base = ("--max-sessions", str(max(8, *streams)))
    plan = Plan(
        out=args.out.resolve(), device="cpu" if args.tiny else "cuda", serve_args=base,
        extra_serve_args=tuple(args.extra_serve_args.split()), client_args=tuple(args.client_args.split()),
        rows=rows, step_batches=args.step_batches, streams=streams, waves=args.waves, ramp_s=args.ramp_s,
        frames=args.frames, deadline=t0 + args.limit_s if args.limit_s else None,
        **({"warm_up": (TINY_REQUESTS, args.frames), "first_audio_requests": TINY_REQUESTS} if args.tiny else {}),
    )  # fmt: skip
    plan.out.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {"what": "bench.gpu", "argv": sys.argv[1:] if argv is None else argv,
                               "started": time.strftime("%Y-%m-%d %H:%M:%S"), "plan": repr(plan)}  # fmt: skip
    summary["prepare"] = prepare(plan, args.tiny, check=not args.skip_check)
    summary["trees"] = []
    for i, tree in enumerate(trees, 1):
        summary["trees"].append(measure_tree(plan, tree, i))
        summary["total_s"] = round(time.monotonic() - t0, 1)
        (plan.out / "summary.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
    text = table(summary["trees"])
    check = summary["prepare"].get("check")
    if check is not None:
        verdict = "passed" if check["passed"] else "FAILED"
        text += f"\n\ncheckpoint check, bf16 against fp32 (bench/gpu_model_check.py): {verdict}"
    text += f"\n\n{time.monotonic() - t0:.0f} s in all; {plan.out / 'summary.json'}"
    (plan.out / "summary.md").write_text(text + "\n")
    print("\n" + text)
    failed = any("error" in t or "error" in t.get("step", {}) for t in summary["trees"])
    return 1 if failed or (check is not None and not check["passed"]) else 0


if __name__ == "__main__":
    raise SystemExit(main())

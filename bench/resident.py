"""The resident engine's restart figures on one machine, through the real commands (`fishgate engine` and
`fishgate serve --engine`):

    python -m bench.resident --out OUT_DIR [--device cuda] [--checkpoint DIR] [--frames 60]

1. A gateway starts first, then the engine on an empty compile cache (OUT_DIR/cache): engine launch -> the
   gateway's /readyz 200 is the **cold start**. A few warm-up requests, then first audio at level 1 (one stream,
   requests one after another): the steady figure.
2. **Gateway restart**: SIGTERM the gateway, launch a new one on the same port against the running engine: launch ->
   /readyz 200, launch -> the first /v1/tts answered in full, then first audio at level 1 right away (full speed
   is the steady figure).
3. **Engine restart on warm caches**: SIGTERM the engine, launch it again (the gateway stays up and reattaches):
   launch -> /readyz 200, then first audio at level 1 right after ready. With the defaults (twice on a GPU: a
   start may rewrite the caches the next one reads), then with `--compile-after-ready on` (and the seconds until
   every compiled graph is in place). After each: first audio at level 1, then 8 streams at once.

Each launch's start-up line (the engine's phases, compile-cache counts) and, on a GPU, the tuned launch configs in
the compile cache after it (`.best_config` files found by coordinate descent, and the others) go into the JSON.

Without --checkpoint on a CUDA device the full-size random-weight checkpoint of bench.make_checkpoint is written
into OUT_DIR (once); its end token is unreachable, so each request stops at --frames. On the CPU the embedded
default model speaks. Prints a table and writes OUT_DIR/resident.json; the processes' logs stay in OUT_DIR.
One H100: about 6 minutes (the cold start compiles for ~2 of them).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from bench.serving import ROOT, client_env, engine_value, free_port, number, parse_metrics, run_level

READY_LIMIT_S = 400.0
GRAPH_WAIT_S = 90.0
LEVEL_REQUESTS = 8
BURST = 8  # then this many streams at once, one request each (the default profile's sessions)
STOP_LIMIT_S = 60.0
VOICE = "bench-voice"
TEXT = "Hello there, this is the resident engine benchmark speaking one sentence."


class Proc:
    """One `python -m server.cli ARGS` child, its output appended to `log`."""

    def __init__(self, args: list[str], log: Path, env: dict[str, str]) -> None:
        self.args, self.log, self.env = args, log, env
        self.proc: subprocess.Popen[bytes] | None = None
        self.launched = 0.0

    def launch(self) -> float:
        with self.log.open("ab") as out:
            out.write(f"$ {' '.join(self.args)}\n".encode())
            out.flush()
            self.launched = time.monotonic()
            self.proc = subprocess.Popen([sys.executable, "-m", "server.cli", *self.args], cwd=ROOT, env=self.env,
                                         stdout=out, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        return self.launched

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_LIMIT_S)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        return self.proc.returncode

    def tail(self, lines: int = 25) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def get(url: str, timeout_s: float = 2.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except OSError:
        return 0, b""


def wait_ready(base: str, since: float, procs: list[Proc], limit_s: float = READY_LIMIT_S) -> float:
    """Seconds from `since` to the gateway's /readyz 200 (polled every 50 ms)."""
    while time.monotonic() - since < limit_s:
        for p in procs:
            if not p.alive():
                raise RuntimeError(f"{p.args[0]} exited ({p.proc and p.proc.returncode}):\n{p.tail()}")
        if get(f"{base}/readyz", 1.0)[0] == 200:
            return time.monotonic() - since
        time.sleep(0.05)
    raise RuntimeError(f"not ready after {limit_s:.0f} s:\n" + "\n".join(p.tail() for p in procs))


def first_tts(base: str, since: float, body: dict[str, Any], limit_s: float = 60.0) -> float:
    """Seconds from `since` to the first /v1/tts answered in full with audio (retried until then)."""
    data = json.dumps(body).encode()
    while time.monotonic() - since < limit_s:
        req = urllib.request.Request(f"{base}/v1/tts", data, {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                if r.status == 200 and len(r.read()) > 1000:
                    return time.monotonic() - since
        except (OSError, urllib.error.HTTPError):
            pass
        time.sleep(0.05)
    raise RuntimeError(f"no /v1/tts answered within {limit_s:.0f} s")


def wait_graphs(base: str, limit_s: float) -> float | None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit_s:
        missing = engine_value(parse_metrics(get(f"{base}/metrics", 5.0)[1].decode(errors="replace")),
                               "graphs_missing")  # fmt: skip
        if missing == 0:
            return time.monotonic() - t0
        time.sleep(0.5)
    return None


def level1(live_url: str, out: Path, args: list[str]) -> dict[str, Any] | None:
    return run_level(live_url, out, concurrency=1, requests=LEVEL_REQUESTS, args=args, timeout_s=300)


def burst(live_url: str, out: Path, args: list[str]) -> dict[str, Any] | None:
    return run_level(live_url, out, concurrency=BURST, requests=BURST, args=args, timeout_s=300)


def brief(s: dict[str, Any] | None) -> str:
    if not s:
        return "no result"
    return f"{number(s['ttfa_p50_ms'])} / {number(s['ttfa_p95_ms'])} ms ({s['ok']}/{s['requests']})"


def run(args: argparse.Namespace) -> dict[str, Any]:
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    model_args: list[str] = ["--device", args.device]
    gateway_extra: list[str] = []
    ttfa_args = ["--timeout-s", "60"]
    if args.checkpoint is None and args.device.startswith("cuda"):
        args.checkpoint = out / "checkpoint"
        if not (args.checkpoint / "model.safetensors").is_file():
            subprocess.run([sys.executable, "-m", "bench.make_checkpoint", str(args.checkpoint), str(out / "voices")],
                           cwd=ROOT, env=client_env(), check=True)  # fmt: skip
    if args.checkpoint is not None:
        model_args += ["--checkpoint", str(args.checkpoint)]
    tts_body: dict[str, Any] = {"text": TEXT, "format": "wav"}
    if (out / "voices").is_dir() and args.checkpoint is not None and args.checkpoint.parent == out:
        gateway_extra += ["--references-dir", str(out / "voices")]
        ttfa_args += ["--reference-id", VOICE]
        tts_body["reference_id"] = VOICE
    if args.frames:
        ttfa_args += ["--max-new-tokens", str(args.frames)]
        tts_body["max_new_tokens"] = args.frames
    env = {**client_env(), "TRITON_CACHE_DIR": str(out / "cache" / "triton")}
    res: dict[str, Any] = {"what": "bench.resident", "device": args.device, "frames": args.frames,
                           "engine_args": args.engine_args}  # fmt: skip

    def save() -> None:  # after every phase, so a run cut short still leaves what it measured
        (out / "resident.json").write_text(json.dumps({**res, "table": table(res)}, indent=1))

    with tempfile.TemporaryDirectory(prefix="fg-res-") as tmp:  # short: a Unix socket path has at most 107 bytes
        address = f"unix:{Path(tmp) / 'engine.sock'}"
        port = free_port()
        base, live = f"http://127.0.0.1:{port}", f"ws://127.0.0.1:{port}/v1/tts/live"
        engine_args = ["engine", "--listen", address, *model_args, "--compile-cache-dir", str(out / "cache" / "inductor"),
                       "--log-level", "info", *shlex.split(args.engine_args)]  # fmt: skip
        gateway_args = ["serve", "--engine", address, "--port", str(port), "--rate-limit-per-min", "1000000",
                        "--log-level", "warning", *gateway_extra]  # fmt: skip
        gateway = Proc(gateway_args, out / "gateway.log", env)
        engine = Proc(engine_args, out / "engine.log", env)
        try:
            gateway.launch()
            t0 = engine.launch()
            res["cold_ready_s"] = round(wait_ready(base, t0, [gateway, engine]), 2)
            print(f"cold start: ready after {res['cold_ready_s']:.1f} s", flush=True)
            save()
            run_level(live, out / "warm_up", concurrency=4, requests=4, args=ttfa_args, timeout_s=300)
            res["graphs_wait_s"] = wait_graphs(base, GRAPH_WAIT_S)
            res["steady"] = level1(live, out / "steady", ttfa_args)
            res["steady_burst"] = burst(live, out / "steady_burst", ttfa_args)
            print(f"steady first audio p50 / p95: {brief(res['steady'])}; {BURST} at once {brief(res['steady_burst'])}",
                  flush=True)  # fmt: skip
            save()

            gateway.stop()
            t0 = gateway.launch()
            res["gateway_ready_s"] = round(wait_ready(base, t0, [gateway, engine]), 3)
            res["gateway_first_tts_s"] = round(first_tts(base, t0, tts_body), 3)
            res["after_gateway_restart"] = level1(live, out / "after_gateway_restart", ttfa_args)
            print(f"gateway restart: ready {res['gateway_ready_s']:.2f} s, first /v1/tts {res['gateway_first_tts_s']:.2f}"
                  f" s; first audio {brief(res['after_gateway_restart'])}", flush=True)  # fmt: skip
            save()

            res["engine_startup"] = startup_line(out / "engine.log")
            res["engine_tuned_configs"] = tuned_configs(out / "cache" / "inductor")
            variants = [("engine_restart", []), ("engine_restart_compile_after_ready", ["--compile-after-ready", "on"])]
            if args.device.startswith("cuda"):  # the CPU compiles nothing by default, so its restarts are all alike
                variants.insert(1, ("engine_restart_again", []))
            for name, extra in variants:
                res[f"{name}_exit"] = engine.stop()
                engine = Proc([*engine_args, *extra], out / f"{name}.log", env)
                t0 = engine.launch()
                res[f"{name}_ready_s"] = round(wait_ready(base, t0, [gateway, engine]), 2)
                res[f"{name}_first_tts_s"] = round(first_tts(base, t0, tts_body), 2)
                res[f"after_{name}"] = level1(live, out / f"after_{name}", ttfa_args)
                res[f"after_{name}_burst"] = burst(live, out / f"after_{name}_burst", ttfa_args)
                if extra[:1] == ["--compile-after-ready"]:
                    waited = wait_graphs(base, GRAPH_WAIT_S)
                    res[f"{name}_graphs_done_s"] = None if waited is None else round(time.monotonic() - t0, 1)
                res[f"{name}_startup"] = startup_line(out / f"{name}.log")
                res[f"{name}_tuned_configs"] = tuned_configs(out / "cache" / "inductor")
                print(f"{name}: ready {res[f'{name}_ready_s']:.1f} s; first audio {brief(res[f'after_{name}'])}; "
                      f"{BURST} at once {brief(res[f'after_{name}_burst'])}", flush=True)  # fmt: skip
                save()
        finally:
            res["gateway_exit"] = gateway.stop()
            res["engine_exit"] = engine.stop()
            save()
    res["table"] = table(res)
    print(res["table"])
    return res


def startup_line(log: Path) -> dict[str, Any]:
    """The engine's start-up line in `log` as numbers: its phases (s), decode graphs and compile-cache counts."""
    lines = [line for line in log.read_text(errors="replace").splitlines() if "engine ready in" in line]
    if not lines:
        return {}
    inside = lines[-1].split("(", 1)[1].rsplit(")", 1)[0]
    phases, graphs, _, caches = [*inside.split("; "), "", "", ""][:4]
    out: dict[str, Any] = {}
    for part in phases.split(", "):
        name, _, value = part.rpartition(" ")[0].partition(" ")
        out[name] = float(value) if value else None
    out["decode_graphs"] = int(graphs.split()[0]) if graphs else None
    for part in caches.removeprefix("compile caches: ").split(", "):
        name, _, value = part.partition(" ")
        if value.isdigit():
            out[name] = int(value)
    return out


COMPILE_ROW = (
    "… its compile: FX graphs compiled / from cache, tuning benchmarks, region variants saved / loaded / refused"
)


def compile_counts(r: dict[str, Any], launch: str) -> str:
    startup = r.get(f"{launch}_startup") or {}
    keys = ("fx_graphs_compiled", "fx_graphs_from_cache", "tuning_benchmarks")
    if not all(k in startup for k in keys):
        return "—"
    out = "{} / {}, {}".format(*(startup[k] for k in keys))
    saved = ("regions_saved", "regions_loaded", "regions_refused")  # model.saved_regions, where the engine saves
    return out if not all(k in startup for k in saved) else out + ", {} / {} / {}".format(*(startup[k] for k in saved))


def tuned_configs(cache: Path) -> dict[str, int]:
    """Inductor's saved launch configs under `cache`: those coordinate descent found (a warm start reuses them) and
    the others (a start that finds only these for a tuned kernel tunes it again)."""
    counts = {"coordesc": 0, "other": 0}
    for path in cache.rglob("*.best_config"):
        try:
            found = json.loads(path.read_text()).get("found_by_coordesc", False)
        except (OSError, ValueError):
            continue
        counts["coordesc" if found else "other"] += 1
    return counts


def table(r: dict[str, Any]) -> str:
    def s(key: str, spec: str = "{:.1f} s") -> str:
        return number(r.get(key), spec)

    rows = [
        ("cold start: engine launch → ready", s("cold_ready_s")),
        ("first audio at level 1, steady (p50 / p95)", brief(r.get("steady"))),
        (f"first audio, {BURST} streams at once, steady", brief(r.get("steady_burst"))),
        ("gateway restart: launch → ready", s("gateway_ready_s", "{:.2f} s")),
        ("gateway restart: launch → first /v1/tts answered", s("gateway_first_tts_s", "{:.2f} s")),
        ("first audio right after the gateway restart", brief(r.get("after_gateway_restart"))),
    ]
    rows.append((COMPILE_ROW, compile_counts(r, "engine")))
    for name, label in (
        ("engine_restart", "engine restart, warm caches"),
        ("engine_restart_again", "engine restart again, warm caches"),
        ("engine_restart_compile_after_ready", "engine restart, --compile-after-ready on"),
    ):
        rows += [
            (f"{label}: launch → ready", s(f"{name}_ready_s")),
            (COMPILE_ROW, compile_counts(r, name)),
            ("… first audio right after it, level 1", brief(r.get(f"after_{name}"))),
            (f"… then {BURST} streams at once", brief(r.get(f"after_{name}_burst"))),
        ]
    rows.append(("… every compiled graph in place after launch (--compile-after-ready)",
                 s("engine_restart_compile_after_ready_graphs_done_s")))  # fmt: skip
    return "\n".join(["| figure | value |", "|---|---|", *(f"| {a} | {b} |" for a, b in rows)])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="output folder")
    ap.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    ap.add_argument("--checkpoint", type=Path, default=None, help="model folder (default: see above)")
    ap.add_argument("--frames", type=int, default=None, help="cap each request at this many frames")
    ap.add_argument("--engine-args", default="", help='more `fishgate engine` flags for every launch, e.g. '
                    '"--compile-tune-single-row on"')  # fmt: skip
    args = ap.parse_args(argv)
    res = run(args)
    return 0 if all(res.get(k) for k in ("cold_ready_s", "gateway_ready_s", "engine_restart_ready_s")) else 1


if __name__ == "__main__":
    sys.exit(main())

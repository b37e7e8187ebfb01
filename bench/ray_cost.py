"""What Ray Serve costs on the host: fishgate alone against fishgate on Ray Serve, both over one stand-in engine that
emits audio at a GPU's pace without computing it (bench.standin), under client-default streams:

    python -m bench.ray_cost --out OUT_DIR [--streams 300,600] [--frames 200] [--waves 2] [--repeats 1]
    python -m bench.ray_cost --out OUT_DIR --quick        # 4 streams of 20 frames: checks the script, measures nothing

Sides (`--sides`, in turn; with --repeats 2 the order is reversed on the second round):
- `alone`: `fishgate serve` (one process: gateway and engine) on the stand-in, launched through `--alone-child`, which
  installs the stand-in and calls server.cli.main: the production code has no hook.
- `ray`: a local Ray (num_cpus=2, a temporary folder) started by a `--ray-child` process, `serve.run` of
  server.ray_serve.app_builder with 1 engine replica and 1 gateway replica; every Ray worker process installs the
  stand-in through `runtime_env={"worker_process_setup_hook": "bench.standin.install"}`. Clients connect to the
  gateway replica's own port, as deploy/ray/serve.yaml has it (Serve's HTTP proxy off).
- attribution, not run by default: `alone-deflate` is `fishgate serve --ws-compression on` (what Serve's proxy, were
  it on, would do to every client that offers deflate: its uvicorn keeps its default); `ray-nodeflate` is the `ray`
  side with clients that offer no deflate (`fishgate ttfa --compression off`). `alone-link` is fishgate's own split
  without Ray: `fishgate engine` and `fishgate serve --engine` (one gateway) on the engine link over a Unix socket,
  both counted (a `--link-child` runs the gateway and starts the engine as its child).
Both serve with `--profile throughput` (real-time admission at 0.9 of a frame), --max-sessions above the largest level.

Per side: a warm-up, a lone stream (--lone-requests one after another: first audio, and the real-time factor of its
arrival; the scheduler paces only while another stream needs audio, so a lone stream arrives as fast as the device makes
it), then each level: `fishgate ttfa` at its defaults (deflate offered, one socket per client), N clients, --waves
requests each of --frames frames (one sentence: one segment), the first spread over --ramp-s. Recorded: served/total,
first audio p50/p95 (from a request's first text frame, as `fishgate ttfa` measures it), a new client's connection time
apart (the handshake: behind a saturated proxy, waiting happens there), underruns, and CPU. Server CPU: user+system
seconds, over the level, of every process in the side's process tree, read from /proc (utime+stime, plus cutime+cstime
for children it reaped): for `alone` the server process; for `ray` the driver that ran serve.run and everything Ray
started under it (GCS, raylet, its agents, log monitor, Serve's controller and proxy, the replicas, idle workers), by
role in the JSON. The load client's CPU (getrusage of the ttfa child) is noted, not counted: it shares the same cores,
as does whatever else runs on the machine (the load average is noted before and after each level).

Pass (issue 40, item 5), per level, on the requests of every repeat pooled: Ray Serve serves within fishgate alone's
p95 first audio at least 90 % as many streams as fishgate alone does, and adds at most 20 ms to p50 first audio (first
audio as `fishgate ttfa` measures it: a client's wait in the handshake is not in it; read the connect column beside).
Prints the table, writes OUT_DIR/ray_cost.json; each level's ttfa.json and the servers' logs stay in OUT_DIR.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from bench.process_tree import cpu_spent, process_cpu, tree_cpu
from bench.serving import ROOT, client_env, free_port, number, run_level
from bench.standin import DEVICE_ENV, DeviceModel

SIDES = ("alone", "ray", "alone-deflate", "ray-nodeflate", "alone-link")
CLIENT_NO_DEFLATE = ("--compression", "off")  # the ray-nodeflate side's clients: nothing for the proxy to compress
APP = "fishgate"
FRAME_S = 2048 / 44_100  # one codec frame of audio
READY_LIMIT_S = 300.0  # Ray's start on 2 busy cores: a minute or two
STOP_LIMIT_S = 90.0
REQUEST_TIMEOUT_S = 30.0  # `fishgate ttfa --timeout-s` (as bench.gpu): a request not finished by then failed
DRAIN_GRACE_S = 2.0  # a side's stop waits this long for running utterances (none are running by then)
PASS_SERVED_SHARE = 0.9  # Ray serves at least this share of fishgate alone's streams, at alone's p95
PASS_ADDED_P50_MS = 20.0  # and adds at most this to p50 first audio
WORDS = ("the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven", "bright", "stars",
         "shine", "above", "quiet", "hills", "near", "river")  # fmt: skip


@dataclass(frozen=True, slots=True)
class Plan:
    out: Path
    sides: tuple[str, ...]
    streams: tuple[int, ...]
    waves: int
    ramp_s: float
    frames: int
    repeats: int
    lone_requests: int
    warm_up: tuple[int, int]  # streams, frames
    device: DeviceModel

    @property
    def max_sessions(self) -> int:
        return max(64, *self.streams) + 64

    @property
    def texts(self) -> Path:
        return self.out / "texts.txt"

    def ttfa_args(self, frames: int) -> list[str]:
        return ["--texts", str(self.texts), "--max-new-tokens", str(frames), "--timeout-s", str(REQUEST_TIMEOUT_S)]

    def server_env(self) -> dict[str, str]:
        return {**client_env(), DEVICE_ENV: self.device.to_env()}

    def settings(self) -> dict[str, Any]:
        """The servers' settings (both sides), as Ray's application args; `fishgate serve` gets them as flags."""
        # --max-connections as `fishgate serve` derives it from --max-sessions; given, because a gateway in front of a
        # resident engine (alone-link) would derive it from its own --max-sessions, which it ignores
        return {"host": "127.0.0.1", "profile": "throughput", "max_sessions": self.max_sessions,
                "max_connections": 2 * self.max_sessions + 256, "rate_limit_per_min": 1_000_000,
                "drain_grace_s": DRAIN_GRACE_S, "log_level": "warning"}  # fmt: skip


# ---- a side's server ---------------------------------------------------------------------------------------------
def children_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def get_json(url: str, timeout_s: float = 2.0) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, None
    except (OSError, ValueError):
        return 0, None


class Side:
    """One side's server: a child process (and what it starts), on a free port, its output in `log`."""

    def __init__(self, name: str, plan: Plan, log: Path) -> None:
        self.name, self.plan, self.log = name, plan, log
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.temp_dir: str | None = None
        self.exit_code: int | None = None  # the child's, once stopped (0: it shut down by itself)

    @property
    def live_url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/v1/tts/live"

    @property
    def client_args(self) -> list[str]:
        return list(CLIENT_NO_DEFLATE) if self.name == "ray-nodeflate" else []

    def command(self) -> list[str]:
        me = [sys.executable, "-m", "bench.ray_cost"]
        if self.name.startswith("ray"):
            self.temp_dir = tempfile.mkdtemp(prefix="fg-ray-")  # short: Ray's socket paths live under it
            return [*me, "--ray-child", str(self.port), self.temp_dir, json.dumps(self.plan.settings())]
        flags = [f"--{k.replace('_', '-')}={v}" for k, v in self.plan.settings().items()]
        if self.name == "alone-link":
            self.temp_dir = tempfile.mkdtemp(prefix="fg-link-")  # short: a Unix socket path has at most 107 bytes
            return [*me, "--link-child", f"unix:{self.temp_dir}/engine.sock", f"--port={self.port}", *flags]
        if self.name == "alone-deflate":
            flags.append("--ws-compression=on")
        return [*me, "--alone-child", "serve", f"--port={self.port}", *flags]

    def start(self) -> float:
        """Launch and wait until /readyz says ready with an engine; seconds it took."""
        self.log.parent.mkdir(parents=True, exist_ok=True)
        cmd = self.command()
        t0 = time.monotonic()
        with self.log.open("ab") as log:
            log.write(f"$ {' '.join(cmd)}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(cmd, cwd=ROOT, env=self.plan.server_env(), stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        while time.monotonic() - t0 < READY_LIMIT_S:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name}: the server exited ({self.proc.returncode}); see {self.log}")
            status, body = get_json(f"http://127.0.0.1:{self.port}/readyz")
            engines = (body or {}).get("engines", {}).get("ready", 0)  # Ray's gateway: engine replicas ready
            if status == 200 and (engines >= 1 or not self.name.startswith("ray")):
                return time.monotonic() - t0
            time.sleep(0.5)
        raise RuntimeError(f"{self.name}: not ready after {READY_LIMIT_S:.0f} s; see {self.log}")

    def cpu(self) -> dict[int, tuple[str, float]]:
        return {} if self.proc is None else tree_cpu(self.proc.pid)

    def stop(self) -> None:
        """SIGTERM (the Ray child shuts Serve and Ray down), then SIGKILL to whatever of its tree is left."""
        if self.proc is None:
            return
        left = set(self.cpu())
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(STOP_LIMIT_S)
        for pid in left:  # the processes this side started, by id
            with contextlib.suppress(OSError):
                if process_cpu(pid) is not None:
                    os.kill(pid, signal.SIGKILL)
        self.exit_code = self.proc.wait()
        if self.temp_dir is not None:
            shutil.rmtree(self.temp_dir, ignore_errors=True)

    def __enter__(self) -> Side:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


# ---- one side -------------------------------------------------------------------------------------------------------
def requests_of(out_dir: Path) -> list[dict[str, Any]]:
    """The level's requests from its ttfa.json, without their arrival lists."""
    path = out_dir / "ttfa.json"
    if not path.is_file():
        return []
    rows = json.loads(path.read_text())["levels"][0]["requests"]
    keep = ("error", "ttfa_ms", "audio_s", "wall_s", "rtf", "underruns", "chunks", "connect_ms", "extensions")
    return [{k: r.get(k) for k in keep} for r in rows]


def connections(requests: list[dict[str, Any]]) -> dict[str, int]:
    """Connections the level's clients opened, by the extensions negotiated on them ("none": no compression)."""
    return dict(Counter(",".join(r["extensions"]) or "none" for r in requests if r["connect_ms"] is not None))


def measure_level(plan: Plan, side: Side, out_dir: Path, streams: int) -> dict[str, Any]:
    load_before, before, client_before, t0 = os.getloadavg(), side.cpu(), children_cpu_s(), time.monotonic()
    request_s = plan.frames * FRAME_S + REQUEST_TIMEOUT_S
    summary = run_level(
        side.live_url, out_dir, concurrency=streams, requests=streams * plan.waves,
        args=[*plan.ttfa_args(plan.frames), "--ramp-s", str(plan.ramp_s), *side.client_args],
        timeout_s=plan.ramp_s + plan.waves * request_s + 120,
    )  # fmt: skip
    wall_s = time.monotonic() - t0
    server = cpu_spent(before, side.cpu())
    requests = requests_of(out_dir)
    audio_s = sum(r["audio_s"] or 0.0 for r in requests if r["error"] is None)
    ok = sum(1 for r in requests if r["error"] is None)
    return {
        "streams": streams, "summary": summary, "requests": requests, "wall_s": round(wall_s, 1),
        "server_cpu": server, "client_cpu_s": round(children_cpu_s() - client_before, 2),
        "cpu_s_per_stream": round(server["cpu_s"] / ok, 3) if ok else None,
        # cores a stream of real-time audio costs: CPU seconds per second of audio delivered
        "cores_per_realtime_stream": round(server["cpu_s"] / audio_s, 4) if audio_s else None,
        "loadavg_before": [round(x, 2) for x in load_before], "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        "connections": connections(requests),
    }  # fmt: skip


def run_side(plan: Plan, name: str, round_: int) -> dict[str, Any]:
    side_out = plan.out / f"{round_}-{name}"
    res: dict[str, Any] = {"side": name, "round": round_}
    with Side(name, plan, side_out / "server.log") as side:
        res["ready_s"] = round(side.start(), 1)
        print(f"[{name} #{round_}] ready after {res['ready_s']:.0f} s", flush=True)
        streams, frames = plan.warm_up
        run_level(side.live_url, side_out / "warm_up", concurrency=streams, requests=streams,
                  args=[*plan.ttfa_args(frames), *side.client_args], timeout_s=180)  # fmt: skip
        lone_out = side_out / "lone"
        lone = run_level(side.live_url, lone_out, concurrency=1, requests=plan.lone_requests,
                         args=[*plan.ttfa_args(plan.frames), *side.client_args],
                         timeout_s=plan.lone_requests * 60 + 60)  # fmt: skip
        res["lone"] = {"summary": lone, "requests": requests_of(lone_out)}
        print(f"[{name} #{round_}] lone stream: {brief(lone)}, real-time factor p50 "
              f"{number((lone or {}).get('rtf_p50'), '{:.2f}')}", flush=True)  # fmt: skip
        res["levels"] = {}
        for n in plan.streams:
            level = measure_level(plan, side, side_out / f"streams-{n}", n)
            res["levels"][str(n)] = level
            cpu, per_stream = level["server_cpu"]["cpu_s"], number(level["cpu_s_per_stream"], "{:.3f}")
            print(f"[{name} #{round_}] {n} streams: {brief(level['summary'])}; server CPU {cpu:.0f} s ({per_stream} s "
                  f"a stream), client {level['client_cpu_s']:.0f} s; load {level['loadavg_after'][0]:.1f}",
                  flush=True)  # fmt: skip
    res["exit_code"] = side.exit_code
    return res


def brief(s: dict[str, Any] | None) -> str:
    if not s:
        return "no result"
    return (f"{s['ok']}/{s['requests']} served, first audio p50 {number(s['ttfa_p50_ms'])} / p95 "
            f"{number(s['ttfa_p95_ms'])} ms, {s['requests_with_underrun']} underran")  # fmt: skip


# ---- the comparison ----------------------------------------------------------------------------------------------
def pooled(runs: list[dict[str, Any]], level: str) -> dict[str, Any] | None:
    """One side's figures at one level over every round: requests pooled, CPU summed."""
    found = [r["levels"][level] for r in runs if level in r.get("levels", {})]
    if not found:
        return None
    requests = [q for lv in found for q in lv["requests"]]
    ok = [q for q in requests if q["error"] is None]
    ttfa = np.asarray([q["ttfa_ms"] for q in ok if q["ttfa_ms"] is not None])
    cpu_s = sum(lv["server_cpu"]["cpu_s"] for lv in found)
    audio_s = sum(q["audio_s"] or 0.0 for q in ok)
    return {
        "rounds": len(found), "requests": len(requests), "ok": len(ok), "ttfa_ms": ttfa,
        "p50": float(np.percentile(ttfa, 50)) if len(ttfa) else None,
        "p95": float(np.percentile(ttfa, 95)) if len(ttfa) else None,
        "underran": sum(1 for q in ok if q["underruns"]), "cpu_s_per_stream": cpu_s / len(ok) if ok else None,
        "cores_per_realtime_stream": cpu_s / audio_s if audio_s else None,
        "client_cpu_s_per_stream": sum(lv["client_cpu_s"] for lv in found) / len(ok) if ok else None,
        "rtf_p50": float(np.median([q["rtf"] for q in ok if q["rtf"] is not None])) if ok else None,
        "connections": dict(sum((Counter(lv["connections"]) for lv in found), Counter())),
        "connect_ms": [q["connect_ms"] for q in requests if q["connect_ms"] is not None],
        "loadavg": [lv["loadavg_before"][0] for lv in found] + [lv["loadavg_after"][0] for lv in found],
    }  # fmt: skip


def checks(alone: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    """Streams served within alone's p95 first audio (alone's own count included), and p50 added."""
    bound = alone["p95"]
    if bound is None or other["p50"] is None or alone["p50"] is None:
        return {"pass": False, "why": "a side served nothing"}
    within_alone = int((alone["ttfa_ms"] <= bound).sum())
    within_other = int((other["ttfa_ms"] <= bound).sum())
    # per round: the sides may have run a different number of rounds
    share = (within_other / other["rounds"]) / (within_alone / alone["rounds"]) if within_alone else 0.0
    added = other["p50"] - alone["p50"]
    return {"p95_bound_ms": round(bound, 1), "served_within_alone": within_alone, "served_within_other": within_other,
            "served_share": round(share, 3), "served_pass": share >= PASS_SERVED_SHARE,
            "added_p50_ms": round(added, 1), "p50_pass": added <= PASS_ADDED_P50_MS,
            "pass": share >= PASS_SERVED_SHARE and added <= PASS_ADDED_P50_MS}  # fmt: skip


def cells(p: dict[str, Any] | None) -> list[str]:
    if p is None:
        return ["-"] * 7
    connect = np.asarray(p["connect_ms"]) if p["connect_ms"] else None
    return [
        f"{p['ok']}/{p['requests']}", f"{number(p['p50'])} / {number(p['p95'])}",
        "-" if connect is None else f"{np.percentile(connect, 50):.0f} / {np.percentile(connect, 95):.0f}",
        f"{p['underran']}",
        f"{number(p['cpu_s_per_stream'], '{:.3f}')} ({number(p['cores_per_realtime_stream'], '{:.4f}')})",
        number(p["client_cpu_s_per_stream"], "{:.3f}"),
        f"{p['connections'].get('permessage-deflate', 0)} of {sum(p['connections'].values())} connections",
    ]  # fmt: skip


def compare(plan: Plan, runs: list[dict[str, Any]]) -> tuple[str, dict[str, Any]]:
    by_side = {s: [r for r in runs if r["side"] == s] for s in plan.sides}
    head = ["level", "side", "served", "first audio p50 / p95 ms", "connect p50 / p95 ms", "underran",
            "server CPU s a stream (cores a real-time stream)", "client CPU s a stream",
            "deflate negotiated"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    verdicts: dict[str, Any] = {}
    for n in plan.streams:
        level = str(n)
        figures = {s: pooled(by_side[s], level) for s in plan.sides}
        for s in plan.sides:
            lines.append(f"| {n} | {s} | " + " | ".join(cells(figures[s])) + " |")
        alone = figures.get("alone")
        for s in plan.sides:
            other = figures[s]
            if s != "alone" and alone is not None and other is not None:
                verdicts[f"{s}@{n}"] = v = checks(alone, other)
                if "served_share" in v:
                    lines.append(
                        f"| {n} | {s} vs alone | within alone's p95 ({v['p95_bound_ms']:.0f} ms): "
                        f"{v['served_within_other']} vs {v['served_within_alone']} = {v['served_share']:.0%} "
                        f"({'pass' if v['served_pass'] else 'FAIL'}: ≥ {PASS_SERVED_SHARE:.0%}) | p50 "
                        f"{v['added_p50_ms']:+.0f} ms ({'pass' if v['p50_pass'] else 'FAIL'}: ≤ "
                        f"+{PASS_ADDED_P50_MS:.0f}) | | | | | |"
                    )
    lone = []
    for s in plan.sides:
        ttfa = [q["ttfa_ms"] for r in by_side[s] for q in r.get("lone", {}).get("requests", []) if q["ttfa_ms"]]
        rtf = [q["rtf"] for r in by_side[s] for q in r.get("lone", {}).get("requests", []) if q["rtf"]]
        if ttfa:
            lone.append(f"{s}: first audio p50 {np.median(ttfa):.0f} ms, real-time factor p50 {np.median(rtf):.2f}")
    text = "\n".join(lines) + "\n\nlone stream (" + str(plan.frames) + " frames): " + "; ".join(lone)
    return text, verdicts


# ---- the children ------------------------------------------------------------------------------------------------
def alone_child(argv: list[str]) -> int:
    """`fishgate serve ARGS` on the stand-in engine."""
    from bench import standin

    standin.install()
    from server.cli import main as cli_main

    return int(cli_main(argv) or 0)


def link_child(address: str, flags: list[str]) -> int:
    """`fishgate engine` (a child of this process) and `fishgate serve --engine` (this process), on the stand-in;
    each gets the flags that are its own (server.settings.ENGINE_PROCESS_SETTINGS), the shared ones both."""
    from server.settings import ENGINE_PROCESS_SETTINGS

    def name(flag: str) -> str:
        return flag.split("=", 1)[0].removeprefix("--").replace("-", "_")

    shared = {"log_level", "drain_grace_s"}
    engine_flags = [f for f in flags if name(f) in ENGINE_PROCESS_SETTINGS]
    gateway_flags = [f for f in flags if name(f) not in ENGINE_PROCESS_SETTINGS - shared]
    engine = subprocess.Popen([sys.executable, "-m", "bench.ray_cost", "--alone-child", "engine", "--listen", address,
                               *engine_flags])  # fmt: skip
    try:
        return alone_child(["serve", "--engine", address, *gateway_flags])
    finally:
        engine.send_signal(signal.SIGTERM)
        engine.wait(STOP_LIMIT_S)


def ray_child(port: int, temp_dir: str, settings: dict[str, Any]) -> int:
    """A local Ray, Serve on `port`, fishgate's application (1 engine replica, 1 gateway) on the stand-in, until
    SIGTERM; then Serve and Ray shut down."""
    import ray
    from ray import serve

    from server.ray_serve import ENGINES_ENV, GATEWAYS_ENV, app_builder

    os.environ[ENGINES_ENV] = os.environ[GATEWAYS_ENV] = "1"  # read by the builder, here
    runtime_env = {"worker_process_setup_hook": "bench.standin.install",
                   "env_vars": {"PYTHONPATH": str(ROOT), DEVICE_ENV: os.environ.get(DEVICE_ENV, "")}}  # fmt: skip
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _temp_dir=temp_dir, runtime_env=runtime_env)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())  # after ray.init, whose own handler aborts the process
    try:
        serve.start(proxy_location="Disabled")  # as deploy/ray/serve.yaml: the gateway replica serves the port
        serve.run(app_builder({**settings, "port": port}), name=APP, route_prefix=None)
        print(f"serving on 127.0.0.1:{port}", flush=True)
        stop.wait()
    finally:
        with contextlib.suppress(Exception):
            serve.shutdown()
        ray.shutdown()
    return 0


def write_texts(path: Path, count: int) -> None:
    """One sentence a request, no clause inside: one segment, so a request is --frames frames."""
    rng = random.Random(0)
    lines = [f"Request {i} " + " ".join(rng.choice(WORDS) for _ in range(12)) + "." for i in range(count)]
    path.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--alone-child"]:
        return alone_child(argv[1:])
    if argv[:1] == ["--link-child"]:
        return link_child(argv[1], argv[2:])
    if argv[:1] == ["--ray-child"]:
        return ray_child(int(argv[1]), argv[2], json.loads(argv[3]))
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="output folder")
    ap.add_argument("--streams", default="300,600", help="concurrent client-default streams, levels in turn [300,600]")
    ap.add_argument("--frames", type=int, default=200, help="frames a request (200: 9.3 s of audio) [200]")
    ap.add_argument("--waves", type=int, default=2, help="requests each client sends in turn [2]")
    ap.add_argument("--ramp-s", type=float, default=9.0, help="the first requests spread over this long [9]")
    ap.add_argument("--repeats", type=int, default=1, help="rounds of every side (the order reversed each round) [1]")
    ap.add_argument("--sides", default="alone,ray", help=f"some of {','.join(SIDES)}, in this order [alone,ray]")
    ap.add_argument("--lone-requests", type=int, default=5, help="a lone stream's requests, one after another [5]")
    ap.add_argument("--device-model", default="", help="stand-in GPU times, e.g. step_ms=2,step_ms_per_row=0.03 "
                    f"(bench.standin.DeviceModel; default {DeviceModel()})")  # fmt: skip
    ap.add_argument("--quick", action="store_true", help="4 streams of 20 frames, one wave: checks the script")
    args = ap.parse_args(argv)
    sides = tuple(args.sides.split(","))
    if set(sides) - set(SIDES) or "alone" not in sides:
        ap.error(f"--sides: choose from {','.join(SIDES)}, alone among them")
    given = dict(kv.split("=", 1) for kv in args.device_model.split(",") if kv)
    device = replace(DeviceModel(), **{k: float(v) for k, v in given.items()})
    plan = Plan(
        out=args.out.resolve(), sides=sides, streams=tuple(int(n) for n in args.streams.split(",")),
        waves=args.waves, ramp_s=args.ramp_s, frames=args.frames, repeats=args.repeats,
        lone_requests=args.lone_requests, warm_up=(16, 40), device=device,
    )  # fmt: skip
    if args.quick:
        plan = replace(plan, streams=(4,), waves=1, ramp_s=0.5, frames=20, repeats=1, lone_requests=2, warm_up=(2, 10))
    plan.out.mkdir(parents=True, exist_ok=True)
    write_texts(plan.texts, 4 * max(plan.streams) * plan.waves + 100)
    t0 = time.monotonic()
    result: dict[str, Any] = {
        "what": "bench.ray_cost", "argv": argv, "started": time.strftime("%Y-%m-%d %H:%M:%S"), "cpus": os.cpu_count(),
        "plan": {**asdict(plan), "out": str(plan.out)}, "runs": [],
    }  # fmt: skip
    for round_ in range(1, plan.repeats + 1):
        for name in plan.sides if round_ % 2 else reversed(plan.sides):
            try:
                result["runs"].append(run_side(plan, name, round_))
            except (RuntimeError, OSError, subprocess.SubprocessError) as e:
                result["runs"].append({"side": name, "round": round_, "error": f"{type(e).__name__}: {e}"})
                print(f"[{name} #{round_}] {result['runs'][-1]['error']}", flush=True)
            (plan.out / "ray_cost.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    text, verdicts = compare(plan, [r for r in result["runs"] if "error" not in r])
    result.update(table=text, checks=verdicts, total_s=round(time.monotonic() - t0, 1))
    (plan.out / "ray_cost.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    print("\n" + text)
    print(f"\n{result['total_s']:.0f} s in all; {plan.out / 'ray_cost.json'}")
    return 1 if any("error" in r for r in result["runs"]) else 0


if __name__ == "__main__":
    sys.exit(main())

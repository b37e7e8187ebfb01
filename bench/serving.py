"""One `fishgate serve` of a given source tree under a benchmark, and `fishgate ttfa` levels against it.

The server runs from its tree (that tree first on PYTHONPATH, so its own model/, streaming/ and server/ are what
runs); the load client always runs from this checkout, so two trees are measured by the same client. Nothing here
knows which rows a benchmark reports (bench.gpu, bench.cpu).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.process_tree import stat_fields

ROOT = Path(__file__).resolve().parents[1]  # this checkout: the load client and the measuring scripts come from here
STOP_LIMIT_S = 60.0  # SIGTERM drains running utterances (--drain-grace-s, 20 s by default), then SIGKILL
METRIC = re.compile(r"^(?P<name>[a-z_]+)(?:\{(?P<labels>[^}]*)\})? (?P<value>[-+0-9.eEinfa]+)$")


class ServerFailed(RuntimeError):
    """The server exited or never became ready; the message ends with its log's tail."""


@dataclass(frozen=True, slots=True)
class Tree:
    """A source tree to measure: this checkout or another (e.g. `git archive <commit> | tar -x -C PATH`)."""

    label: str
    path: Path


def add_tree_arguments(ap: argparse.ArgumentParser) -> None:
    """The options that name the trees a command measures: this checkout, and optionally a baseline after it."""
    ap.add_argument("--label", help="this tree's name in the table (default: its commit, else its folder name)")
    ap.add_argument("--baseline-tree", type=Path, help="another source tree, measured the same way after this one")
    ap.add_argument("--baseline-label", help="its name in the table (default: its commit, else its folder name)")


def trees_from(args: argparse.Namespace, ap: argparse.ArgumentParser) -> list[Tree]:
    """This checkout, then the baseline tree if one was given (refused unless it is a fishgate source tree)."""
    trees = [Tree(args.label or tree_label(ROOT), ROOT)]
    if args.baseline_tree is not None:
        if not (args.baseline_tree / "server" / "cli.py").is_file():
            ap.error(f"--baseline-tree {args.baseline_tree} holds no server/cli.py: point it at a fishgate source tree")
        path = args.baseline_tree.resolve()
        trees.append(Tree(args.baseline_label or tree_label(path), path))
    return trees


def tree_env(tree: Path) -> dict[str, str]:
    """The environment of a process that must import `tree`'s packages before this checkout's installed ones."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(tree), env.get("PYTHONPATH", "")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def client_env() -> dict[str, str]:
    """The load client's environment: this checkout's packages first (then the caller's PYTHONPATH, which may hold
    the dependencies)."""
    return tree_env(ROOT)


def tree_label(tree: Path) -> str:
    """The tree's commit (short) with "+changes" where its tracked files differ; its folder name if it is no clone."""

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(tree), *args], capture_output=True, text=True, check=True).stdout

    try:
        if Path(git("rev-parse", "--show-toplevel").strip()).resolve() != tree.resolve():
            return tree.name  # an exported tree inside another clone: that clone's HEAD is not this tree's
        dirty = bool(git("status", "--porcelain", "--untracked-files=no").strip())
        return git("rev-parse", "--short", "HEAD").strip() + ("+changes" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return tree.name


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text → {"name" or 'name{labels}': value} (comment lines skipped)."""
    out = {}
    for line in text.splitlines():
        m = METRIC.match(line.strip())
        if m:
            key = m["name"] + (f"{{{m['labels']}}}" if m["labels"] else "")
            out[key] = float(m["value"])
    return out


def engine_value(metrics: dict[str, float], what: str) -> float | None:
    """One `fishgate_engine{what="..."}` value (None where this tree's server does not export it)."""
    return metrics.get(f'fishgate_engine{{what="{what}"}}')


def server_flags(tree: Path) -> set[str]:
    """The `fishgate serve` flags this tree's server accepts (`--help-all` where it has one, else `--help`)."""
    for option in ("--help-all", "--help"):
        cmd = [sys.executable, "-m", "server.cli", "serve", option]
        done = subprocess.run(cmd, cwd=tree, env=tree_env(tree), capture_output=True, text=True, check=False)
        if done.returncode == 0:
            return set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", done.stdout))
    raise ServerFailed(f"`fishgate serve --help` failed in {tree}:\n{done.stderr[-2000:]}")


def keep_known(args: tuple[str, ...], known: set[str]) -> tuple[list[str], list[str]]:
    """(args without the flags `known` lacks, those flags): `--flag value` pairs and bare `--flag`s alike."""
    kept: list[str] = []
    dropped: list[str] = []
    i = 0
    while i < len(args):
        n = 2 if i + 1 < len(args) and not args[i + 1].startswith("--") else 1
        (kept if args[i] in known else dropped).extend(args[i : i + n])
        i += n
    return kept, [a for a in dropped if a.startswith("--")]


class Server:
    """`python -m server.cli serve ARGS` of one tree on a free port, its output in `log_path`."""

    def __init__(self, tree: Path, args: list[str], log_path: Path) -> None:
        self.tree, self.args, self.log_path = tree, args, log_path
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def live_url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/v1/tts/live"

    def start(self, ready_limit_s: float) -> float:
        """Start it and wait for /readyz; returns the seconds from process start to ready."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "server.cli", "serve", "--port", str(self.port), *self.args]
        t0 = time.perf_counter()
        with self.log_path.open("ab") as log:
            log.write(f"$ {' '.join(cmd)}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(
                cmd, cwd=self.tree, env=tree_env(self.tree), stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: inductor's compile workers stop with it
            )  # fmt: skip
        while time.perf_counter() - t0 < ready_limit_s:
            if self.proc.poll() is not None:
                raise ServerFailed(f"the server exited ({self.proc.returncode}):\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.base_url}/readyz", timeout=2) as r:
                    if r.status == 200:
                        return time.perf_counter() - t0
            except (OSError, urllib.error.URLError):
                pass
            time.sleep(0.5)
        self.stop()
        raise ServerFailed(f"not ready after {ready_limit_s:.0f} s:\n{self.log_tail()}")

    def metrics_text(self) -> str:
        with urllib.request.urlopen(f"{self.base_url}/metrics", timeout=10) as r:
            return str(r.read().decode())

    def metrics(self) -> dict[str, float]:
        return parse_metrics(self.metrics_text())

    def wait_for_graphs(self, limit_s: float) -> float | None:
        """Idle until the engine reports no graph missing (its idle-time captures done); seconds waited, or None
        where the limit passed or this tree's server does not report `graphs_missing`."""
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < limit_s:
            missing = engine_value(self.metrics(), "graphs_missing")
            if missing is None:
                return None
            if missing == 0:
                return time.perf_counter() - t0
            time.sleep(1.0)
        return None

    def cpu_seconds(self) -> dict[int, float]:
        """CPU seconds (user + system) each live process of the server's process group has spent: its gateways, its
        engine child, inductor's compile workers. Linux (/proc); empty elsewhere."""
        return {} if self.proc is None else group_cpu_seconds(self.proc.pid)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=STOP_LIMIT_S)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def group_cpu_seconds(pgid: int) -> dict[int, float]:
    """pid → CPU seconds (user + system) of each live process in process group `pgid` (Linux /proc)."""
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    out: dict[int, float] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        fields = stat_fields(stat.parent.name)
        if fields is not None and int(fields[2]) == pgid:  # pgrp; then utime and stime, not the reaped children's
            out[int(stat.parent.name)] = (int(fields[11]) + int(fields[12])) / tick
    return out


def run_level(url: str, out_dir: Path, *, concurrency: int, requests: int, args: list[str], timeout_s: float,
              ) -> dict[str, Any] | None:  # fmt: skip
    """One `fishgate ttfa` level from this checkout; its summary (server.ttfa_report), or None where it wrote none
    (cut off at `timeout_s`). The whole ttfa.json stays in `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "server.cli", "ttfa", url, "--concurrency", str(concurrency), "--requests",
           str(requests), "--no-plots", "--out", str(out_dir), *args]  # fmt: skip
    with (out_dir / "client.log").open("w") as log:
        log.write(f"$ {' '.join(cmd)}\n")
        log.flush()
        try:
            subprocess.run(cmd, cwd=ROOT, env=client_env(), stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s,
                           check=False)  # fmt: skip
        except subprocess.TimeoutExpired:
            return None
    path = out_dir / "ttfa.json"
    if not path.is_file():
        return None
    summary: dict[str, Any] = json.loads(path.read_text())["levels"][0]["summary"]
    return summary


def side_by_side(labels: list[str], columns: list[dict[str, str]]) -> str:
    """A markdown table: one row per figure (in first-seen order), one column per tree."""
    names: list[str] = []
    for col in columns:
        names += [n for n in col if n not in names]
    lines = ["| figure | " + " | ".join(labels) + " |", "|---" * (len(labels) + 1) + "|"]
    lines += ["| " + " | ".join([n, *(col.get(n, "-") for col in columns)]) + " |" for n in names]
    return "\n".join(lines)


def number(v: float | None, spec: str = "{:.0f}") -> str:
    return "-" if v is None else spec.format(v)

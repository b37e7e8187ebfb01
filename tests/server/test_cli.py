"""The `fishgate` command line as users run it: convert, synth, and a real `serve` process (refusals, draining on
SIGTERM); its flags and help: tests/server/test_settings.py."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

from model.checkpoint import load_dual_ar
from model.codec_checkpoint import load_codec
from server.cli import main
from tests.model.fixture_sets import dual_ar_sets, firefly_sets
from tests.server.conftest import free_port
from tests.server.live_client import LiveClient, LiveResult, open_live

FISHGATE = [sys.executable, "-m", "server.cli"]


@pytest.mark.skipif(not dual_ar_sets() or not firefly_sets(), reason="needs the upstream fixture folders")
def test_convert_writes_safetensors_that_load_identically(tmp_path: Path, capsys) -> None:
    src = tmp_path / "ckpt"
    dual, codec = dual_ar_sets()[0].path, firefly_sets()[0].path
    src.mkdir()
    for name in ("config.json", "model.pth", "tokenizer.tiktoken"):
        shutil.copy(dual / name, src / name)
    shutil.copy(codec / "generator.pth", src / "firefly-gan-vq-fsq-8x1024-21hz-generator.pth")
    shutil.copy(codec / "config.json", src / "codec_config.json")
    before_model = load_dual_ar(src, dtype=torch.float32).model.state_dict()
    before_codec = load_codec(src).state_dict()

    assert main(["convert", str(src)]) == 0
    assert (src / "model.safetensors").is_file() and (src / "generator.safetensors").is_file()
    after = load_dual_ar(src, dtype=torch.float32)
    assert after.weights_path.name == "model.safetensors"  # preferred once present
    for k, v in after.model.state_dict().items():
        assert torch.equal(v, before_model[k]), k
    for k, v in load_codec(src).state_dict().items():
        assert torch.equal(v, before_codec[k]), k
    assert main(["convert", str(src)]) == 0
    assert "nothing to convert" in capsys.readouterr().out

    out = tmp_path / "converted"
    shutil.rmtree(out, ignore_errors=True)
    (src / "model.safetensors").unlink()
    (src / "generator.safetensors").unlink()
    assert main(["convert", str(src), "--out", str(out)]) == 0
    assert load_dual_ar(out, dtype=torch.float32).weights_path == out / "model.safetensors"
    assert not (src / "model.safetensors").exists()
    assert main(["convert", str(tmp_path / "missing")]) == 2


@pytest.mark.parametrize(
    ("flags", "needle"),
    [(["--checkpoint", "/nonexistent/fish"], "/nonexistent/fish"), (["--device", "cuda"], "use --device cpu")],
)
def test_a_refused_configuration_exits_2_with_its_reason_last(tmp_path: Path, flags, needle) -> None:
    """Not the device-fault status 3 a supervisor restarts on, and the fix on the last line, not above a traceback."""
    if "cuda" in flags and torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    env = {**os.environ, "FISHGATE_PORT": str(free_port()), "FISHGATE_REFERENCES_DIR": str(tmp_path / "refs")}
    done = subprocess.run(
        [*FISHGATE, "serve", *flags], check=False, env=env, capture_output=True, text=True, timeout=90
    )
    last = (done.stdout + done.stderr).strip().splitlines()[-1]
    assert done.returncode == 2 and "could not start" in last and needle in last, last


def test_a_port_in_use_exits_2_naming_the_address_and_the_port_is_not_held(tmp_path: Path) -> None:
    env = {**os.environ, "FISHGATE_REFERENCES_DIR": str(tmp_path / "refs")}
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env["FISHGATE_PORT"] = str(port)
        done = subprocess.run([*FISHGATE, "serve"], check=False, env=env, capture_output=True, text=True, timeout=90)
    last = (done.stdout + done.stderr).strip().splitlines()[-1]
    assert done.returncode == 2 and "could not start" in last and f"127.0.0.1:{port}" in last, last
    with socket.socket() as again:  # the failed server holds nothing: the port binds once its first owner is gone
        again.bind(("127.0.0.1", port))


def test_serve_drains_on_sigterm(tmp_path: Path) -> None:
    """SIGTERM: readiness goes false at once, the running utterance finishes, then the process exits 0."""
    port = free_port()
    env = {**os.environ, "FISHGATE_PORT": str(port), "FISHGATE_REFERENCES_DIR": str(tmp_path / "refs"),
           "FISHGATE_DRAIN_GRACE_S": "30"}  # fmt: skip
    proc = subprocess.Popen([*FISHGATE, "serve"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(base, proc)

        async def utterance_across_sigterm():
            async with (
                open_live(f"ws://127.0.0.1:{port}/v1/tts/live") as idle_ws,
                open_live(f"ws://127.0.0.1:{port}/v1/tts/live") as ws,
            ):
                idle = LiveClient(idle_ws)  # a socket between turns: closed with the reason at once, not at the exit
                c = LiveClient(ws)
                await c.start()
                await c.send({"event": "text", "text": "A sentence that is being spoken while the server drains. " * 4})
                await c.send({"event": "flush"})
                r = LiveResult()
                await c.read_until(r, ("audio",))
                proc.send_signal(signal.SIGTERM)
                # the utterance stays open (no stop yet), so the server keeps draining however fast it speaks
                deadline = time.monotonic() + 30
                while (ready := httpx.get(f"{base}/readyz", timeout=5)).status_code == 200:
                    assert time.monotonic() < deadline, "readiness never went false"
                    await asyncio.sleep(0.05)
                idle_result = await asyncio.wait_for(idle.read_until(LiveResult(), kinds=()), 10)
                assert not r.of("finish"), "the idle socket's close came only after the running utterance's end"
                await c.send({"event": "stop"})
                await c.read_until(r)  # the finish
                await c.read_until(r, kinds=())  # then the server's close
                return r, ready, idle_result

        result, ready, idle_result = asyncio.run(utterance_across_sigterm())
        assert idle_result.close_code == 1012 and idle_result.close_reason.startswith("shutting_down"), idle_result
        assert ready.status_code == 503 and ready.json()["state"] == "draining"
        # the running utterance finished whole, then the socket closed as a restart (1012: reconnect elsewhere)
        assert result.events[-1] == {"event": "finish", "reason": "stop"} and result.close_code == 1012
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


def _wait_ready(base: str, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else "server exited"
        try:
            if httpx.get(f"{base}/readyz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError("server did not become ready")


def test_synth_prints_only_what_it_wrote(tmp_path: Path) -> None:
    """No library noise on a normal run (issue 38): no WARNING lines (the start-up collection before the GC freeze is
    not a long pause, streaming.gc_pauses), no Triton "nanobind: leaked" page at exit (frozen objects are unfrozen)."""
    out = tmp_path / "x.wav"
    done = subprocess.run(
        [*FISHGATE, "synth", "Hello there.", "-o", str(out), "--device", "cpu", "--seed", "1"],
        check=False, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stderr == "", done.stderr
    assert done.stdout.startswith(f"wrote {out} (") and len(done.stdout.splitlines()) == 1, done.stdout
    assert out.stat().st_size > 44

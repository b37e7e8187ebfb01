"""The `fishgate` command line as users run it: convert, serve --help, and a real process draining on SIGTERM."""

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


def test_serve_help_documents_every_flag_and_its_env_var(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = capsys.readouterr().out
    for flag in ("--host", "--port", "--checkpoint", "--device", "--max-sessions", "--api-key", "--allowed-origins",
                 "--references-dir", "--max-text-chars", "--max-frame-bytes", "--idle-timeout-s"):  # fmt: skip
        assert flag in out
    assert "FISHGATE_API_KEY" in out and "FISHGATE_MAX_SESSIONS" in out


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
            async with open_live(f"ws://127.0.0.1:{port}/v1/tts/live") as ws:
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
                await c.send({"event": "stop"})
                await c.read_until(r)  # the finish
                await c.read_until(r, kinds=())  # then the server's close
                return r, ready

        result, ready = asyncio.run(utterance_across_sigterm())
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


def test_settings_reject_bad_graph_and_session_counts() -> None:
    from server.settings import parse_settings

    assert parse_settings([]).graphs_up_front is None  # default: every decode graph before ready
    assert parse_settings(["--graphs-up-front", "8"]).graphs_up_front == 8
    assert parse_settings([], {"FISHGATE_GRAPHS_UP_FRONT": "4"}).graphs_up_front == 4
    assert parse_settings([]).graph_first_frames == "on"
    assert parse_settings(["--graph-first-frames", "off"]).graph_first_frames == "off"
    with pytest.raises(SystemExit, match="graph-first-frames must be on or off"):
        parse_settings(["--graph-first-frames", "yes"])
    assert parse_settings([]).graph_prefill == "auto"  # on for a GPU with CUDA graphs, off on CPU (backend)
    assert parse_settings(["--graph-prefill", "on"]).graph_prefill == "on"
    assert parse_settings(["--graph-prefill", "off"]).graph_prefill == "off"
    with pytest.raises(SystemExit, match="graph-prefill must be auto, on or off"):
        parse_settings(["--graph-prefill", "yes"])
    with pytest.raises(SystemExit, match="--graphs-up-front must be at least 1"):
        parse_settings(["--graphs-up-front", "0"])
    assert parse_settings([]).prefill_graphs_up_front == 1  # the one-row prefill graphs before ready
    assert parse_settings(["--prefill-graphs-up-front", "0"]).prefill_graphs_up_front == 0
    assert parse_settings([], {"FISHGATE_PREFILL_GRAPHS_UP_FRONT": "4"}).prefill_graphs_up_front == 4
    with pytest.raises(SystemExit, match=r"--prefill-graphs-up-front must be 0 \(none\) or a row bucket"):
        parse_settings(["--prefill-graphs-up-front", "3"])
    assert parse_settings([]).compile_max_batch is None  # auto: 8 on a GPU with CUDA graphs, off on CPU (backend)
    assert parse_settings(["--compile-max-batch", "0"]).compile_max_batch == 0
    assert parse_settings(["--compile-max-batch", "8"]).compile_max_batch == 8
    assert parse_settings([], {"FISHGATE_COMPILE_CACHE_DIR": "/tmp/cc"}).resolved_compile_cache_dir.name == "cc"
    with pytest.raises(SystemExit, match="--compile-max-batch must be 0"):
        parse_settings(["--compile-max-batch", "-1"])
    assert parse_settings([]).max_queued_chars == 50_000
    with pytest.raises(SystemExit, match="--max-queued-chars must be at least --max-text-chars"):
        parse_settings(["--max-queued-chars", "100"])
    assert parse_settings(["--max-queued-chars", "100", "--max-text-chars", "100"]).max_queued_chars == 100
    assert parse_settings([]).admission_turn_fraction is None
    assert parse_settings(["--admission-turn-fraction", "0.9"]).admission_turn_fraction == 0.9
    assert parse_settings(["--admission-turn-fraction", "off"]).admission_turn_fraction is None
    with pytest.raises(SystemExit, match="--admission-turn-fraction must be in"):
        parse_settings(["--admission-turn-fraction", "3"])
    assert parse_settings([]).admission_capacity_fraction is None
    assert parse_settings(["--admission-capacity-fraction", "0.67"]).admission_capacity_fraction == 0.67
    with pytest.raises(SystemExit, match="--admission-capacity-fraction must be in"):
        parse_settings(["--admission-capacity-fraction", "0"])
    assert parse_settings([]).compile_symbolic_batch_above == 8
    assert parse_settings(["--compile-symbolic-batch-above", "512"]).compile_symbolic_batch_above == 512
    with pytest.raises(SystemExit, match="--compile-symbolic-batch-above must be at least 1"):
        parse_settings(["--compile-symbolic-batch-above", "0"])
    assert parse_settings([]).compile_tune_single_row == "on"
    assert parse_settings(["--compile-tune-single-row", "off"]).compile_tune_single_row == "off"
    with pytest.raises(SystemExit, match="--compile-tune-single-row must be on or off"):
        parse_settings(["--compile-tune-single-row", "no"])
    assert parse_settings([]).prefill_max_rows == 4
    assert parse_settings(["--prefill-max-rows", "8"]).prefill_max_rows == 8
    with pytest.raises(SystemExit, match="--prefill-max-rows must be 1, 2, 4, 8 or 16"):
        parse_settings(["--prefill-max-rows", "6"])
    assert parse_settings([]).length_attention == "auto"
    assert parse_settings(["--length-attention", "on"]).length_attention == "on"
    with pytest.raises(SystemExit, match="--length-attention must be auto, on or off"):
        parse_settings(["--length-attention", "yes"])
    assert parse_settings([]).gemv_kernels == "auto"
    assert parse_settings([]).gemv_configs is None
    assert parse_settings(["--gemv-configs", "/tmp/sweep.json"]).gemv_configs == Path("/tmp/sweep.json")
    assert parse_settings(["--gemv-kernels", "off"]).gemv_kernels == "off"
    with pytest.raises(SystemExit, match="--gemv-kernels must be auto, on or off"):
        parse_settings(["--gemv-kernels", "fast"])
    assert parse_settings([]).programmatic_launch == "auto"
    assert parse_settings(["--programmatic-launch", "off"]).programmatic_launch == "off"
    with pytest.raises(SystemExit, match="--programmatic-launch must be auto or off"):
        parse_settings(["--programmatic-launch", "on"])
    assert parse_settings([]).vocoder_overlap == "auto"
    assert parse_settings(["--vocoder-overlap", "on"]).vocoder_overlap == "on"
    with pytest.raises(SystemExit, match="--vocoder-overlap must be auto, on or off"):
        parse_settings(["--vocoder-overlap", "1"])
    assert parse_settings([]).vocoder_merge_padding == 0
    assert parse_settings(["--vocoder-merge-padding", "32"]).vocoder_merge_padding == 32
    with pytest.raises(SystemExit, match="--vocoder-merge-padding must be at least 0"):
        parse_settings(["--vocoder-merge-padding", "-1"])
    assert parse_settings([]).vocoder_half_step_buckets == "off"
    with pytest.raises(SystemExit, match="--vocoder-half-step-buckets must be on or off"):
        parse_settings(["--vocoder-half-step-buckets", "yes"])
    assert parse_settings([]).admission_per_turn is None
    assert parse_settings(["--admission-per-turn", "4"]).admission_per_turn == 4
    with pytest.raises(SystemExit, match="--admission-per-turn must be at least 1"):
        parse_settings(["--admission-per-turn", "0"])
    assert parse_settings([]).prefill_step_share is None
    assert parse_settings(["--prefill-step-share", "1"]).prefill_step_share == 1.0
    with pytest.raises(SystemExit, match="--prefill-step-share must be in"):
        parse_settings(["--prefill-step-share", "0"])
    assert (parse_settings([]).prefill_hold_below_s, parse_settings([]).prefill_hold_max_s) == (0.1, 0.25)
    assert parse_settings(["--prefill-hold-below-s", "off"]).prefill_hold_below_s is None
    assert parse_settings(["--prefill-hold-max-s", "0.03"]).prefill_hold_max_s == 0.03
    with pytest.raises(SystemExit, match="--prefill-hold-below-s must be in"):
        parse_settings(["--prefill-hold-below-s", "0"])
    with pytest.raises(SystemExit, match="--prefill-hold-max-s must be in"):
        parse_settings(["--prefill-hold-max-s", "-1"])
    assert parse_settings([]).vocoder_channels_last == "on"
    assert parse_settings(["--vocoder-channels-last", "off"]).vocoder_channels_last == "off"
    assert parse_settings(["--vocoder-channels-last", "tuned"]).vocoder_channels_last == "tuned"
    with pytest.raises(SystemExit, match="--vocoder-channels-last must be off, on or tuned"):
        parse_settings(["--vocoder-channels-last", "1"])
    assert parse_settings([]).compile_vocoder == "off"
    assert parse_settings(["--compile-vocoder", "on"]).compile_vocoder == "on"
    with pytest.raises(SystemExit, match="--compile-vocoder must be on or off"):
        parse_settings(["--compile-vocoder", "yes"])
    with pytest.raises(SystemExit, match="--max-sessions must be at least 1"):
        parse_settings(["--max-sessions", "0"])


def test_the_prompt_hold_flags_reach_the_engines_worker_limits() -> None:
    """--prefill-hold-below-s / --prefill-hold-max-s are the worker's prompt holds (the engine is built, not started)."""
    from server.app import build_gateway
    from server.settings import parse_settings

    limits = build_gateway(parse_settings([])).engine.config.limits
    assert (limits.prefill_hold_below_s, limits.prefill_hold_max_s, limits.prefill_hold_for) == (0.1, 0.25, "low")
    flags = ["--prefill-hold-below-s", "off", "--prefill-hold-max-s", "0.05"]
    limits = build_gateway(parse_settings(flags)).engine.config.limits
    assert (limits.prefill_hold_below_s, limits.prefill_hold_max_s) == (None, 0.05)
    limits = build_gateway(parse_settings(["--prefill-hold-for", "all"])).engine.config.limits
    assert limits.prefill_hold_for == "all"
    with pytest.raises(SystemExit, match="--prefill-hold-for must be low or all"):
        parse_settings(["--prefill-hold-for", "some"])


def test_the_pacing_flag_reaches_the_engines_worker_limits() -> None:
    """--pace-lead-s is the worker's pacing lead (1.5 s by default; off turns it off; at most PACE_NEEDY_S is refused:
    a stream so close to its client would count as needy itself)."""
    from server.app import build_gateway
    from server.settings import parse_settings

    assert build_gateway(parse_settings([])).engine.config.limits.pace_lead_s == 1.5
    assert build_gateway(parse_settings(["--pace-lead-s", "off"])).engine.config.limits.pace_lead_s is None
    assert build_gateway(parse_settings(["--pace-lead-s", "3.5"])).engine.config.limits.pace_lead_s == 3.5
    for bad in ("0.5", "0", "61"):
        with pytest.raises(SystemExit, match="--pace-lead-s must be in"):
            parse_settings(["--pace-lead-s", bad])


def test_compile_after_ready_reaches_the_backend_config() -> None:
    """--compile-after-ready on|off (off by default) is the backend's compile_after_ready (the stepper's
    defer_compile); anything else is refused with the choices."""
    from server.app import build_gateway
    from server.settings import parse_settings

    assert build_gateway(parse_settings([])).engine.config.backend.compile_after_ready is False
    on = build_gateway(parse_settings(["--compile-after-ready", "on"]))
    assert on.engine.config.backend.compile_after_ready is True
    with pytest.raises(SystemExit, match="--compile-after-ready must be on or off"):
        parse_settings(["--compile-after-ready", "yes"])

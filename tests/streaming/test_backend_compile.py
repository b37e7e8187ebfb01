"""What the backend turns on by itself: w1/w3 fused at load everywhere; compiled step regions only where asked for
or, by default (None = auto), on a GPU with CUDA graphs — not on CPU, where it made the default voice's step slower."""

from __future__ import annotations

import os

import pytest

from model.layers import Attention, FeedForward
from streaming.backend import SYMBOLIC_SMALL_BATCHES, Backend, symbolic_batch_above, use_compile_cache
from streaming.config import BackendConfig


def test_cpu_backend_fuses_feed_forward_and_compiles_nothing_by_default() -> None:
    backend = Backend(BackendConfig(max_sessions=2, compile_max_batch=None))
    assert backend.compile_max_batch == 0
    assert backend.stepper.compile_backend is None
    feed_forwards = [m for m in backend.model.modules() if isinstance(m, FeedForward)]
    assert feed_forwards and all(m.w13 is not None for m in feed_forwards)


def test_an_explicit_compile_limit_is_kept_on_cpu() -> None:
    backend = Backend(BackendConfig(max_sessions=2, compile_max_batch=1))
    assert backend.compile_max_batch == 1
    assert backend.stepper.compile_backend == "inductor" and backend.stepper.compile_max_batch == 1


def test_compiled_buckets_above_one_row_share_a_symbolic_compilation_unless_large_ones_compile() -> None:
    """The latency profile (buckets up to 8 rows compiled) compiles 2-8 rows once with a symbolic batch; an engine
    that compiles larger buckets (the throughput profile) keeps the small ones static and starts its symbolic
    compilation above them, where inductor then picks its kernels."""
    assert [symbolic_batch_above(n) for n in (1, 2, SYMBOLIC_SMALL_BATCHES)] == [1, 1, 1]
    assert symbolic_batch_above(SYMBOLIC_SMALL_BATCHES + 1) == symbolic_batch_above(512) == SYMBOLIC_SMALL_BATCHES
    assert Backend(BackendConfig(max_sessions=4, compile_max_batch=4)).stepper.symbolic_batch_above == 1
    assert Backend(BackendConfig(max_sessions=16, compile_max_batch=16)).stepper.symbolic_batch_above == 8


def test_length_attention_is_refused_where_its_kernel_cannot_run() -> None:
    """The length-aware decode attention is a CUDA kernel: on CPU the backend refuses it at start-up, naming the fix,
    and by default (auto) no layer uses it there, nor with it off."""
    for choice in (None, False):
        backend = Backend(BackendConfig(max_sessions=2, length_attention=choice))
        assert backend.length_attention is False
        assert not any(m.length_attention for m in backend.model.modules() if isinstance(m, Attention))
    with pytest.raises(ValueError, match=r"--length-attention on needs a CUDA GPU.*use auto or off"):
        Backend(BackendConfig(max_sessions=2, length_attention=True))


def test_gemv_kernels_are_refused_where_they_cannot_run() -> None:
    """model.gemv's one-row kernels are CUDA kernels: on CPU the backend refuses `on` at start-up, naming the fix, and
    by default (auto) and with them off the process runs the eager products (gemv.MODE "off")."""
    from model import gemv

    for choice in (None, False):
        backend = Backend(BackendConfig(max_sessions=2, gemv_kernels=choice))
        assert backend.gemv_kernels is False and gemv.MODE == "off"
    with pytest.raises(ValueError, match=r"--gemv-kernels on needs a CUDA GPU.*use auto or off"):
        Backend(BackendConfig(max_sessions=2, gemv_kernels=True))


def test_programmatic_launch_is_off_where_the_gpu_lacks_it() -> None:
    """--programmatic-launch: model.launch_overlap's process-wide mode follows the flag, and a CPU engine (the
    interpreter has no griddepcontrol) launches plainly either way."""
    from model import launch_overlap

    try:
        for choice in (True, False):
            backend = Backend(BackendConfig(max_sessions=2, programmatic_launch=choice))
            assert ("auto" if choice else "off") == launch_overlap.MODE
            assert backend.programmatic_launch is False and launch_overlap.kernel_options(backend.device) == {
                "PDL": False
            }
    finally:
        launch_overlap.MODE = "auto"


def test_gemv_configs_file_is_read_at_start_up_and_a_bad_one_named(tmp_path) -> None:
    """--gemv-configs: bench.gemv_sweep's JSON adds its launch configs (read even on CPU, where the kernels are off,
    so a bad file stops the start, naming the fix); an unlaunchable entry adds nothing."""
    import json

    from model import gemv

    saved = dict(gemv.CONFIGS)
    try:
        good = tmp_path / "sweep.json"
        entry = {"n": 96, "k": 64, "fused": "norm", "block_n": 4, "k_chunks": 2, "num_warps": 4, "us": 1.0}
        good.write_text(json.dumps({"configs": [entry]}))
        Backend(BackendConfig(max_sessions=2, gemv_configs=good))
        assert gemv.CONFIGS[(96, 64, "norm")] == (4, 2, 4)
        bad = tmp_path / "bad.json"
        bad.write_text(json.dumps({"configs": [{**entry, "n": 97, "block_n": 3}]}))
        with pytest.raises(
            ValueError, match=r"--gemv-configs .*bad.json: not a bench.gemv_sweep result.*gemv_sweep --out"
        ):
            Backend(BackendConfig(max_sessions=2, gemv_configs=bad))
        assert (97, 64, "norm") not in gemv.CONFIGS
        bad.write_text(json.dumps({"configs": [{**entry, "n": 98, "k_chunks": 8}]}))  # up to 4 pieces a program
        with pytest.raises(ValueError, match=r"K_CHUNKS 1-4"):
            Backend(BackendConfig(max_sessions=2, gemv_configs=bad))
        assert (98, 64, "norm") not in gemv.CONFIGS
        with pytest.raises(ValueError, match=r"not a bench\.gemv_sweep result"):
            Backend(BackendConfig(max_sessions=2, gemv_configs=tmp_path / "missing.json"))
    finally:
        gemv.CONFIGS.clear()
        gemv.CONFIGS.update(saved)


def test_one_compile_cache_folder_holds_inductors_and_tritons_caches(tmp_path, monkeypatch) -> None:
    """--compile-cache-dir is the one folder a deployment keeps: inductor's caches and, unless TRITON_CACHE_DIR is
    exported, Triton's (model/'s own kernels would otherwise compile into ~/.triton on every new container)."""
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    use_compile_cache(tmp_path / "cc")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "cc") and (tmp_path / "cc").is_dir()
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "cc" / "triton")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "exported"))
    use_compile_cache(tmp_path / "other")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "other")
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "exported")  # the operator's choice stays


def test_a_compiling_backend_puts_its_caches_in_its_folder(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    Backend(BackendConfig(max_sessions=2, compile_max_batch=1, compile_cache_dir=tmp_path / "cc"))
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "cc")
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "cc" / "triton")

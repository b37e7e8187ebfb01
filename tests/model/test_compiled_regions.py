"""The decode step's fast paths against their slow paths on CPU: w1/w3 fused into one matmul, the step's regions
run through torch.compile (dynamo tracing with the "eager" backend; inductor's CPU code for one batch bucket), and a
region whose compiler fails falling back to eager. The CUDA versions run in tests/model/test_gpu.py."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from model import compiled_regions
from model.layers import FeedForward
from model.stepper import DecodeStepper, RowSampling
from tests.model.test_kv_cache import make_model, random_sequence

SAMPLINGS = [RowSampling(0.0, 1.0, 1.0, seed=1), RowSampling(0.7, 0.7, 1.2, seed=2), RowSampling(0.9, 0.8, 1.3, seed=3)]


def run_stepper(stepper: DecodeStepper, n_rows: int, n_steps: int) -> torch.Tensor:
    """Prefill n_rows streams, sample their first frames, then n_steps committed steps: frames (steps+1, rows, 1+nc)."""
    firsts = []
    for row in range(n_rows):
        stepper.set_sampling(row, SAMPLINGS[row])
        stepper.set_noise_step(row, 0)
        prompt = random_sequence(stepper.model, 9 + 6 * row, seed=row)
        logits, hidden = stepper.prefill(row, prompt, 0)
        firsts.append(stepper.start_segment(row, logits, hidden, prompt.shape[1]))
    frames = [torch.stack(firsts).cpu()]  # first frames stay on the device; step's frames come back to the host
    for _ in range(n_steps):
        stepper.commit[:n_rows] = True
        frames.append(stepper.step(n_rows, int(stepper.pos[:n_rows].max())))
    return torch.stack(frames)


def test_fused_feed_forward_equals_the_two_matmuls_and_keeps_the_official_keys() -> None:
    torch.manual_seed(0)
    ff = FeedForward(16, 40)
    x = torch.randn(3, 5, 16)
    before = ff(x)
    keys = set(ff.state_dict())
    ff.fuse()
    assert ff.w13 is not None and ff.w1.weight.data_ptr() == ff.w13.data_ptr()
    assert set(ff.state_dict()) == keys
    torch.testing.assert_close(ff(x), before, rtol=1e-6, atol=1e-6)
    # loading weights after fusing writes through the views into the fused tensor
    other = FeedForward(16, 40)
    ff.load_state_dict(other.state_dict())
    torch.testing.assert_close(ff(x), other(x), rtol=1e-6, atol=1e-6)
    # moving the module fuses the moved weights again
    ff = ff.to(torch.float64)
    assert ff.w13 is not None and ff.w13.dtype == torch.float64 and ff.w3.weight.data_ptr() > ff.w13.data_ptr()
    torch.testing.assert_close(ff(x.double()), other.double()(x.double()), rtol=1e-12, atol=1e-12)


def test_fused_model_decodes_the_same_frames() -> None:
    model = make_model("gqa_fast_project")
    expected = run_stepper(DecodeStepper(model, 4, max_seq_len=128, length_buckets=[64]), 3, 6)
    model.fuse_feed_forward()
    assert torch.equal(run_stepper(DecodeStepper(model, 4, max_seq_len=128, length_buckets=[64]), 3, 6), expected)


def test_regions_traced_by_dynamo_decode_the_same_frames() -> None:
    """fullgraph tracing of every region (a graph break would fail the compile and show in failed_regions)."""
    model = make_model("gqa_fast_project")
    expected = run_stepper(DecodeStepper(model, 4, max_seq_len=128, length_buckets=[64]), 3, 6)
    stepper = DecodeStepper(model, 4, max_seq_len=128, length_buckets=[64], compile_backend="eager")
    assert torch.equal(run_stepper(stepper, 3, 6), expected)
    assert compiled_regions.failed_regions() == []
    assert compiled_regions.active_backend() is None, "regions stay compiled only inside the step"


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_inductor_compiled_regions_decode_the_same_frames() -> None:
    """Inductor's own CPU kernels (fused elementwise, its reductions) for a one-row bucket, fp32: same frames."""
    model = make_model("gqa_fast_project")
    expected = run_stepper(DecodeStepper(model, 2, max_seq_len=64, length_buckets=[64]), 1, 4)
    stepper = DecodeStepper(model, 2, max_seq_len=64, length_buckets=[64], compile_backend="inductor")
    got = run_stepper(stepper, 1, 4)
    assert compiled_regions.failed_regions() == []
    assert torch.equal(got, expected)  # one greedy row


def test_a_region_whose_compiler_fails_runs_eagerly_for_those_shapes(caplog: pytest.LogCaptureFixture) -> None:
    compiled_shapes = []

    def backend_broken_on_four(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> object:
        shapes = [tuple(t.shape) for t in example_inputs if isinstance(t, torch.Tensor)]
        compiled_shapes.append(shapes)
        if (4,) in shapes:
            raise RuntimeError("the compiler broke")
        return gm.forward

    @compiled_regions.region
    def double(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    four, five = torch.arange(4.0), torch.arange(5.0)
    with compiled_regions.compiled(backend_broken_on_four), caplog.at_level("WARNING", logger="fishgate.compile"):
        assert torch.equal(double(four), four * 2)
        assert torch.equal(double(four), four * 2)
        assert torch.equal(double(five), five * 2)
    assert compiled_shapes == [[(4,)], [(5,)]], "a failed shape is not compiled again; other shapes still compile"
    assert "double" in " ".join(compiled_regions.failed_regions())
    assert "runs eagerly" in caplog.text
    compiled_regions.reset()
    assert compiled_regions.failed_regions() == []


def test_top_p_cumsum_reaches_the_compiler_as_the_opaque_op() -> None:
    """Inductor's split-scan codegen failed on top-p's cumsum at (8, 102048) in torch 2.11 (on the GPU): while
    dynamo traces, the cumsum must be the custom op (ATen's kernel at run time); eagerly it is plain torch.cumsum."""
    from model.sampling import sample

    graphs: list[str] = []

    def recording_backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> object:
        graphs.append(str(gm.graph))
        return gm.forward

    logits, q = torch.randn(2, 50), torch.rand(2, 50) + 0.1
    params = (torch.full((2,), 0.7), torch.full((2,), 0.8), torch.full((2,), 1.2))
    window = torch.randint(0, 50, (2, 4))
    expected = sample(logits, window, *params, q)
    with compiled_regions.compiled(recording_backend):
        got = sample(logits, window, *params, q)
    assert torch.equal(got, expected)
    assert graphs and "cumsum_last_dim" in graphs[0] and "torch.cumsum" not in graphs[0]


def test_reduction_attention_equals_plain_attention_eager_and_compiled() -> None:
    """The what-if decode attention (fp32 products and sums for inductor) against the plain softmax attention, with
    a ragged mask and without one, eagerly and through inductor; and the model uses it only while compiling."""
    from model.layers import Attention, invariant_attention, reduction_attention

    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(3, 2, 8, 64, generator=g), torch.randn(3, 2, 50, 64, generator=g),
               torch.randn(3, 2, 50, 64, generator=g))  # fmt: skip
    mask = torch.arange(50)[None, None, None, :] <= torch.tensor([3, 20, 49])[:, None, None, None]
    compiled = torch.compile(reduction_attention, backend="inductor")
    for m in (mask.expand(3, 1, 8, 50), None):
        ref = invariant_attention(q, k, v, m)
        assert (reduction_attention(q, k, v, m) - ref).abs().max() <= 1e-5
        assert (compiled(q, k, v, m) - ref).abs().max() <= 1e-5
    assert Attention.decode_attention == "auto"  # the shipped rule: reductions for one row while compiling


def test_decode_attention_rule_picks_reductions_for_one_row_while_compiling(monkeypatch: pytest.MonkeyPatch) -> None:
    """ "auto": one cached row while compiling (H200: batch-1 step 3.83 → 3.27 ms); SDPA for more rows (slower
    there), for prompts (seqlen > 1), without a cache and whenever nothing compiles; "sdpa" never, "reduction" always."""
    from model.layers import Attention

    attn = Attention(64, 4, 2, qkv_bias=False)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert attn._by_reduction(1, 1, cached=True)
    assert not attn._by_reduction(2, 1, cached=True)
    assert not attn._by_reduction(1, 7, cached=True)
    assert not attn._by_reduction(1, 1, cached=False)
    monkeypatch.setattr(attn, "decode_attention", "reduction")
    assert attn._by_reduction(8, 1, cached=True)
    monkeypatch.setattr(attn, "decode_attention", "sdpa")
    assert not attn._by_reduction(1, 1, cached=True)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: False)
    monkeypatch.setattr(attn, "decode_attention", "auto")
    assert not attn._by_reduction(1, 1, cached=True)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_tuned_regions_compile_with_the_tuned_options_and_equal_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    """`compiled(backend, tuned=True)` compiles a separate variant with tuned_options() (TUNED_OPTIONS, the static
    launcher off; inductor only; other backends take no options), and its output equals the eager region's."""
    options = []
    real_compile = torch.compile

    def spy(fn, **kwargs):  # type: ignore[no-untyped-def]
        options.append(kwargs.get("options"))
        return real_compile(fn, **kwargs)

    monkeypatch.setattr(torch, "compile", spy)

    @compiled_regions.region
    def gemv(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, w).relu()

    torch.manual_seed(0)
    x, w = torch.randn(1, 32), torch.randn(16, 32)
    expected = gemv(x, w)
    got = []
    for backend, tuned in [("inductor", False), ("inductor", True), ("inductor", True), ("eager", True)]:
        with compiled_regions.compiled(backend, tuned=tuned):
            got.append(gemv(x, w))
    assert options == [None, compiled_regions.tuned_options(), None], "one compile per variant; eager takes no options"
    for out in got:
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    compiled_regions.reset()


def test_the_stepper_tunes_only_the_one_row_bucket(monkeypatch: pytest.MonkeyPatch) -> None:
    import model.stepper as stepper_module

    seen = []
    real_compiled = stepper_module.compiled

    def spy(backend, tuned=False, symbolic_batch=None):  # type: ignore[no-untyped-def]
        seen.append((backend, tuned))
        return real_compiled(backend, tuned=tuned, symbolic_batch=symbolic_batch)

    monkeypatch.setattr(stepper_module, "compiled", spy)
    model = make_model("gqa_fast_project")
    stepper = DecodeStepper(
        model, 4, max_seq_len=64, length_buckets=[64], compile_backend="eager", tune_single_row=True
    )
    assert not stepper.tune_single_row, "CPU kernels gain nothing from the tuning: CUDA devices only"
    stepper.tune_single_row = True  # as on a CUDA device
    run_stepper(stepper, 2, 0)
    for rows, tuned in [(1, True), (2, False), (1, True)]:
        seen.clear()
        stepper.commit[:rows] = True
        stepper.step(rows, int(stepper.pos[:rows].max()))
        assert seen == [("eager", tuned)], rows
    compiled_regions.reset()


def test_symbolic_batch_buckets_share_compilations_and_decode_the_same_frames() -> None:
    """Buckets above `symbolic_batch_above` compile with a symbolic batch: buckets 2 and 4 share one compilation of
    each region instead of one each (counted by a tracing backend), and decode exactly the eager frames."""
    compiles: list[int] = []

    def counting(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> object:
        compiles.append(1)
        return gm.forward

    model = make_model("gqa_fast_project")
    expected = {n: run_stepper(DecodeStepper(model, 4, max_seq_len=64, length_buckets=[64]), n, 3) for n in (2, 3)}
    counts = {}
    for above in (None, 1):
        compiled_regions.reset()
        compiles.clear()
        for n in (2, 3):  # buckets 2 and 4
            stepper = DecodeStepper(
                model, 4, max_seq_len=64, length_buckets=[64], compile_backend=counting,  # type: ignore[arg-type]
                symbolic_batch_above=above,
            )  # fmt: skip
            assert torch.equal(run_stepper(stepper, n, 3), expected[n]), (above, n)
        counts[above] = len(compiles)
    assert compiled_regions.failed_regions() == []
    assert counts[1] < counts[None], counts
    compiled_regions.reset()


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_inductor_symbolic_batch_decodes_the_same_frames() -> None:
    """Inductor's CPU code with a symbolic batch (fp32): the greedy row's frames equal eager's, the sampled rows'
    nearly all (fused kernels round differently)."""
    model = make_model("gqa_fast_project")
    expected = run_stepper(DecodeStepper(model, 4, max_seq_len=64, length_buckets=[64]), 3, 4)
    stepper = DecodeStepper(
        model, 4, max_seq_len=64, length_buckets=[64], compile_backend="inductor", symbolic_batch_above=1
    )
    got = run_stepper(stepper, 3, 4)
    assert compiled_regions.failed_regions() == []
    assert torch.equal(got[:, 0], expected[:, 0])
    assert (got == expected).float().mean() >= 0.9
    compiled_regions.reset()


CACHE_COUNT_SCRIPT = """
import json, torch
from model import compiled_regions

@compiled_regions.region
def scaled_sum(x):
    return (x * 3 + 1).sum(-1)

x = torch.arange(12, dtype=torch.float32).view(3, 4)
with compiled_regions.compiled("inductor"):
    out = scaled_sum(x)
assert torch.equal(out, (x * 3 + 1).sum(-1))
print(json.dumps(compiled_regions.cache_counts()))
"""


def run_script(script: str, env: dict[str, str], timeout_s: float, argv: tuple[str, ...] = ()) -> Any:
    """Run `script` with `argv` in a fresh process from the repo root, the environment updated with `env`; the JSON
    it printed last."""
    import json
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run(
        [sys.executable, "-c", script, *argv], check=False, env={**os.environ, **env}, capture_output=True, text=True,
        timeout=timeout_s, cwd=root,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def cache_counts_of_starts(
    script: str, caches: dict[str, str], timeout_s: float, starts: int = 2
) -> list[dict[str, int]]:
    """Run `script` (which prints compiled_regions.cache_counts() as JSON last) in `starts` fresh processes with the
    environment's cache folders set to `caches`, as a server and its restarts; their counts."""
    return [run_script(script, caches, timeout_s) for _ in range(starts)]


def test_cache_counts_tell_a_compile_from_a_cache_load(tmp_path) -> None:
    """A process that compiles a region into an empty cache counts it as compiled; the next process (a restarted
    server) loads it from inductor's on-disk cache. Fresh processes: a test process that compiled from a temporary
    cache folder broke later compiles in it."""
    first, second = cache_counts_of_starts(CACHE_COUNT_SCRIPT, {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}, 300)
    assert set(first) == set(compiled_regions.CACHE_COUNTERS)
    assert first["fx_graphs_compiled"] == 1 and first["fx_graphs_from_cache"] == 0
    assert second["fx_graphs_compiled"] == 0 and second["fx_graphs_from_cache"] == 1


def test_cache_counts_before_any_compile_are_zeros_without_importing_dynamo() -> None:
    """A server that compiles nothing reads the counts at ready: zeros, and dynamo (~1.2 s of imports) stays out."""
    import subprocess
    import sys

    script = (
        "import sys; from model import compiled_regions; counts = compiled_regions.cache_counts(); "
        "assert 'torch._dynamo' not in sys.modules, 'dynamo imported'; "
        "assert counts == dict.fromkeys(compiled_regions.CACHE_COUNTERS, 0), counts"
    )
    done = subprocess.run([sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]

"""model.gemv's one-row kernels against the eager products they replace, on CPU through Triton's interpreter (a
subprocess: the interpreter is chosen when the kernels are defined): alone (sizes that are no powers of two, fp32 and
bf16), and inside a one-row decode step whose regions dynamo traces, against the same step with the
kernels off. Skipped where Triton is not installed; tests/model/test_gpu.py runs the tuned one-row step on CUDA."""

from __future__ import annotations

import importlib.util
import textwrap

import pytest

from tests.model.triton_interpreter import run_interpreted

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton (its interpreter)")

CHECK = textwrap.dedent(
    """
    import torch
    import torch.nn.functional as F
    from model import compiled_regions, gemv

    gen = torch.Generator().manual_seed(0)
    for n, k in [(96, 64), (1280, 1024), (37, 200), (1024, 4096)]:
        w = torch.randn(n, k, generator=gen) / k**0.5
        x = torch.randn(1, 1, k, generator=gen)
        got = gemv.launch(x.reshape(-1), w).view(1, 1, n)
        torch.testing.assert_close(got, F.linear(x, w), rtol=1e-5, atol=1e-5)
    # bf16: the product within bf16 rounding of F.linear's in fp32
    w = (torch.randn(64, 128, generator=gen) / 12).bfloat16()
    x = torch.randn(1, 128, generator=gen).bfloat16()
    want = F.linear(x.float(), w.float())
    got = gemv.launch(x.reshape(-1), w).float()
    assert ((got - want).norm() / want.norm()).item() < 1e-2

    # outside a compiled region, or more than one row: the eager ops (and bitwise their results)
    x, w = torch.randn(2, 1, 64, generator=gen), torch.randn(32, 64, generator=gen)
    assert not gemv.applies(x[:1], w) and torch.equal(gemv.linear(x, w), F.linear(x, w))

    # a one-row decode step of the test model, its regions traced (the kernels as the custom op), against kernels off
    from tests.model.test_kv_cache import make_model, random_sequence

    model = make_model("gqa_fast_project")
    model.fuse_feed_forward()
    frames = random_sequence(model, 1, seed=3)[:, 0].unsqueeze(0)
    outs = {}
    for mode in ("off", "auto"):
        gemv.MODE = mode
        compiled_regions.reset()
        cache = model.make_cache(n_slots=1)
        graphs = []

        def recording_backend(gm, example_inputs):
            graphs.append(str(gm.graph))
            return gm.forward

        with torch.inference_mode(), compiled_regions.compiled(recording_backend):
            logits, hidden = model.decode_slow(frames, cache, torch.tensor([5]), 64)
            fast = model.fast_step(hidden, model.make_fast_cache(1), 0)
        outs[mode] = (logits, fast)
        used = sum(g.count("one_row_gemv") for g in graphs)
        assert (used > 0) == (mode == "auto"), (mode, used)
    assert compiled_regions.failed_regions() == []
    for a, b in zip(outs["off"], outs["auto"]):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)
    print("ok")
    """
)


def test_one_row_gemv_kernels_equal_the_eager_products_in_the_interpreter() -> None:
    run_interpreted(CHECK)

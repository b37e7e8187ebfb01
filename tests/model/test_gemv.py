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
    # every fused form against the eager ops it replaces (gemv.reference), fp32, sizes that are no powers of two,
    # with the rule of thumb's config and with configs that split K into unrolled pieces
    for n, k in [(96, 64), (160, 1024), (37, 200), (48, 4096)]:
        w = torch.randn(n, k, generator=gen) / k**0.5
        x = torch.randn(1, 1, k, generator=gen) * 3
        norm = torch.rand(k, generator=gen) + 0.5
        gate_up = torch.randn(1, 1, 2 * k, generator=gen)
        res = torch.randn(1, 1, n, generator=gen)
        for config in (None, (4, 2, 4), (1, 4, 2)):
            cases = [
                (x, {}),
                (x, {"norm_weight": norm, "eps": 1e-5}),
                (x, {"residual": res}),
                (gate_up, {"swiglu": True, "residual": res}),
            ]
            if k % 64 == 0 and n % 32 == 0:  # heads of 16 (96 = 6) and 32 (160 = 5) rows: some of them rotated
                head = 16 if n == 96 else 32
                angles = torch.rand(head // 2, generator=gen) * 6
                table = torch.stack([angles.cos(), angles.sin()], dim=-1)  # (hd/2, 2)
                cases.append((x, {"norm_weight": norm, "eps": 1e-5, "rope": table, "rope_rows": n - 2 * head}))
            for inp, kw in cases:
                got = gemv.launch(
                    inp.reshape(-1), w, kw.get("norm_weight"), None if "residual" not in kw else kw["residual"].reshape(-1),
                    kw.get("eps", 0.0), kw.get("swiglu", False), config=config,
                    rope=None if "rope" not in kw else kw["rope"].reshape(-1), rope_rows=kw.get("rope_rows", 0),
                ).view(1, 1, n)
                torch.testing.assert_close(got, gemv.reference(inp, w, **kw), rtol=1e-5, atol=1e-5, msg=lambda m: f"{n}x{k} {config} {sorted(kw)}: {m}")
    # several rows at once (one weight read): each row as alone, per-row RoPE tables and cache positions
    w, norm = torch.randn(96, 64, generator=gen), torch.rand(64, generator=gen) + 0.5
    xs, res = torch.randn(3, 64, generator=gen), torch.randn(3, 96, generator=gen)
    angles = torch.rand(3, 8, generator=gen) * 6
    tables = torch.stack([angles.cos(), angles.sin()], dim=-1).reshape(3, 16)
    for kw in ({}, {"norm_weight": norm, "eps": 1e-5}, {"residual": res}, {"norm_weight": norm, "rope": tables, "rope_rows": 64}):
        got = gemv.launch(xs, w, kw.get("norm_weight"), kw.get("residual"), kw.get("eps", 0.0), rope=kw.get("rope"),
                          rope_rows=kw.get("rope_rows", 0), config=(4, 2, 4))
        torch.testing.assert_close(got, gemv.reference(xs, w, **kw), rtol=1e-5, atol=1e-5, msg=lambda m: f"{sorted(kw)}: {m}")
    gate_up = torch.randn(2, 128, generator=gen)
    torch.testing.assert_close(gemv.launch(gate_up, w, swiglu=True), gemv.reference(gate_up, w, swiglu=True), rtol=1e-5, atol=1e-5)
    big_k, big_v = torch.zeros(5, 2, 10, 16), torch.zeros(5, 2, 10, 16)
    out = gemv.launch(xs, w, norm, None, 1e-5, rope=tables, rope_rows=64, k_cache=big_k[1:4], v_cache=big_v[1:4],
                      cache_pos=torch.tensor([7, 0, 9]))  # fmt: skip
    for m, pos in enumerate([7, 0, 9]):
        assert torch.equal(big_k[1 + m, :, pos].reshape(-1), out[m, 32:64]), m
        assert torch.equal(big_v[1 + m, :, pos].reshape(-1), out[m, 64:]), m
    assert big_k.count_nonzero() <= 3 * 32 and big_v.count_nonzero() <= 3 * 32

    # wqkv's keys and values written into the caches by the same kernel: exactly the values it returns, at the
    # position, nowhere else (2 kv heads of 16: n = 96 = 64 rotated + 32 values)
    w, x, norm = torch.randn(96, 64, generator=gen), torch.randn(64, generator=gen), torch.rand(64, generator=gen)
    angles = torch.rand(8, generator=gen) * 6
    table = torch.stack([angles.cos(), angles.sin()], dim=-1).reshape(-1)
    big_k, big_v = torch.zeros(3, 2, 10, 16), torch.zeros(3, 2, 10, 16)
    k_view, v_view = big_k[1:2], big_v[1:2]  # a slot's view, as the stepper passes
    out = gemv.launch(x, w, norm, None, 1e-5, rope=table, rope_rows=64, k_cache=k_view, v_cache=v_view,
                      cache_pos=torch.tensor([7]))  # fmt: skip
    torch.testing.assert_close(out, gemv.reference(x, w, norm, 1e-5, rope=table, rope_rows=64), rtol=1e-5, atol=1e-5)
    assert torch.equal(big_k[1, :, 7].reshape(-1), out[32:64]) and torch.equal(big_v[1, :, 7].reshape(-1), out[64:])
    assert big_k.count_nonzero() <= 32 and big_v.count_nonzero() <= 32

    # bf16: within bf16 rounding of the fp32 chain on the same values, the fused ops rounding as the eager ones do
    w = (torch.randn(64, 128, generator=gen) / 12).bfloat16()
    x = torch.randn(1, 128, generator=gen).bfloat16()
    norm = (torch.rand(128, generator=gen) + 0.5).bfloat16()
    res = torch.randn(1, 64, generator=gen).bfloat16()
    for kw in ({}, {"norm_weight": norm, "eps": 1e-6, "residual": res}):
        want = gemv.reference(x.float(), w.float(), **{a: (b.float() if torch.is_tensor(b) else b) for a, b in kw.items()})
        got = gemv.launch(x.reshape(-1), w, kw.get("norm_weight"), None if "residual" not in kw else res.reshape(-1), kw.get("eps", 0.0)).float()
        assert ((got - want.reshape(-1)).norm() / want.norm()).item() < 1e-2, kw
    gate_up = torch.randn(1, 256, generator=gen).bfloat16()
    want = gemv.reference(gate_up, w, swiglu=True).float()
    got = gemv.launch(gate_up.reshape(-1), w, swiglu=True).float()
    assert ((got - want.reshape(-1)).norm() / want.norm()).item() < 1e-2

    # outside a compiled region, or more than one row: the eager ops (and bitwise their results)
    x, w = torch.randn(2, 1, 64, generator=gen), torch.randn(32, 64, generator=gen)
    assert not gemv.applies(x[:1], w) and torch.equal(gemv.linear(x, w), F.linear(x, w))
    assert torch.equal(gemv.linear(x, w, residual=x[..., :32]), x[..., :32] + F.linear(x, w))

    # decode steps of the test model (one row, then three at different positions), their regions traced (the kernels
    # as the custom ops), against the same steps with the kernels off: logits, and the keys and values in the caches
    from tests.model.test_kv_cache import make_model, random_sequence

    model = make_model("gqa_fast_project")
    model.fuse_feed_forward()
    gemv.MAX_ROWS = gemv.KERNEL_MAX_ROWS  # the few-row buckets too
    for rows, positions in ((1, [5]), (3, [5, 9, 2])):
        frames = torch.cat([random_sequence(model, 1, seed=3 + r)[:, 0].unsqueeze(0) for r in range(rows)])
        outs, caches = {}, {}
        for mode in ("off", "auto"):
            gemv.MODE = mode
            compiled_regions.reset()
            cache = model.make_cache(n_slots=rows)
            caches[mode] = cache
            graphs = []

            def recording_backend(gm, example_inputs):
                graphs.append(str(gm.graph))
                return gm.forward

            with torch.inference_mode(), compiled_regions.compiled(recording_backend):
                logits, hidden = model.decode_slow(frames, cache, torch.tensor(positions), 64)
                fast = model.fast_step(hidden, model.make_fast_cache(rows), 0)
            outs[mode] = (logits, fast)
            used = sum(g.count("one_row_gemv") + g.count("one_row_attention_input") for g in graphs)
            assert (used > 0) == (mode == "auto"), (mode, used)
            assert (sum(g.count("one_row_attention_input") for g in graphs) > 0) == (mode == "auto")
        assert compiled_regions.failed_regions() == []
        for a, b in zip(outs["off"], outs["auto"]):
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)
        for name in ("k", "v"):
            torch.testing.assert_close(getattr(caches["auto"], name), getattr(caches["off"], name), rtol=1e-4, atol=1e-5)
    gemv.MODE = "auto"
    x = torch.randn(gemv.MAX_ROWS + 1, 1, 64)  # more rows than allowed: the eager ops
    assert not gemv.applies(x, torch.randn(32, 64))  # more rows than the kernel takes: the eager ops

    # the start-up self-check at the model's products: passes here, and names the product a broken kernel gets wrong
    products = model.one_row_products()
    assert {p.fused for p in products} == {"norm", "plain", "swiglu"} and len(products) >= 5, products
    assert any(p.rope_rows for p in products)
    assert gemv.self_check(torch.device("cpu"), torch.float32, products) is None
    gemv.MAX_ROWS = 1
    assert gemv.self_check(torch.device("cpu"), torch.float32, products) is None
    real = gemv.launch
    gemv.launch = lambda x, w, *args, **kw: real(x, w, *args, **kw) * 1.01
    problem = gemv.self_check(torch.device("cpu"), torch.float32, products)
    assert problem is not None and problem.startswith("relative error"), problem
    gemv.launch = lambda *args, **kw: 1 / 0
    assert gemv.self_check(torch.device("cpu"), torch.float32, products) == "ZeroDivisionError: division by zero"
    print("ok")
    """
)


def test_one_row_gemv_kernels_equal_the_eager_products_in_the_interpreter() -> None:
    run_interpreted(CHECK)

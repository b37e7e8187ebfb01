"""The length-aware decode attention kernel (model.decode_attention) against the masked softmax it replaces, on CPU
through Triton's interpreter (a subprocess: the interpreter is chosen when the kernels are defined). Skipped where
Triton is not installed; tests/model/test_gpu.py runs the same checks compiled on CUDA, inside the decode step."""

from __future__ import annotations

import importlib.util
import textwrap

import pytest

from tests.model.triton_interpreter import run_interpreted

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton (its interpreter)")

CHECK = textwrap.dedent(
    """
    import torch
    from model import decode_attention as da

    def reference(q, keys, values, lengths):
        # the masked softmax of Attention's SDPA path, in fp64
        q, keys, values = q.double(), keys.double(), values.double()
        scores = q @ keys.transpose(-1, -2) / q.shape[-1] ** 0.5  # (B, Hkv, G, L)
        pos = torch.arange(keys.shape[2])
        scores = scores.masked_fill(pos.view(1, 1, 1, -1) >= lengths.view(-1, 1, 1, 1), float("-inf"))
        return torch.softmax(scores, -1) @ values

    torch.manual_seed(0)
    n_layer, slots, kv_heads, max_seq, dim, group = 2, 5, 2, 320, 64, 8
    cache_k = torch.randn(n_layer, slots, kv_heads, max_seq, dim)
    cache_v = torch.randn(n_layer, slots, kv_heads, max_seq, dim)
    # one split per (row, kv head), then as many as the blocks allow, merged in one tile and two at a time
    for min_programs, merge_chunk in ((1, 64), (10_000, 64), (10_000, 2)):
        da.MIN_PROGRAMS, da.MERGE_CHUNK = min_programs, merge_chunk
        for rows, bucket, lengths in [
            (3, 256, [1, 64, 256]),
            (4, 256, [65, 200, 129, 3]),
            (2, 128, [128, 100]),
        ]:
            keys, values = cache_k[1, :rows, :, :bucket], cache_v[1, :rows, :, :bucket]  # the engine's strided views
            q = torch.randn(rows, kv_heads, group, dim)
            lens = torch.tensor(lengths)
            got = da.length_attention(q, keys, values, lens)
            want = reference(q, keys, values, lens)
            err = (got.double() - want).abs().max().item()
            splits = da.split_count(rows, kv_heads, bucket)
            assert got.shape == q.shape and got.dtype == q.dtype
            assert err < 2e-5, (rows, bucket, lengths, splits, err)
            print(f"rows {rows} bucket {bucket} splits {splits} merge chunk {merge_chunk}: max abs err {err:.1e}")
    da.MERGE_CHUNK = 64
    # a head dim that is no power of two (the embedded default model's is 48): padded lanes in the kernel
    for min_programs in (1, 10_000):
        da.MIN_PROGRAMS = min_programs
        keys, values = torch.randn(3, kv_heads, 192, 48), torch.randn(3, kv_heads, 192, 48)
        q, lens = torch.randn(3, kv_heads, 2, 48), torch.tensor([1, 70, 192])
        got = da.length_attention(q, keys, values, lens)
        err = (got.double() - reference(q, keys, values, lens)).abs().max().item()
        assert got.shape == q.shape and err < 2e-5, (min_programs, err)
        print(f"head dim 48, {da.split_count(3, kv_heads, 192)} splits: max abs err {err:.1e}")
    # the engine's start-up check: the kernel passes it here; a wrong or failing attention does not
    assert da.self_check(torch.device("cpu"), torch.float32, head_dim=48, group=8) is None
    wrong = da.self_check(torch.device("cpu"), torch.float32, 64, 8, attention=lambda q, k, v, n: torch.zeros_like(q))
    assert wrong is not None and wrong.startswith("relative error"), wrong

    def broken(q, k, v, n):
        raise RuntimeError("PTX compile failed\\nmore detail")

    assert da.self_check(torch.device("cpu"), torch.bfloat16, 64, 8, attention=broken) == "RuntimeError: PTX compile failed"
    # keys past a row's length are never read: poisoning them changes nothing
    keys, values = cache_k[0, :2, :, :256].clone(), cache_v[0, :2, :, :256].clone()
    q, lens = torch.randn(2, kv_heads, group, dim), torch.tensor([70, 130])
    clean = da.length_attention(q, keys, values, lens)
    keys[0, :, 70:], values[0, :, 70:] = float("nan"), float("nan")
    keys[1, :, 130:], values[1, :, 130:] = float("nan"), float("nan")
    assert torch.equal(da.length_attention(q, keys, values, lens), clean)

    # inside the model: a decode step of three rows at different positions, with and without the kernel
    import copy
    from tests.model.test_kv_cache import make_model, random_sequence

    plain = make_model("gqa_fast_project")
    kernel = copy.deepcopy(plain)
    kernel.use_length_attention(True)
    outs = []
    # the plain step over a 64-position bucket; the kernel over that bucket and over the whole cache (the engine's
    # one decode length with the kernel on: it reads each row's keys up to its position whatever the bucket)
    for model, whole in ((plain, False), (kernel, False), (kernel, True)):
        cache = model.make_cache(n_slots=3)
        assert cache.max_seq_len > 64
        ends = []
        for row, n in enumerate((9, 30, 17)):
            seq = random_sequence(model, n, seed=row)
            model.prefill(seq, cache, slot=row)
            ends.append(n)
        frames = torch.stack([random_sequence(model, 1, seed=10 + r)[:, 0] for r in range(3)])
        outs.append(model.decode_slow(frames, cache, torch.tensor(ends), cache.max_seq_len if whole else 64))
    for got in outs[1:]:
        for a, b in zip(outs[0], got):  # logits, then the fast stack's input: fp32 rounding apart (measured ~6e-7)
            rel = ((a - b).norm() / a.norm()).item()
            assert rel < 1e-5, rel
    # every row ends inside the first block: the same one split is read either way, the extra ones are empty
    assert all(torch.equal(a, b) for a, b in zip(outs[1], outs[2]))
    # the fast stack through the kernel: each codebook position attends over positions [0, pos] as its mask says
    hidden = outs[0][1]
    caches = [plain.make_fast_cache(3), kernel.make_fast_cache(3)]
    x = [hidden, hidden]
    for pos in range(plain.config.num_codebooks):
        a, b = (m.fast_step(h, fc, pos) for m, h, fc in zip((plain, kernel), x, caches))
        rel = ((a - b).norm() / a.norm()).item()
        assert rel < 1e-5, (pos, rel)
        code = a.argmax(-1)
        x = [plain.fast_embeddings(code), kernel.fast_embeddings(code)]
    print("ok")
    """
)


def test_length_attention_equals_the_masked_softmax_in_the_interpreter() -> None:
    run_interpreted(CHECK)


EAGER_AND_TRACED = textwrap.dedent(
    """
    import sys
    import torch
    from model import decode_attention as da

    # the engine's start-up check, eager: the kernels run without the custom op, so torch._dynamo stays unimported
    assert da.self_check(torch.device("cpu"), torch.float32, 64, 4) is None
    assert "torch._dynamo" not in sys.modules, "an eager call imported torch._dynamo"

    # traced by torch.compile (as the decode step's compiled regions are): one graph holding the custom op, no break
    import torch._dynamo
    q, keys, values = torch.randn(2, 2, 4, 64), torch.randn(2, 2, 128, 64), torch.randn(2, 2, 128, 64)
    lengths = torch.tensor([40, 128])
    def attend(q, keys, values, lengths):
        return da.length_attention(q * 1.0, keys, values, lengths) + 0
    explained = torch._dynamo.explain(attend)(q, keys, values, lengths)
    ops = [str(n.target) for g in explained.graphs for n in g.graph.nodes if "fishgate" in str(n.target)]
    assert (explained.graph_count, explained.graph_break_count, ops) == (1, 0, ["fishgate.length_attention"]), ops
    compiled = torch.compile(attend, backend="aot_eager", dynamic=True)(q, keys, values, lengths)
    assert torch.equal(compiled, attend(q, keys, values, lengths))
    print("ok")
    """
)


def test_eager_calls_skip_the_custom_op_and_traced_calls_keep_it() -> None:
    """Eager calls (the engine's start-up self-check, CUDA graphs without compile) launch the kernels directly: the
    custom op's first call imports torch._dynamo and torch._inductor (1.5 s here; most of the H200 engine's 4.4-6.9 s
    kernel check). Under torch.compile the call is still the opaque custom op, in one graph, same numbers."""
    run_interpreted(EAGER_AND_TRACED)

"""model.small_sort's one-program sort against torch.sort(descending=True, stable=True), on CPU through Triton's
interpreter (a subprocess: the interpreter is chosen when the kernel is defined). Skipped where Triton is not
installed; tests/model/test_gpu.py checks it against CUDA's own torch.sort and inside the compiled sampler."""

from __future__ import annotations

import importlib.util
import textwrap

import pytest

from tests.model.triton_interpreter import run_interpreted

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton (its interpreter)")

CHECK = textwrap.dedent(
    """
    import torch
    from model import small_sort

    gen = torch.Generator().manual_seed(0)
    cases = []
    for dtype in (torch.bfloat16, torch.float32):
        # few distinct values: ties everywhere, so the order of equal values is what is checked; -inf as the
        # repetition penalty or top-p masks leave it; widths that are and are not powers of two
        x = (torch.randint(-6, 7, (3, 1024), generator=gen).float() / 4).to(dtype)
        x[1, ::7] = float("-inf")
        x[2, ::9] = -0.0  # equal to +0.0 (which the row has too), as in torch.sort and CUB's radix sort
        cases.append(x)
        cases.append(torch.randn(2, 1000, generator=gen).to(dtype))
        cases.append(torch.randn(1, 4096, generator=gen).to(dtype) * 30)
    strided = torch.randn(1024, 2, generator=gen).t()  # (2, 1024), column stride 2
    cases.append(strided)
    for x in cases:
        assert small_sort.applies(x), (x.shape, x.dtype)
        values, index = small_sort.sort_descending(x)
        want_values, want_index = torch.sort(x, dim=-1, descending=True, stable=True)
        assert index.dtype == torch.int64 and values.dtype == x.dtype
        assert torch.equal(index, want_index), (x.shape, x.dtype)
        assert torch.equal(values.view(torch.uint8), want_values.contiguous().view(torch.uint8)), (x.shape, x.dtype)
    # the sampler's top-p through the kernel picks what it picks through torch.sort
    from model.sampling import logits_to_probs

    logits = torch.randn(3, 1024, generator=gen) * 3
    window = torch.randint(0, 1024, (3, 16), generator=gen)
    args = (window, torch.full((3,), 0.7), torch.full((3,), 0.8), torch.full((3,), 1.2))
    fast = logits_to_probs(logits, *args)
    small_sort.MODE = "off"
    assert not small_sort.applies(logits)
    assert torch.equal(fast, logits_to_probs(logits, *args))
    # rows past MAX_WIDTH and integer rows stay with torch.sort
    small_sort.MODE = "auto"
    assert not small_sort.applies(torch.zeros(1, small_sort.MAX_WIDTH + 1))
    assert not small_sort.applies(torch.zeros(1, 8, dtype=torch.int64))
    print("ok")
    """
)


def test_the_kernel_sorts_as_stable_torch_sort_in_the_interpreter() -> None:
    run_interpreted(CHECK)

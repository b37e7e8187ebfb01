"""A descending sort of short rows (≤ 4,096 values) in one Triton program per row, for top-p over the codebooks.

torch.sort of a (1, 1,024) row runs ATen's one-block radix sort: 17 µs, plus its input copies, seven times in every
one-row decode step (H200: ~140 of 2,550 µs). Here each row is one bitonic sort of 64-bit keys in registers.
A key is the value's bits, mapped so that integer order is the float order (-0.0 and +0.0 equal, as CUB's radix sort
has them), above the position counted down from the end, so equal values keep their original order: the result is
torch.sort(descending=True, stable=True), the values bitwise and the same indices. CUDA's torch.sort of rows this
short is that stable radix sort, so on the GPU this equals the eager path exactly (tests/model/test_gpu.py); on the
CPU, Triton's interpreter runs it in tests (tests/model/test_small_sort.py). NaN is not expected (logits).
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl

    AVAILABLE = True
except ImportError:  # the CPU wheels of torch ship without Triton
    AVAILABLE = False

MAX_WIDTH = 4096  # longer rows (the 102,048-token vocabulary) stay with torch.sort
# "auto": the kernel for short float rows on CUDA (and in Triton's interpreter, for tests); "off": torch.sort always
MODE = "auto"


# Triton's CPU interpreter (the CPU tests), read once: `applies` runs while dynamo traces the sampler
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def _supported(device: torch.device) -> bool:
    return AVAILABLE and (device.type == "cuda" or _INTERPRETED)


def applies(x: torch.Tensor) -> bool:
    """Whether sort_descending runs the kernel for x (else torch.sort)."""
    return (
        MODE == "auto"
        and x.ndim == 2
        and 1 < x.shape[-1] <= MAX_WIDTH
        and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
        and _supported(x.device)
    )


def sort_descending(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.sort(x, dim=-1, descending=True) of a (B, V) tensor: (values, int64 indices). Where the kernel runs,
    equal values keep their order (stable), as CUDA's torch.sort keeps them; elsewhere it is that torch.sort."""
    if not applies(x):
        return torch.sort(x, dim=-1, descending=True)
    if torch.compiler.is_compiling():
        return torch.ops.fishgate.sort_descending(x)
    return _launch(x)


@torch.library.custom_op("fishgate::sort_descending", mutates_args=())
def _sort_op(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _launch(x)


@_sort_op.register_fake
def _(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty(
        x.shape, dtype=torch.int64, device=x.device
    )


def _launch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rows, width = x.shape
    values = torch.empty((rows, width), dtype=x.dtype, device=x.device)
    index = torch.empty((rows, width), dtype=torch.int64, device=x.device)
    if rows:
        bits = {torch.float32: 32, torch.bfloat16: 16, torch.float16: 16}[x.dtype]
        width_pad = triton.next_power_of_2(width)
        _sort_rows[(rows,)](
            x, values, index, x.stride(0), x.stride(1), width,
            WIDTH_PAD=width_pad, BITS=bits, num_warps=4 if width_pad <= 1024 else 8,
        )  # fmt: skip
    return values, index


if AVAILABLE:

    @triton.jit
    def _sort_rows(x_ptr, values_ptr, index_ptr, sx_row, sx_col, width, WIDTH_PAD: tl.constexpr, BITS: tl.constexpr):
        row = tl.program_id(0)
        i = tl.arange(0, WIDTH_PAD)
        inside = i < width
        x = tl.load(x_ptr + row * sx_row + i * sx_col, mask=inside, other=0.0)
        # the value's bits, mapped to an unsigned order-preserving integer (negative: all bits flipped; positive:
        # the sign bit set), then shifted to a signed one so that it can head a signed 64-bit key; -0.0 is made
        # +0.0 first (the two are equal, as in CUB's radix sort, so their order is kept)
        if BITS == 32:
            u = x.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
            u = tl.where(u == 0x80000000, 0, u)
            ordered = tl.where(u >= 0x80000000, u ^ 0xFFFFFFFF, u | 0x80000000) - 0x80000000
        else:
            u = x.to(tl.int16, bitcast=True).to(tl.int64) & 0xFFFF
            u = tl.where(u == 0x8000, 0, u)
            ordered = tl.where(u >= 0x8000, u ^ 0xFFFF, u | 0x8000) - 0x8000
        # below it, the position counted down: among equal values the first position has the largest key
        key = (ordered << 32) | (0xFFFFFFFF - i.to(tl.int64))
        key = tl.where(inside, key, -0x7FFFFFFFFFFFFFFF - 1)  # padding sorts last
        key = tl.sort(key, descending=True)
        order = 0xFFFFFFFF - (key & 0xFFFFFFFF)
        order = tl.where(inside, order, 0)
        value = tl.load(x_ptr + row * sx_row + order * sx_col, mask=inside, other=0.0)
        tl.store(values_ptr + row * width + i, value, mask=inside)
        tl.store(index_ptr + row * width + i, order, mask=inside)

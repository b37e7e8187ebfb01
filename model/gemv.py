"""One-row matrix-vector products (GEMVs) for the decode step's attention projections, as Triton kernels.

At one row a decode step is a chain of GEMVs over ~1.7 GB of weights. Inductor's tuned reductions ran them at
0.5-2.8 TB/s on the H200 (run 25: w1/w3 6.1 µs for 16.8 MB, w2 5.3 µs for 8.4 MB, wo 3.9 µs for 2 MB). Here each
program reads BLOCK_N whole rows of the weight at once (every load in flight together) and writes BLOCK_N outputs:
faster for the attention's small products, slower for the feed-forward's large ones (run 25 call 4, with the SwiGLU
and the residual add fused into w2: removed since), which stay with inductor (MAX_WEIGHT). Off by default (MODE)
until a whole step with them measures faster. Layers call it through `Linear.one_row` (wqkv and wo).
Inside compiled regions the product is a custom op (opaque to inductor, like model.decode_attention's kernel).
Numerics: fp32 accumulation of the model dtype's products, one rounding to the model dtype (a different summation
order than cuBLAS's, as any GEMV has); tested against F.linear on CPU through Triton's interpreter and on CUDA.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl

    AVAILABLE = True
except ImportError:  # the CPU wheels of torch ship without Triton
    AVAILABLE = False

# "auto": the kernels for one-row products inside compiled regions on CUDA; "off" (the default): F.linear, which
# inductor turns into its tuned reductions. Run 25 measured the kernels for every block product slower in the whole
# step (2.273 against 2.135 ms); wo alone faster (below): `bench.step_variants --variants engine_tuned_gemv` measures
# the step with them for the products up to MAX_WEIGHT (predicted ~2.09 ms; not yet run)
MODE = "off"
MAX_TILE = 16384  # weight elements one program reads (BLOCK_N rows × the padded row length)
# Larger weights stay with inductor's tuned reductions: H200 run 25 call 4 measured these kernels slower there (w1/w3,
# 8,192 × 1,024: 7.9 against 6.1 µs; w2, 1,024 × 4,096: 7.2 against 5.3 µs) and faster or equal below (wo, 1,024 ×
# 1,024: 2.4 against 3.9 µs; wqkv, 1,280 × 1,024: 2.6 against 2.5 µs)
MAX_WEIGHT = 1 << 21
MIN_PROGRAMS = 2 * 132  # at least two programs per SM of an H200 where the rows allow
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # read once: `applies` runs while dynamo traces


def applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a product of x (one row) with weight runs the kernel: inside a compiled region, on CUDA (or Triton's
    interpreter), floating point, the weight's rows contiguous and short enough for one tile, at most MAX_WEIGHT."""
    return (
        MODE == "auto"
        and AVAILABLE
        and torch.compiler.is_compiling()
        and x.numel() == x.shape[-1]
        and (x.device.type == "cuda" or _INTERPRETED)
        and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
        and weight.dtype == x.dtype
        and weight.stride(-1) == 1
        and weight.numel() <= MAX_WEIGHT
        and triton.next_power_of_2(weight.shape[1]) <= MAX_TILE
    )


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.linear(x, weight) for x (..., K) holding one row: the kernel where `applies`, else F.linear."""
    if not applies(x, weight):
        return F.linear(x, weight)
    return torch.ops.fishgate.one_row_gemv(x.reshape(-1), weight).view(*x.shape[:-1], weight.shape[0])


@torch.library.custom_op("fishgate::one_row_gemv", mutates_args=())
def _gemv_op(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return launch(x, weight)


@_gemv_op.register_fake
def _(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.empty(weight.shape[0], dtype=x.dtype, device=x.device)


def launch(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The kernel on a flat row x (K,): weight (N, K) → (N,)."""
    n, k = weight.shape
    assert x.numel() == k and x.stride(-1) == 1
    out = torch.empty(n, dtype=x.dtype, device=x.device)
    k_pad = triton.next_power_of_2(k)
    block_n = max(1, min(MAX_TILE // k_pad, triton.next_power_of_2(max(1, n // MIN_PROGRAMS))))
    _gemv[(triton.cdiv(n, block_n),)](x, weight, out, n, k, weight.stride(0), BLOCK_N=block_n, K_PAD=k_pad, num_warps=4)
    return out


if AVAILABLE:

    @triton.jit
    def _gemv(x_ptr, w_ptr, out_ptr, n, k, sw_n, BLOCK_N: tl.constexpr, K_PAD: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        cols = tl.arange(0, K_PAD)
        live_k = cols < k
        live_n = rows < n
        a = tl.load(x_ptr + cols, mask=live_k, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + rows[:, None] * sw_n + cols[None, :], mask=live_n[:, None] & live_k[None, :], other=0.0)
        acc = tl.sum(w.to(tl.float32) * a[None, :], axis=1)
        tl.store(out_ptr + rows, acc.to(out_ptr.dtype.element_ty), mask=live_n)

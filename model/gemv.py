"""One-row matrix-vector products (GEMVs) of the decode step, as Triton kernels with the block's small ops fused in.

At one row a decode step is a chain of GEMVs over ~1.7 GB of weights. Inductor's tuned reductions ran them at
0.5-2.8 TB/s on the H200 (run 25: w1/w3 6.1 µs for 16.8 MB, w2 5.3 µs for 8.4 MB, wo 3.9 µs for 2 MB), each RMSNorm
cost a one-program kernel of its own, and so did the residual add before the feed-forward's norm. Here each program
reads BLOCK_N whole rows of the weight (in K_CHUNKS unrolled pieces: every load in flight together) and writes
BLOCK_N outputs, with, as asked:
- an RMSNorm of the input in front (`norm_weight`): every program normalises the whole input row itself (a few KB
  from L2), so the norm needs no kernel of its own;
- SwiGLU in front (`swiglu`): the input is [gate | up] and the product is with silu(gate) · up (w2 after w1/w3);
- a residual added behind (`residual`).
Every fused op rounds where the eager op does (the norm's fp32 result to the model dtype, then its scale; silu, then
the product with up; the product before the residual add), so the result differs from the eager chain only by the
GEMV's summation order. Launch configs per weight shape come from `bench/gemv_sweep.py` on the H200 (CONFIGS);
shapes not in the table get a rule of thumb.

Inside compiled regions the product is a custom op (opaque to inductor, like model.decode_attention's kernel).
`layers.TransformerBlock` and the heads call it for one-row decode steps when MODE is "auto".
"""

from __future__ import annotations

import json
import os

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl

    AVAILABLE = True
except ImportError:  # the CPU wheels of torch ship without Triton
    AVAILABLE = False

# "auto": one-row products inside compiled regions on CUDA by these kernels; "off" (the default): F.linear and the
# separate norms, which inductor turns into its tuned reductions. Run 25 measured plain kernels (no fusions, one
# config rule for every shape) slower in the whole step for the large products (w1/w3 7.9 against 6.1 µs, w2 7.2
# against 5.3 µs) and faster for wo (2.4 against 3.9 µs).
MODE = "off"
MAX_TILE = 32768  # weight elements one program may hold (BLOCK_N × the chunk length × K_CHUNKS)
MAX_HEAD_ROWS = 16384  # heads with more outputs (the 102,048-token vocabulary: 4.3 TB/s already) stay with inductor
MIN_PROGRAMS = 2 * 132  # the rule of thumb: at least two programs per SM of an H200 where the rows allow
# (n, k, fused input) → (BLOCK_N, K_CHUNKS, num_warps); fused input: "plain", "norm" or "swiglu" (k = the product's
# inner size, half the swiglu input). Filled from bench/gemv_sweep.py's H200 results.
CONFIGS: dict[tuple[int, int, str], tuple[int, int, int]] = {}
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # read once: `applies` runs while dynamo traces


def applies(x: torch.Tensor, weight: torch.Tensor, swiglu: bool = False) -> bool:
    """Whether a product of x (one row; [gate | up] with swiglu) with weight runs the kernel: MODE "auto", inside a
    compiled region, on CUDA (or Triton's interpreter), floating point, the weight's rows contiguous."""
    return (
        MODE == "auto"
        and AVAILABLE
        and torch.compiler.is_compiling()
        and x.numel() == x.shape[-1] == weight.shape[1] * (2 if swiglu else 1)
        and (x.device.type == "cuda" or _INTERPRETED)
        and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
        and weight.dtype == x.dtype
        and weight.stride(-1) == 1
        and x.stride(-1) == 1
    )


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    swiglu: bool = False,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """residual + F.linear(prologue(x), weight) for x (..., K) holding one row, where prologue is
    rms_norm(x)·norm_weight (norm_weight given), silu(gate)·up (swiglu) or nothing; the kernel where `applies`, else
    the eager ops (`reference`)."""
    if not applies(x, weight, swiglu):
        return reference(x, weight, norm_weight, eps, swiglu, residual)
    flat_residual = None if residual is None else residual.reshape(-1)
    out = torch.ops.fishgate.one_row_gemv(x.reshape(-1), weight, norm_weight, flat_residual, eps, swiglu)
    return out.view(*x.shape[:-1], weight.shape[0])


def reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    swiglu: bool = False,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """The eager ops the kernel replaces (layers.RMSNorm's, FeedForward's and the block's order and roundings)."""
    if norm_weight is not None:
        x = F.rms_norm(x.float(), (x.shape[-1],), eps=eps).type_as(x) * norm_weight
    if swiglu:
        gate, up = x.chunk(2, dim=-1)
        x = F.silu(gate) * up
    y = F.linear(x, weight)
    return y if residual is None else residual + y


@torch.library.custom_op("fishgate::one_row_gemv", mutates_args=())
def _gemv_op(
    x: torch.Tensor,
    weight: torch.Tensor,
    norm_weight: torch.Tensor | None,
    residual: torch.Tensor | None,
    eps: float,
    swiglu: bool,
) -> torch.Tensor:
    return launch(x, weight, norm_weight, residual, eps, swiglu)


@_gemv_op.register_fake
def _(x, weight, norm_weight, residual, eps, swiglu):
    return torch.empty(weight.shape[0], dtype=x.dtype, device=x.device)


def fused_input(norm_weight: torch.Tensor | None, swiglu: bool) -> str:
    return "swiglu" if swiglu else "plain" if norm_weight is None else "norm"


def config_for(n: int, k: int, fused: str) -> tuple[int, int, int]:
    """(BLOCK_N, K_CHUNKS, num_warps) for a weight (n, k): CONFIGS' measured entry, else at least MIN_PROGRAMS
    programs of whole rows up to MAX_TILE / 2 elements, in one piece, four warps."""
    if (n, k, fused) in CONFIGS:
        return CONFIGS[(n, k, fused)]
    k_pad = triton.next_power_of_2(k)
    block_n = max(1, min(MAX_TILE // 2 // k_pad, triton.next_power_of_2(max(1, n // MIN_PROGRAMS))))
    return block_n, 1, 4


def load_configs(path: str) -> int:
    """Add bench/gemv_sweep.py's best configs (its `configs` list of {n, k, fused, block_n, k_chunks, num_warps})
    to CONFIGS; returns how many."""
    with open(path) as f:
        rows = json.load(f)["configs"]
    for r in rows:
        key = (int(r["n"]), int(r["k"]), str(r["fused"]))
        CONFIGS[key] = (int(r["block_n"]), int(r["k_chunks"]), int(r["num_warps"]))
    return len(rows)


def launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    norm_weight: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    eps: float = 0.0,
    swiglu: bool = False,
    config: tuple[int, int, int] | None = None,
) -> torch.Tensor:
    """The kernel on a flat row x (K,), or (2K,) with swiglu: weight (N, K) → (N,)."""
    n, k = weight.shape
    assert x.numel() == k * (2 if swiglu else 1) and x.stride(-1) == 1 and weight.stride(-1) == 1
    assert not (swiglu and norm_weight is not None)
    assert norm_weight is None or norm_weight.numel() == k
    assert residual is None or residual.numel() == n
    out = torch.empty(n, dtype=x.dtype, device=x.device)
    block_n, k_chunks, num_warps = config or config_for(n, k, fused_input(norm_weight, swiglu))
    block_k = max(16, triton.next_power_of_2(triton.cdiv(k, k_chunks)))
    prologue = 2 if swiglu else 0 if norm_weight is None else 1
    _gemv[(triton.cdiv(n, block_n),)](
        x, weight, out, x if norm_weight is None else norm_weight, x if residual is None else residual,
        n, k, weight.stride(0), eps,
        PROLOGUE=prologue, RESIDUAL=residual is not None, BLOCK_N=block_n, BLOCK_K=block_k,
        K_CHUNKS=triton.cdiv(k, block_k), NORM_PAD=triton.next_power_of_2(k), num_warps=num_warps,
    )  # fmt: skip
    return out


if AVAILABLE:

    @triton.jit
    def _input_piece(x_ptr, norm_ptr, cols, k, scale, PROLOGUE: tl.constexpr):
        """The product's input at cols, in fp32, rounded where the eager ops round (see the module docstring)."""
        live = cols < k
        if PROLOGUE == 2:  # silu(gate) · up
            gate = tl.load(x_ptr + cols, mask=live, other=0.0)
            up = tl.load(x_ptr + k + cols, mask=live, other=0.0)
            g = gate.to(tl.float32)
            act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
            a = (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype).to(tl.float32)
        elif PROLOGUE == 1:  # rms_norm(x) · norm weight
            raw = tl.load(x_ptr + cols, mask=live, other=0.0)
            nw = tl.load(norm_ptr + cols, mask=live, other=0.0)
            normed = (raw.to(tl.float32) * scale).to(raw.dtype)
            a = (normed.to(tl.float32) * nw.to(tl.float32)).to(raw.dtype).to(tl.float32)
        else:
            a = tl.load(x_ptr + cols, mask=live, other=0.0).to(tl.float32)
        return a

    @triton.jit
    def _gemv(
        x_ptr, w_ptr, out_ptr, norm_ptr, res_ptr, n, k, sw_n, eps,
        PROLOGUE: tl.constexpr, RESIDUAL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        K_CHUNKS: tl.constexpr, NORM_PAD: tl.constexpr,
    ):  # fmt: skip
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        live_n = rows < n
        scale = 1.0
        if PROLOGUE == 1:  # the whole row's mean square, as F.rms_norm in fp32
            full = tl.arange(0, NORM_PAD)
            xs = tl.load(x_ptr + full, mask=full < k, other=0.0).to(tl.float32)
            scale = tl.rsqrt(tl.sum(xs * xs, axis=0) / k + eps)
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for c in tl.static_range(K_CHUNKS):
            cols = c * BLOCK_K + tl.arange(0, BLOCK_K)
            a = _input_piece(x_ptr, norm_ptr, cols, k, scale, PROLOGUE)
            w_mask = live_n[:, None] & (cols < k)[None, :]
            w = tl.load(w_ptr + rows[:, None] * sw_n + cols[None, :], mask=w_mask, other=0.0)
            acc += tl.sum(w.to(tl.float32) * a[None, :], axis=1)
        y = acc.to(out_ptr.dtype.element_ty)
        if RESIDUAL:
            r = tl.load(res_ptr + rows, mask=live_n, other=0.0)
            y = (r.to(tl.float32) + y.to(tl.float32)).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + rows, y, mask=live_n)

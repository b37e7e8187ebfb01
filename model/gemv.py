"""One-row matrix-vector products (GEMVs) of the decode step, as Triton kernels with the block's small ops fused in.

At one row a decode step is a chain of GEMVs over ~1.7 GB of weights. Inductor's tuned reductions ran them at
0.5-2.8 TB/s on the H200 (w1/w3 6.1 µs for 16.8 MB, w2 5.3 µs for 8.4 MB, wo 3.9 µs for 2 MB), each RMSNorm
cost a one-program kernel of its own, and so did the residual add before the feed-forward's norm. Here each program
reads BLOCK_N whole rows of the weight (in K_CHUNKS unrolled pieces: every load in flight together) and writes
BLOCK_N outputs, with, as asked:
- an RMSNorm of the input in front (`norm_weight`): every program normalises the whole input row itself (a few KB
  from L2), so the norm needs no kernel of its own;
- SwiGLU in front (`swiglu`): the input is [gate | up] and the product is with silu(gate) · up (w2 after w1/w3);
- a residual added behind (`residual`);
- RoPE behind (`rope`): the query and key heads of wqkv's output rotated for the row's position;
- the KV-cache writes behind (`attention_input`): wqkv's keys and values stored at the row's position, a custom op
  that mutates the cache views (inductor reinplaces it: no copies).
Up to KERNEL_MAX_ROWS rows a launch: the rows run one after another over the program's weight rows, read once into
registers (MAX_ROWS decides how many rows the compiled regions hand it).
Every fused op rounds where the eager op does (the norm's fp32 result to the model dtype, then its scale; silu, then
the product with up; the product before the residual add), so the result differs from the eager chain only by the
GEMV's summation order. Launch configs per weight shape come from `bench/gemv_sweep.py` on the H200 (CONFIGS);
shapes not in the table get a rule of thumb.

Inside compiled regions the product is a custom op (opaque to inductor, like model.decode_attention's kernel).
`layers.TransformerBlock` and the heads call it for one-row decode steps when MODE is "auto" (the engine sets MODE:
`--gemv-kernels`). H200: the one-row step 2.16 → 1.57 ms (722 → 434 kernels). Launched with programmatic
dependent launch where the GPU has it (model.launch_overlap), a program reads its weight rows before it waits for the
kernels before it: 1.64 → 1.45 ms measured in one call.
"""

from __future__ import annotations

import json
import os
from typing import NamedTuple

import torch
import torch.nn.functional as F

from . import launch_overlap
from .rope import apply_rope

try:
    import triton
    import triton.language as tl

    AVAILABLE = True
except ImportError:  # the CPU wheels of torch ship without Triton
    AVAILABLE = False

# "auto" (the default): products of up to MAX_ROWS rows inside compiled regions on CUDA by these kernels; "off":
# F.linear and the separate norms, RoPE and cache writes, which inductor turns into its tuned kernels. H200, the tuned
# one-row step: 2.155 ms off, 1.574 ms with the kernels (1.722 ms without the cache writes fused in). Plain kernels
# (no fusions, one config rule for every shape) measured slower than inductor's for the large products.
MODE = "auto"
MAX_TILE = 32768  # weight elements one program may hold (BLOCK_N × the chunk length × K_CHUNKS)
MAX_HEAD_ROWS = 16384  # heads with more outputs (the 102,048-token vocabulary: 4.3 TB/s already) stay with inductor
# rows a product may have inside the compiled regions (the engine compiles buckets of 1-8 rows): each program reads
# its weight rows once and multiplies them by every row, one row after another. 1: on the H200 the kernels measured
# slower than inductor and cuBLAS for the few-row buckets (4 rows 3.19 against 3.06 ms, 8 rows 5.45 against 3.46 ms;
# docs/archive/benchmark-log.md)
MAX_ROWS = 1
KERNEL_MAX_ROWS = 8
MAX_K_CHUNKS = 4  # pieces a program's weight rows are read in (all of them into registers before any product)
MIN_PROGRAMS = 2 * 132  # the rule of thumb: at least two programs per SM of an H200 where the rows allow
# (n, k, fused input) → (BLOCK_N, K_CHUNKS, num_warps); fused input: "plain", "norm" or "swiglu" (k = the product's
# inner size, half the swiglu input). The full-size Fish 1.5 DualAR's products, best of bench/gemv_sweep.py's grid
# on the H200 (µs a launch in a graph of cold weights, the rule of thumb's in brackets).
CONFIGS: dict[tuple[int, int, str], tuple[int, int, int]] = {
    (1280, 1024, "norm"): (2, 1, 4),  # wqkv: 2.68 µs (3.22)
    (1024, 1024, "plain"): (2, 1, 4),  # wo, + residual: 2.64 µs (2.92)
    (8192, 1024, "norm"): (32, 4, 16),  # w1/w3: 6.81 µs (8.89)
    (1024, 4096, "swiglu"): (2, 1, 16),  # w2, + residual: 4.55 µs (7.90)
    (1024, 1024, "norm"): (2, 1, 4),  # codebook head: 2.88 µs (3.48)
}
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # read once: `applies` runs while dynamo traces


def applies(x: torch.Tensor, weight: torch.Tensor, swiglu: bool = False) -> bool:
    """Whether a product of x (up to MAX_ROWS rows; [gate | up] with swiglu) with weight runs the kernel: MODE
    "auto", inside a compiled region, on CUDA (or Triton's interpreter), floating point, rows contiguous."""
    return (
        MODE == "auto"
        and AVAILABLE
        and torch.compiler.is_compiling()
        and x.shape[-1] == weight.shape[1] * (2 if swiglu else 1)
        and x.numel() <= MAX_ROWS * x.shape[-1]
        and (x.numel() == x.shape[-1] or x.is_contiguous())
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
    rope: torch.Tensor | None = None,
    rope_rows: int = 0,
) -> torch.Tensor:
    """residual + F.linear(prologue(x), weight) for x (..., K) holding up to MAX_ROWS rows, where prologue is
    rms_norm(x)·norm_weight (norm_weight given), silu(gate)·up (swiglu) or nothing, and with `rope` (a (head_dim/2, 2)
    cos/sin table for every row, or one per row: (rows, ..., head_dim/2, 2)) the first rope_rows outputs rotated as
    rope.apply_rope rotates heads; the kernel where `applies`, else the eager ops (`reference`)."""
    if not applies(x, weight, swiglu):
        return reference(x, weight, norm_weight, eps, swiglu, residual, rope, rope_rows)
    rows = x.reshape(-1, x.shape[-1])
    flat_residual = None if residual is None else residual.reshape(rows.shape[0], -1)
    row_rope = None if rope is None else rope_rows_table(rope, rows.shape[0])
    out = torch.ops.fishgate.one_row_gemv(rows, weight, norm_weight, flat_residual, eps, swiglu, row_rope, rope_rows)
    return out.view(*x.shape[:-1], weight.shape[0])


def rope_rows_table(rope: torch.Tensor, rows: int) -> torch.Tensor:
    """A RoPE table as the kernel reads it: (1, head_dim) for every row, or (rows, head_dim) one each; from the model's
    layout (..., head_dim/2, 2) or already flat (..., head_dim)."""
    head_dim = rope.shape[-1] * rope.shape[-2] if rope.dim() >= 2 and rope.shape[-1] == 2 else rope.shape[-1]
    table = rope.reshape(-1, head_dim)
    assert table.shape[0] in (1, rows), (tuple(rope.shape), rows)
    return table


def attention_input(
    x: torch.Tensor,
    wqkv: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    rope: torch.Tensor,
    rope_rows: int,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_pos: torch.Tensor,
) -> torch.Tensor:
    """wqkv's product for x (B, 1, dim) with its RMSNorm, the query and key heads rotated, and the keys and values
    written into k_cache / v_cache (B, kv heads, L, head_dim) at each row's position cache_pos (B, 1): one kernel
    for what `linear` then Attention.attend's RoPE and cache writes do. Only where `applies` (the caller checks)."""
    rows = x.reshape(-1, x.shape[-1])
    out = torch.ops.fishgate.one_row_attention_input(
        rows, wqkv, norm_weight, eps, rope_rows_table(rope, rows.shape[0]), rope_rows, k_cache, v_cache,
        cache_pos.reshape(-1),
    )  # fmt: skip
    return out.view(*x.shape[:-1], wqkv.shape[0])


def reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    swiglu: bool = False,
    residual: torch.Tensor | None = None,
    rope: torch.Tensor | None = None,
    rope_rows: int = 0,
) -> torch.Tensor:
    """The eager ops the kernel replaces (layers.RMSNorm's, FeedForward's, the block's and rope.apply_rope's order
    and roundings)."""
    if norm_weight is not None:
        x = F.rms_norm(x.float(), (x.shape[-1],), eps=eps).type_as(x) * norm_weight
    if swiglu:
        gate, up = x.chunk(2, dim=-1)
        x = F.silu(gate) * up
    y = F.linear(x, weight)
    if rope is not None:
        table = rope_rows_table(rope, y.numel() // y.shape[-1])  # (1 or rows, hd)
        head_dim = table.shape[-1]
        heads = y[..., :rope_rows].reshape(-1, 1, rope_rows // head_dim, head_dim)  # (rows, 1, H, hd)
        rotated = apply_rope(heads, table.view(-1, 1, head_dim // 2, 2))
        y = torch.cat([rotated.reshape(*y.shape[:-1], rope_rows), y[..., rope_rows:]], dim=-1)
    return y if residual is None else residual + y


@torch.library.custom_op("fishgate::one_row_gemv", mutates_args=())
def _gemv_op(
    x: torch.Tensor,
    weight: torch.Tensor,
    norm_weight: torch.Tensor | None,
    residual: torch.Tensor | None,
    eps: float,
    swiglu: bool,
    rope: torch.Tensor | None,
    rope_rows: int,
) -> torch.Tensor:
    return launch(x, weight, norm_weight, residual, eps, swiglu, rope=rope, rope_rows=rope_rows)


@_gemv_op.register_fake
def _(x, weight, norm_weight, residual, eps, swiglu, rope, rope_rows):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


@torch.library.custom_op("fishgate::one_row_attention_input", mutates_args=("k_cache", "v_cache"))
def _attention_input_op(
    x: torch.Tensor,
    wqkv: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    rope: torch.Tensor,
    rope_rows: int,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_pos: torch.Tensor,
) -> torch.Tensor:
    return launch(x, wqkv, norm_weight, None, eps, rope=rope, rope_rows=rope_rows, k_cache=k_cache, v_cache=v_cache,
                  cache_pos=cache_pos)  # fmt: skip


@_attention_input_op.register_fake
def _(x, wqkv, norm_weight, eps, rope, rope_rows, k_cache, v_cache, cache_pos):
    return x.new_empty(*x.shape[:-1], wqkv.shape[0])


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


class Product(NamedTuple):
    """One of a model's one-row products as the kernel runs it (what `self_check` checks)."""

    n: int
    k: int
    fused: str  # fused input: "plain", "norm" or "swiglu"
    residual: bool = False
    rope_rows: int = 0  # outputs rotated (query and key heads), each head of head_dim
    head_dim: int = 0


def self_check(device: torch.device, dtype: torch.dtype, products: set[Product]) -> str | None:
    """Run the kernel once on this device for each product, in its configured launch config, against `reference`
    in fp32 on the same values: None when all agree to `dtype`'s rounding, else what went wrong (a compile or launch
    error on an untested GPU, or wrong numbers). The engine runs it before choosing the kernels by default (MODE)."""
    gen = torch.Generator().manual_seed(0)
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    f = lambda t: None if t is None else t.float()  # noqa: E731
    try:
        for p in sorted(products):
            w = (torch.randn(p.n, p.k, generator=gen) / p.k**0.5).to(device, dtype)
            x = torch.randn(2 * p.k if p.fused == "swiglu" else p.k, generator=gen).to(device, dtype)
            norm = (torch.rand(p.k, generator=gen) + 0.5).to(device, dtype) if p.fused == "norm" else None
            residual = torch.randn(p.n, generator=gen).to(device, dtype) if p.residual else None
            rope = None
            if p.rope_rows:
                angles = torch.rand(p.head_dim // 2, generator=gen) * 6
                rope = torch.stack([angles.cos(), angles.sin()], dim=-1).reshape(-1).to(device)
            swiglu = p.fused == "swiglu"
            want = reference(x.float(), w.float(), f(norm), 1e-6, swiglu, f(residual), rope, p.rope_rows)
            got = launch(x, w, norm, residual, 1e-6, swiglu, rope=rope, rope_rows=p.rope_rows).float()
            if MAX_ROWS > 1:  # three rows at once (compiled buckets of 2-8 rows), the second this one: the same result
                rows = torch.stack([x.roll(1), x, x.roll(-1)])
                rows_residual = None if residual is None else torch.stack([residual] * 3)
                got_rows = launch(rows, w, norm, rows_residual, 1e-6, swiglu, rope=rope, rope_rows=p.rope_rows)
                if not torch.equal(got_rows[1].float(), got):
                    return f"the {p.n} x {p.k} {p.fused} product of three rows differs from the same row alone"
            if rope is not None:  # and wqkv's keys and values written into caches at position 5 of 8
                kv_heads = (p.n - p.rope_rows) // p.head_dim
                caches = [torch.zeros(1, kv_heads, 8, p.head_dim, device=device, dtype=dtype) for _ in range(2)]
                pos = torch.tensor([5], device=device)
                got_cached = launch(x, w, norm, None, 1e-6, rope=rope, rope_rows=p.rope_rows, k_cache=caches[0],
                                    v_cache=caches[1], cache_pos=pos).float()  # fmt: skip
                written = torch.cat([c[0, :, 5].reshape(-1) for c in caches]).float()
                if not torch.equal(got_cached, got) or caches[0].count_nonzero() + caches[1].count_nonzero() > (
                    2 * kv_heads * p.head_dim
                ):
                    return f"the cache-writing {p.n} x {p.k} product differs from the plain one or wrote elsewhere"
                got = torch.cat([got, written])
                want = torch.cat([want, want[p.rope_rows - (p.n - p.rope_rows) :]])
            err = float((got - want).norm() / want.norm())
            if not err <= tolerance:  # a NaN fails too
                return f"relative error {err:.2g} against the eager ops for the {p.n} x {p.k} {p.fused} product"
    except Exception as e:  # whatever failed (Triton's compiler, the launch), the answer is: not here
        first_line = (str(e).strip().splitlines() or [""])[0][:200]
        return f"{type(e).__name__}: {first_line}"
    return None


def load_configs(path: str) -> int:
    """Add bench/gemv_sweep.py's best configs (its `configs` list of {n, k, fused, block_n, k_chunks, num_warps})
    to CONFIGS; returns how many. Raises ValueError (nothing added) for an entry the kernel cannot launch."""
    with open(path) as f:
        rows = json.load(f)["configs"]
    found = {}
    for r in rows:
        key = (int(r["n"]), int(r["k"]), str(r["fused"]))
        config = (int(r["block_n"]), int(r["k_chunks"]), int(r["num_warps"]))
        powers = all(v >= 1 and v & (v - 1) == 0 for v in (config[0], config[2]))
        launchable = powers and config[2] <= 32 and 1 <= config[1] <= MAX_K_CHUNKS and min(key[:2]) >= 1
        if key[2] not in ("plain", "norm", "swiglu") or not launchable:
            raise ValueError(
                f"config {r} (BLOCK_N and warps powers of two, warps ≤ 32, K_CHUNKS 1-{MAX_K_CHUNKS}, fused plain, "
                "norm or swiglu)"
            )
        found[key] = config
    CONFIGS.update(found)
    return len(found)


def launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    norm_weight: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
    eps: float = 0.0,
    swiglu: bool = False,
    config: tuple[int, int, int] | None = None,
    rope: torch.Tensor | None = None,
    rope_rows: int = 0,
    k_cache: torch.Tensor | None = None,
    v_cache: torch.Tensor | None = None,
    cache_pos: torch.Tensor | None = None,
) -> torch.Tensor:
    """The kernel on x (K,) or (M, K) rows ((2K,) / (M, 2K) with swiglu), M ≤ KERNEL_MAX_ROWS: weight (N, K) → (N,) or
    (M, N); residual shaped as the output. rope: (head_dim,) or (1 or M, head_dim) fp32 cos/sin pairs rotating the
    first rope_rows outputs of each row (whole heads; a program then holds at least one pair). With the caches (and
    rope), the outputs are wqkv's [queries | keys | values]: row m's N - rope_rows values and as many keys before
    them are also written into k_cache / v_cache (M, kv heads, L, head_dim) at position cache_pos[m] (cache_pos 1-D,
    any stride: the fast stack's is one position expanded)."""
    n, k = weight.shape
    width = k * (2 if swiglu else 1)
    rows = x.numel() // width
    assert x.shape[-1] == width and x.numel() == rows * width and 1 <= rows <= KERNEL_MAX_ROWS
    assert x.stride(-1) == 1 and (rows == 1 or x.stride(0) == width) and weight.stride(-1) == 1
    assert not (swiglu and norm_weight is not None)
    assert norm_weight is None or norm_weight.numel() == k
    assert residual is None or (residual.numel() == rows * n and residual.is_contiguous())
    table = None if rope is None else rope.reshape(-1, rope.shape[-1])
    if table is not None:
        assert table.shape[0] in (1, rows) and table.stride(-1) == 1 and rope_rows % table.shape[1] == 0
    kc, vc, pos, cached = x, x, x, False  # stand-ins the kernel never touches without the caches
    if k_cache is not None and v_cache is not None and cache_pos is not None:
        kc, vc, pos, cached = k_cache, v_cache, cache_pos, True
        assert table is not None
        assert kc.stride(-1) == 1 and vc.stride(-1) == 1 and kc.shape[0] == rows == vc.shape[0]
        assert kc.shape[1] * kc.shape[3] == n - rope_rows == vc.shape[1] * vc.shape[3]
        assert kc.shape[3] == table.shape[1] and pos.dim() == 1 and pos.numel() == rows
    out = torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
    block_n, k_chunks, num_warps = config or config_for(n, k, fused_input(norm_weight, swiglu))
    if table is not None:
        block_n = max(2, block_n)
    assert 1 <= k_chunks <= MAX_K_CHUNKS, config
    block_k = max(16, triton.next_power_of_2(triton.cdiv(k, k_chunks)))
    prologue = 2 if swiglu else 0 if norm_weight is None else 1
    _gemv[(triton.cdiv(n, block_n),)](
        x, weight, out, x if norm_weight is None else norm_weight, x if residual is None else residual,
        x if table is None else table, n, k, weight.stride(0), eps, rope_rows,
        0 if table is None or table.shape[0] == 1 else table.stride(0),
        kc, vc, pos, pos.stride(0) if cached else 0,
        *(kc.stride(i) if cached else 0 for i in range(3)),
        *(vc.stride(i) if cached else 0 for i in range(3)),
        ROWS=rows, PROLOGUE=prologue, RESIDUAL=residual is not None, ROPE=table is not None, CACHE=cached,
        HALF_HEAD=1 if table is None else table.shape[1] // 2, BLOCK_N=block_n, BLOCK_K=block_k,
        K_CHUNKS=triton.cdiv(k, block_k), NORM_PAD=triton.next_power_of_2(k), num_warps=num_warps,
        **launch_overlap.kernel_options(x.device),
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
    def _weight_piece(w_ptr, rows, live_n, c: tl.constexpr, k, sw_n, BLOCK_K: tl.constexpr):
        """Piece c (BLOCK_K columns) of the program's weight rows."""
        cols = c * BLOCK_K + tl.arange(0, BLOCK_K)
        mask = live_n[:, None] & (cols < k)[None, :]
        return tl.load(w_ptr + rows[:, None] * sw_n + cols[None, :], mask=mask, other=0.0)

    @triton.jit
    def _piece_sum(w, x_ptr, norm_ptr, c: tl.constexpr, k, scale, PROLOGUE: tl.constexpr, BLOCK_K: tl.constexpr):
        """Weight piece c times the input's piece c, summed along the row."""
        a = _input_piece(x_ptr, norm_ptr, c * BLOCK_K + tl.arange(0, BLOCK_K), k, scale, PROLOGUE)
        return tl.sum(w.to(tl.float32) * a[None, :], axis=1)

    @triton.jit
    def _one_row(
        x_ptr, w0, w1, w2, w3, out_ptr, norm_ptr, res_ptr, rope_ptr, n, k, eps, rope_rows,
        kc_ptr, vc_ptr, pos_ptr, skc_h, skc_l, svc_h, svc_l,
        PROLOGUE: tl.constexpr, RESIDUAL: tl.constexpr, ROPE: tl.constexpr, CACHE: tl.constexpr,
        HALF_HEAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_CHUNKS: tl.constexpr,
        NORM_PAD: tl.constexpr,
    ):  # fmt: skip
        """One row's BLOCK_N outputs of this program (pointers already at the row; w0-w3: the program's weight rows
        in K_CHUNKS pieces, already loaded)."""
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        live_n = rows < n
        scale = 1.0
        if PROLOGUE == 1:  # the whole row's mean square, as F.rms_norm in fp32
            full = tl.arange(0, NORM_PAD)
            xs = tl.load(x_ptr + full, mask=full < k, other=0.0).to(tl.float32)
            scale = tl.rsqrt(tl.sum(xs * xs, axis=0) / k + eps)
        acc = _piece_sum(w0, x_ptr, norm_ptr, 0, k, scale, PROLOGUE, BLOCK_K)  # pieces summed in order, as before
        if K_CHUNKS > 1:
            acc += _piece_sum(w1, x_ptr, norm_ptr, 1, k, scale, PROLOGUE, BLOCK_K)
        if K_CHUNKS > 2:
            acc += _piece_sum(w2, x_ptr, norm_ptr, 2, k, scale, PROLOGUE, BLOCK_K)
        if K_CHUNKS > 3:
            acc += _piece_sum(w3, x_ptr, norm_ptr, 3, k, scale, PROLOGUE, BLOCK_K)
        y = acc.to(out_ptr.dtype.element_ty)
        if ROPE:  # rotate (even, odd) output pairs by their head position's (cos, sin), in fp32 from the rounded y
            even, odd = tl.split(tl.reshape(y.to(tl.float32), (BLOCK_N // 2, 2)))
            pair = (tl.program_id(0) * BLOCK_N) // 2 + tl.arange(0, BLOCK_N // 2)
            cos = tl.load(rope_ptr + 2 * (pair % HALF_HEAD))
            sin = tl.load(rope_ptr + 2 * (pair % HALF_HEAD) + 1)
            rotated = tl.reshape(tl.join(even * cos - odd * sin, odd * cos + even * sin), (BLOCK_N,))
            y = tl.where(rows < rope_rows, rotated.to(out_ptr.dtype.element_ty), y)
        if CACHE:  # the keys (rotated) and values at the row's position in the caches, as Attention.attend writes them
            pos = tl.load(pos_ptr)
            kv = n - rope_rows
            key = rows - (rope_rows - kv)
            is_key = (key >= 0) & (rows < rope_rows)
            k_at = kc_ptr + (key // (2 * HALF_HEAD)) * skc_h + pos * skc_l + key % (2 * HALF_HEAD)
            tl.store(k_at, y.to(kc_ptr.dtype.element_ty), mask=is_key)
            value = rows - rope_rows
            v_at = vc_ptr + (value // (2 * HALF_HEAD)) * svc_h + pos * svc_l + value % (2 * HALF_HEAD)
            tl.store(v_at, y.to(vc_ptr.dtype.element_ty), mask=(value >= 0) & live_n)
        if RESIDUAL:
            r = tl.load(res_ptr + rows, mask=live_n, other=0.0)
            y = (r.to(tl.float32) + y.to(tl.float32)).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + rows, y, mask=live_n)

    @triton.jit
    def _gemv(
        x_ptr, w_ptr, out_ptr, norm_ptr, res_ptr, rope_ptr, n, k, sw_n, eps, rope_rows, srope_m,
        kc_ptr, vc_ptr, pos_ptr, spos_m, skc_m, skc_h, skc_l, svc_m, svc_h, svc_l,
        ROWS: tl.constexpr, PROLOGUE: tl.constexpr, RESIDUAL: tl.constexpr, ROPE: tl.constexpr,
        CACHE: tl.constexpr, HALF_HEAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        K_CHUNKS: tl.constexpr, NORM_PAD: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        """BLOCK_N outputs of every row: the program's weight rows read once into registers (in up to 4 pieces), then
        the rows one after another. With PDL (model.launch_overlap) the next kernel may launch at once, the weights
        are read before waiting for the kernels before this one, and nothing else is read or written before it."""
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        live_n = rows < n
        w0 = _weight_piece(w_ptr, rows, live_n, 0, k, sw_n, BLOCK_K)
        w1 = w0  # unused below K_CHUNKS 2 (and so on)
        w2 = w0
        w3 = w0
        if K_CHUNKS > 1:
            w1 = _weight_piece(w_ptr, rows, live_n, 1, k, sw_n, BLOCK_K)
        if K_CHUNKS > 2:
            w2 = _weight_piece(w_ptr, rows, live_n, 2, k, sw_n, BLOCK_K)
        if K_CHUNKS > 3:
            w3 = _weight_piece(w_ptr, rows, live_n, 3, k, sw_n, BLOCK_K)
        if PDL:
            tl.extra.cuda.gdc_wait()
        x_row = (2 if PROLOGUE == 2 else 1) * k
        for m in tl.static_range(ROWS):
            _one_row(
                x_ptr + m * x_row, w0, w1, w2, w3, out_ptr + m * n, norm_ptr, res_ptr + m * n,
                rope_ptr + m * srope_m, n, k, eps, rope_rows, kc_ptr + m * skc_m, vc_ptr + m * svc_m,
                pos_ptr + m * spos_m, skc_h, skc_l, svc_h, svc_l, PROLOGUE, RESIDUAL, ROPE, CACHE, HALF_HEAD, BLOCK_N,
                BLOCK_K, K_CHUNKS, NORM_PAD,
            )  # fmt: skip

"""Triton kernels for the streaming vocoder: join a causal conv's history with silu(x) in one pass (contiguous or
time-major output), and add a conv's bias in place.

Every silu-first conv of a streaming chunk needs `cat([history (B, C, W), silu(x) (B, C, T)], -1)`. As PyTorch ops
that is a silu pass and a cat pass (the cats were 19 of 80 ms at 64 × 24 frames on an H200); as `silu.out`
into the joined buffer it is one pass, but the strided output sends ATen to its generic elementwise kernel (H200:
415 such kernels, 26.5 of 67 ms). This kernel reads both inputs with any strides and writes the contiguous joined
buffer at full width: one program per (row, block of time). The bias kernels replace ATen's broadcast add, which
also runs the generic kernel (on an H200: 60.2 → 52.3 ms at 64 × 24 frames; model.codec_layers.BIAS_ADD).

Numerics: silu is computed in fp32 as x / (1 + exp(−x)) and rounded once, as ATen's CUDA silu does; exp may differ
from ATen's in the last bit, so the result matches `F.silu` to rounding, not bitwise (tests/model/test_gpu.py).
Without Triton (CPU-only installs) or on a GPU older than Volta, `supported(device)` is False and callers keep the
PyTorch path.
"""

from __future__ import annotations

import functools

import torch

try:
    import triton
    import triton.language as tl

    AVAILABLE = True
except ImportError:  # the CPU wheels of torch ship without Triton
    AVAILABLE = False

MAX_BLOCK = 1024  # time steps per program
MIN_CAPABILITY = (7, 0)  # Triton's GPU backend needs Volta or newer; older GPUs keep the PyTorch path


@functools.cache
def supported(device: torch.device) -> bool:
    """Whether these kernels can run on this device (CUDA, Triton installed, a GPU Triton compiles for)."""
    if not AVAILABLE or device.type != "cuda":
        return False
    return torch.cuda.get_device_capability(device) >= MIN_CAPABILITY


if AVAILABLE:

    @triton.jit
    def _join_silu_kernel(
        prev_ptr, x_ptr, bias_ptr, out_ptr,
        channels, width, length,
        prev_sb, prev_sc, prev_st,
        x_sb, x_sc, x_st,
        BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0).to(tl.int64)  # b · channels + c
        b = row // channels
        c = row % channels
        t = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        total = width + length
        inside = t < total
        from_prev = t < width
        p = tl.load(prev_ptr + b * prev_sb + c * prev_sc + t * prev_st, mask=inside & from_prev, other=0.0)
        xs = tl.load(x_ptr + b * x_sb + c * x_sc + (t - width) * x_st, mask=inside & ~from_prev, other=0.0)
        xf = xs.to(tl.float32)
        if HAS_BIAS:
            xf += tl.load(bias_ptr + c).to(tl.float32)
        y = tl.where(from_prev, p.to(tl.float32), xf / (1.0 + tl.exp(-xf)))
        tl.store(out_ptr + row * total + t, y.to(out_ptr.dtype.element_ty), mask=inside)

    @triton.jit
    def _join_silu_time_major_kernel(
        prev_ptr, x_ptr, bias_ptr, out_ptr,
        channels, width, length,
        prev_sb, prev_sc, prev_st,
        x_sb, x_sc, x_st,
        BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, HAS_BIAS: tl.constexpr,
    ):  # fmt: skip
        b = tl.program_id(0).to(tl.int64)
        t = tl.program_id(1).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)[:, None]
        c = tl.program_id(2).to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C)[None, :]
        total = width + length
        inside = (t < total) & (c < channels)
        from_prev = t < width
        p = tl.load(prev_ptr + b * prev_sb + c * prev_sc + t * prev_st, mask=inside & from_prev, other=0.0)
        xs = tl.load(x_ptr + b * x_sb + c * x_sc + (t - width) * x_st, mask=inside & ~from_prev, other=0.0)
        xf = xs.to(tl.float32)
        if HAS_BIAS:
            xf += tl.load(bias_ptr + c, mask=c < channels, other=0.0).to(tl.float32)
        y = tl.where(from_prev, p.to(tl.float32), xf / (1.0 + tl.exp(-xf)))
        tl.store(out_ptr + (b * total + t) * channels + c, y.to(out_ptr.dtype.element_ty), mask=inside)

    @triton.jit
    def _channel_bias_kernel(y_ptr, bias_ptr, channels, length, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)  # b · channels + c
        t = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = t < length
        bias = tl.load(bias_ptr + row % channels).to(tl.float32)
        y = tl.load(y_ptr + row * length + t, mask=inside).to(tl.float32)
        tl.store(y_ptr + row * length + t, (y + bias).to(y_ptr.dtype.element_ty), mask=inside)

    @triton.jit
    def _channel_bias_time_major_kernel(y_ptr, bias_ptr, channels, numel, BLOCK: tl.constexpr):
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # flat index into (B, T, C) memory
        inside = i < numel
        bias = tl.load(bias_ptr + i % channels, mask=inside, other=0.0).to(tl.float32)
        y = tl.load(y_ptr + i, mask=inside).to(tl.float32)
        tl.store(y_ptr + i, (y + bias).to(y_ptr.dtype.element_ty), mask=inside)

    @triton.jit
    def _bias_residual_kernel(x_ptr, y_ptr, bias_ptr, out_ptr, channels, length, numel, TIME_MAJOR: tl.constexpr,
                              BLOCK: tl.constexpr):  # fmt: skip
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # flat index, x, y and out share a layout
        inside = i < numel
        c = i % channels if TIME_MAJOR else (i // length) % channels
        bias = tl.load(bias_ptr + c, mask=inside, other=0.0).to(tl.float32)
        x = tl.load(x_ptr + i, mask=inside).to(tl.float32)
        y = tl.load(y_ptr + i, mask=inside).to(tl.float32)
        tl.store(out_ptr + i, (x + y + bias).to(out_ptr.dtype.element_ty), mask=inside)


def is_dense_time_major(y: torch.Tensor) -> bool:
    """(B, C, T) stored as a dense (B, T, C) array: the channels-last vocoder's layout."""
    return y.ndim == 3 and y.transpose(1, 2).is_contiguous()


def add_channel_bias_(y: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """`y += bias[:, None]` in place for a conv output y (B, C, T), contiguous or dense time-major
    (`is_dense_time_major`), and bias (C,) on one CUDA device, in fp32 and rounded once, as ATen's add. ATen runs this
    broadcast add through its generic elementwise kernel (a conv's bias: ~97 such adds in a 64 × 24-frame vocoder
    call); this runs at full width. No autograd."""
    if not AVAILABLE:
        raise RuntimeError("add_channel_bias_ needs Triton (installed with CUDA builds of torch)")
    batch, channels, length = y.shape
    contiguous = y.is_contiguous()
    if not (contiguous or is_dense_time_major(y)) or bias.shape != (channels,) or bias.device != y.device:
        raise ValueError(
            f"need a (B, C, T) tensor, contiguous or time-major, and a (C,) bias, got {tuple(y.shape)} with strides "
            f"{y.stride()} and {tuple(bias.shape)}"
        )
    if contiguous:  # also the time-major case when C = 1 or T = 1: both layouts are one array then
        block = min(MAX_BLOCK, triton.next_power_of_2(max(length, 1)))
        _channel_bias_kernel[(batch * channels, triton.cdiv(length, block))](y, bias, channels, length, BLOCK=block)
    else:
        numel = y.numel()
        _channel_bias_time_major_kernel[(triton.cdiv(numel, MAX_BLOCK),)](y, bias, channels, numel, BLOCK=MAX_BLOCK)
    return y


def add_bias_residual(x: torch.Tensor, y: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """`x + (y + bias[:, None])` as a new tensor in one pass, in fp32 rounded once, for x and y (B, C, T) in the same
    dense layout (both contiguous or both time-major): a resblock's residual and its second conv's bias together
    (model.codec_layers.FUSE_BIAS). No autograd."""
    if not AVAILABLE:
        raise RuntimeError("add_bias_residual needs Triton (installed with CUDA builds of torch)")
    _, channels, length = x.shape
    time_major = not x.is_contiguous()
    same = y.shape == x.shape and y.stride() == x.stride() and y.dtype == x.dtype
    same = same and y.device == bias.device == x.device
    if not same or not (x.is_contiguous() or is_dense_time_major(x)) or bias.shape != (channels,):
        raise ValueError(f"x {tuple(x.shape)} {x.stride()} and y {tuple(y.shape)} {y.stride()} need one dense layout")
    out = torch.empty_like(x)  # same strides as x (dense)
    numel = x.numel()
    _bias_residual_kernel[(triton.cdiv(numel, MAX_BLOCK),)](
        x, y, bias, out, channels, length, numel, TIME_MAJOR=time_major, BLOCK=MAX_BLOCK
    )  # fmt: skip
    return out


def join_silu(
    prev: torch.Tensor, x: torch.Tensor, time_major: bool = False, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`cat([prev, silu(x + bias[:, None])], -1)` for prev (B, C, W) and x (B, C, T) of one dtype on one CUDA device,
    any strides (`bias` (C,) optional: a previous conv's bias, added here instead of in a pass of its own); returns a
    new (B, C, W + T) tensor, contiguous, or with `time_major` stored (B, W + T, C) (channel stride 1: the
    channels-last vocoder's layout)."""
    if not AVAILABLE:
        raise RuntimeError("join_silu needs Triton (installed with CUDA builds of torch)")
    batch, channels, width = prev.shape
    if x.shape[:2] != (batch, channels) or x.dtype != prev.dtype or x.device != prev.device:
        raise ValueError(f"prev {tuple(prev.shape)} {prev.dtype} and x {tuple(x.shape)} {x.dtype} do not join")
    if bias is not None and (bias.shape != (channels,) or bias.device != x.device):
        raise ValueError(f"the bias must be ({channels},) on {x.device}, got {tuple(bias.shape)} on {bias.device}")
    length = x.shape[-1]
    total = width + length
    if time_major:
        out = torch.empty(batch, total, channels, dtype=x.dtype, device=x.device)
        block_c = min(128, triton.next_power_of_2(channels))
        block_t = max(1, 4096 // block_c)
        grid = (batch, triton.cdiv(total, block_t), triton.cdiv(channels, block_c))
        _join_silu_time_major_kernel[grid](
            prev, x, x if bias is None else bias, out, channels, width, length, *prev.stride(), *x.stride(),
            BLOCK_T=block_t, BLOCK_C=block_c, HAS_BIAS=bias is not None,
        )  # fmt: skip
        return out.transpose(1, 2)
    out = torch.empty(batch, channels, total, dtype=x.dtype, device=x.device)
    block = min(MAX_BLOCK, triton.next_power_of_2(total))
    rows_grid = (batch * channels, triton.cdiv(total, block))
    _join_silu_kernel[rows_grid](
        prev, x, x if bias is None else bias, out, channels, width, length, *prev.stride(), *x.stride(), BLOCK=block,
        HAS_BIAS=bias is not None,
    )  # fmt: skip
    return out

"""Cached one-token attention for the slow stack's decode step, as a Triton kernel that stops at each row's length.

In a decode step every row attends from one new token to the keys at its positions [0, pos]. SDPA (cuDNN's flash
kernel on the H200) is given the whole attention-length bucket and a mask, so it reads every row's keys up to the
bucket's end (2,048 positions for rows at 1,000-1,900) and ran at ~40 % of the memory bandwidth those bytes need:
5.2 of a 12.1 ms step at 384 rows (H200, docs/DECISIONS.md). Here one program per (row, kv head, split of
the length) reads each key and value block once for the kv head's G query heads (the query heads that share it, as
`Attention` folds them), skips the blocks past the row's length, and keeps a running softmax in fp32; a second
kernel merges the splits when there are several (few rows: more programs than rows × kv heads keep the GPU busy).

Numerics: scores, softmax and the weighted sum accumulate in fp32; the probabilities are rounded to the values'
dtype before their product with V (as flash attention does), so results match SDPA to rounding, not bitwise. fp32
inputs use IEEE fp32 dot products (no TF32). Any head dim (padded to a power of two ≥ 16 with masked lanes).
Tested against the masked softmax on CPU through Triton's interpreter and on CUDA (tests/model/test_decode_attention.py,
tests/model/test_gpu.py). The engine uses it on CUDA by default (`--length-attention auto`,
`DualARTransformer.use_length_attention`): on the H200 the slow stack's attention at 384 rows 5.2 → 1.8 ms, the
step 12.1 → 9.3 ms; and since it stops at each row's length, the step needs one attention length, the cache's.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable

import torch

from . import launch_overlap

try:
    import triton
    import triton.language as tl

    AVAILABLE = True
except ImportError:  # the CPU wheels of torch ship without Triton
    AVAILABLE = False

BLOCK_N = 64  # keys per block
MIN_PROGRAMS = 4 * 132  # split the length until rows × kv heads × splits reaches this (an H200 has 132 SMs)
MERGE_CHUNK = 64  # splits the merge kernel reads as one tile


@functools.cache
def supported(device: torch.device) -> bool:
    """Whether the kernel can run here: CUDA with Triton on Volta or newer (or any device in Triton's interpreter)."""
    if not AVAILABLE:
        return False
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device) >= (7, 0)
    return os.environ.get("TRITON_INTERPRET") == "1"  # Triton's CPU interpreter (the CPU tests)


def split_count(rows: int, kv_heads: int, length: int) -> int:
    """Splits of the length per (row, kv head): enough programs for the GPU, at least one block of keys each."""
    blocks = max(1, -(-length // BLOCK_N))
    return max(1, min(blocks, -(-MIN_PROGRAMS // (rows * kv_heads))))


def length_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor, length_offset: int = 0
) -> torch.Tensor:
    """softmax(q·kᵀ/√d)·v over each row's first `lengths[b] + length_offset` keys (a decode step passes its rows'
    positions and 1: the kernels add it, which saves a one-program kernel per layer). q (B, Hkv, G, D): the G query
    heads of each kv head; keys/values (B, Hkv, L, D), any strides with the last one 1; lengths (B,) int (any
    stride: the fast stack's are one position expanded), 1 ≤ lengths[b] + length_offset ≤ L (clamped
    to L). Returns (B, Hkv, G, D) in q's dtype. Traced by torch.compile it is a custom op, which the compiled graph
    keeps opaque (the launch grid needs concrete sizes, and the large buckets compile with a symbolic batch);
    otherwise the kernels are launched directly: the op's first call imports torch._dynamo and torch._inductor
    (1.5 s on a 2-core CPU; the H200 engine's 4.4-6.9 s kernel self-check at start-up), which an engine that
    compiles nothing never needs."""
    if torch.compiler.is_compiling():
        return torch.ops.fishgate.length_attention(q, keys, values, lengths, length_offset)
    return _launch(q, keys, values, lengths, length_offset)


def self_check(
    device: torch.device,
    dtype: torch.dtype,
    head_dim: int,
    group: int,
    attention: Callable[..., torch.Tensor] = length_attention,
) -> str | None:
    """Run `attention` once on this device at the model's head dim and group size, one and several splits, against
    the masked softmax in fp32: None when it agrees to `dtype`'s rounding, else what went wrong (a compile or launch
    error on an untested GPU, or wrong numbers). The engine runs it before choosing the kernel by default."""
    gen = torch.Generator().manual_seed(0)
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    try:
        for rows, length, lengths in ((1, 256, [200]), (3, 64, [1, 40, 64])):  # several splits, then one
            shape = (rows, 2, length, head_dim)
            keys = torch.randn(shape, generator=gen).to(device, dtype)
            values = torch.randn(shape, generator=gen).to(device, dtype)
            q = torch.randn(rows, 2, group, head_dim, generator=gen).to(device, dtype)
            lens = torch.tensor(lengths, device=device)
            got = attention(q, keys, values, lens).float()
            scores = q.float() @ keys.float().transpose(-1, -2) / math.sqrt(head_dim)
            past = torch.arange(length, device=device).view(1, 1, 1, -1) >= lens.view(-1, 1, 1, 1)
            want = torch.softmax(scores.masked_fill(past, float("-inf")), -1) @ values.float()
            err = float((got - want).norm() / want.norm())
            if not err <= tolerance:  # a NaN fails too
                return f"relative error {err:.2g} against the masked softmax at {rows} rows, {length} keys"
    except Exception as e:  # whatever failed (Triton's compiler, the launch), the answer is: not here
        first_line = (str(e).strip().splitlines() or [""])[0][:200]
        return f"{type(e).__name__}: {first_line}"
    return None


@torch.library.custom_op("fishgate::length_attention", mutates_args=())
def _length_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor, length_offset: int
) -> torch.Tensor:
    return _launch(q, keys, values, lengths, length_offset)


def _launch(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor, length_offset: int = 0
) -> torch.Tensor:
    """The split kernel (and the merge kernel when the length is split) for `length_attention`."""
    bsz, kv_heads, group, dim = q.shape
    length = keys.shape[2]
    assert keys.stride(-1) == 1 and values.stride(-1) == 1, "keys and values need unit stride in the head dim"
    dim_pad = max(16, triton.next_power_of_2(dim))  # tl.dot and tl.arange need a power of two ≥ 16: masked lanes
    splits = split_count(bsz, kv_heads, length)
    split_len = -(-length // splits)
    split_len = -(-split_len // BLOCK_N) * BLOCK_N  # whole blocks per split
    group_pad = max(16, triton.next_power_of_2(group))  # tl.dot needs 16 rows at least
    out = torch.empty(bsz, kv_heads, group, dim, dtype=q.dtype, device=q.device)
    pdl = launch_overlap.kernel_options(q.device)  # the next kernel may launch early; these wait before any read
    if splits == 1:
        peak = total = acc = out  # unused: the kernel normalises and writes `out` itself
    else:
        peak = torch.empty(bsz, kv_heads, splits, group_pad, dtype=torch.float32, device=q.device)  # running max
        total = torch.empty_like(peak)  # softmax denominators
        acc = torch.empty(bsz, kv_heads, splits, group_pad, dim_pad, dtype=torch.float32, device=q.device)
    _length_attention_split[(bsz, kv_heads, splits)](
        q, keys, values, lengths, out, peak, total, acc,
        *q.stride()[:3], *keys.stride()[:3], *values.stride()[:3], *out.stride()[:3],
        1.0 / math.sqrt(dim), length, split_len, lengths.stride(0), length_offset,
        GROUP=group, GROUP_PAD=group_pad, DIM=dim, DIM_PAD=dim_pad, BLOCK=BLOCK_N, SPLITS=splits,
        IEEE=q.dtype == torch.float32, **pdl,
    )  # fmt: skip
    if splits > 1:
        _length_attention_merge[(bsz, kv_heads, group)](
            peak, total, acc, out, lengths, *out.stride()[:3], length, split_len, lengths.stride(0), length_offset,
            GROUP_PAD=group_pad, DIM=dim, DIM_PAD=dim_pad, SPLITS=splits,
            CHUNK=min(MERGE_CHUNK, triton.next_power_of_2(splits)), **pdl,
        )  # fmt: skip
    return out


@_length_attention.register_fake
def _(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor, length_offset: int
) -> torch.Tensor:
    return torch.empty_like(q, memory_format=torch.contiguous_format)


if AVAILABLE:

    @triton.jit
    def _length_attention_split(
        q_ptr, k_ptr, v_ptr, len_ptr, out_ptr, m_ptr, l_ptr, acc_ptr,
        sq_b, sq_h, sq_g, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n, so_b, so_h, so_g,
        scale, length_bucket, split_len, s_len, length_offset,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, DIM: tl.constexpr, DIM_PAD: tl.constexpr,
        BLOCK: tl.constexpr, SPLITS: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        if PDL:  # model.launch_overlap: the next kernel may launch now; every read here waits for the ones before
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        b = tl.program_id(0)
        h = tl.program_id(1)
        s = tl.program_id(2)
        n_keys = tl.minimum(tl.load(len_ptr + b * s_len).to(tl.int32) + length_offset, length_bucket)
        start = s * split_len
        end = tl.minimum(start + split_len, n_keys)
        g = tl.arange(0, GROUP_PAD)
        d = tl.arange(0, DIM_PAD)
        in_dim = d[None, :] < DIM  # padding lanes of the head dim: loaded as 0, never stored
        q_mask = (g[:, None] < GROUP) & in_dim
        q = tl.load(q_ptr + b * sq_b + h * sq_h + g[:, None] * sq_g + d[None, :], mask=q_mask, other=0.0)
        m_i = tl.full((GROUP_PAD,), float("-inf"), tl.float32)
        l_i = tl.zeros((GROUP_PAD,), tl.float32)
        acc = tl.zeros((GROUP_PAD, DIM_PAD), tl.float32)
        k_base = k_ptr + b * sk_b + h * sk_h
        v_base = v_ptr + b * sv_b + h * sv_h
        for n0 in range(start, end, BLOCK):
            n = n0 + tl.arange(0, BLOCK)
            live = n < end
            k = tl.load(k_base + n[:, None] * sk_n + d[None, :], mask=live[:, None] & in_dim, other=0.0)
            if IEEE:
                scores = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                scores = tl.dot(q, tl.trans(k))
            scores = tl.where(live[None, :], scores * scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, 1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(scores - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_base + n[:, None] * sv_n + d[None, :], mask=live[:, None] & in_dim, other=0.0)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        if SPLITS == 1:
            o = acc / l_i[:, None]
            dest = out_ptr + b * so_b + h * so_h + g[:, None] * so_g + d[None, :]
            tl.store(dest, o.to(out_ptr.dtype.element_ty), mask=q_mask)
        else:
            at = (b * tl.num_programs(1) + h) * SPLITS + s
            tl.store(m_ptr + at * GROUP_PAD + g, m_i)
            tl.store(l_ptr + at * GROUP_PAD + g, l_i)
            tl.store(acc_ptr + (at * GROUP_PAD + g[:, None]) * DIM_PAD + d[None, :], acc)

    @triton.jit
    def _length_attention_merge(
        m_ptr, l_ptr, acc_ptr, out_ptr, len_ptr, so_b, so_h, so_g, length_bucket, split_len, s_len, length_offset,
        GROUP_PAD: tl.constexpr, DIM: tl.constexpr, DIM_PAD: tl.constexpr, SPLITS: tl.constexpr,
        CHUNK: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        if PDL:  # as in the split kernel
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        # one program per query head: CHUNK splits at a time as one (CHUNK, DIM_PAD) tile, so a one-row step's
        # 16 heads × up to 64 splits merge in one pass each (a loop over the splits, one program per kv head, took
        # 13-14 µs a layer on the H200)
        b = tl.program_id(0)
        h = tl.program_id(1)
        g = tl.program_id(2)
        d = tl.arange(0, DIM_PAD)
        c = tl.arange(0, CHUNK)
        first = (b * tl.num_programs(1) + h) * SPLITS
        # only the splits that hold keys of this row: one past them holds m = -inf, l = 0, acc = 0 and would add
        # exactly 0, so a short row in a long bucket merges few splits
        n_keys = tl.minimum(tl.load(len_ptr + b * s_len).to(tl.int32) + length_offset, length_bucket)
        live = tl.cdiv(n_keys, split_len)
        m_max = tl.full((1,), float("-inf"), tl.float32)
        for s0 in range(0, live, CHUNK):
            s = s0 + c
            m_max = tl.maximum(
                m_max, tl.max(tl.load(m_ptr + (first + s) * GROUP_PAD + g, mask=s < live, other=float("-inf")))
            )
        total = tl.zeros((1,), tl.float32)
        acc = tl.zeros((DIM_PAD,), tl.float32)
        for s0 in range(0, live, CHUNK):
            s = s0 + c
            here = s < live
            at = (first + s) * GROUP_PAD + g
            w = tl.exp(tl.load(m_ptr + at, mask=here, other=float("-inf")) - m_max)  # 0 past the live splits
            total += tl.sum(w * tl.load(l_ptr + at, mask=here, other=0.0))
            part = tl.load(acc_ptr + at[:, None] * DIM_PAD + d[None, :], mask=here[:, None], other=0.0)
            acc += tl.sum(w[:, None] * part, 0)
        dest = out_ptr + b * so_b + h * so_h + g * so_g + d
        tl.store(dest, (acc / total).to(out_ptr.dtype.element_ty), mask=d < DIM)

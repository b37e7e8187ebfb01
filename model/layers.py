"""Transformer building blocks shared by the slow and fast stacks: RMSNorm, GQA attention, SwiGLU, pre-norm block.

Parameter names match the official checkpoint (`attention.wqkv`, `attention.wo`, `feed_forward.w1/w2/w3`,
`attention_norm`, `ffn_norm`). Attention either attends causally within its input (teacher-forced forward) or
writes its keys/values into a caller-provided cache view and attends over it; it knows nothing about slots.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from . import gemv
from .compiled_regions import region
from .decode_attention import length_attention
from .rope import apply_rope


class Embedding(nn.Embedding):
    """nn.Embedding without its random init on the meta device, where a model is built only to be loaded
    (model.checkpoint): torch's meta `normal_` imports torch._dynamo on first use, 1.5 s of a CPU server's start."""

    def reset_parameters(self) -> None:
        if not self.weight.is_meta:
            super().reset_parameters()


class Linear(nn.Linear):
    """nn.Linear with an optional batch-invariant mode.

    BLAS picks different kernels (and so different summation orders) for different row counts, so a row's result
    can change in the last bits with the batch it runs in. In batch-invariant mode every row is its own
    (1, K) @ (K, N) product of one batched call: bitwise the same result alone or beside any other rows, at a
    throughput cost. The engine turns it on where reproducibility under load is asked for (CPU, and on request).
    """

    batch_invariant = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_weight(x, self.weight, self.bias)

    def forward_weight(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """This layer's product (batch-invariant or not) with another weight, e.g. a fused one."""
        if not self.batch_invariant:
            return F.linear(x, weight, bias)
        return invariant_linear(x, weight, bias)


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear computed row by row in one bmm (see Linear): x (..., K), weight (N, K). A single row runs as two:
    CPU torch takes another kernel for a bmm of batch 1 whose sums differ in the last bits from those of every
    larger batch (seen with 2+ threads on an Intel Xeon at K 32, N 1,300: a tied token head)."""
    rows = x.reshape(-1, 1, x.shape[-1])  # (R, 1, K)
    count = rows.shape[0]
    if count == 1:
        rows = torch.cat([rows, rows])
    out = torch.bmm(rows, weight.t().unsqueeze(0).expand(rows.shape[0], -1, -1))[:count]  # (R, 1, N)
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


class RMSNorm(nn.Module):
    """Normalise in fp32, cast back, then scale in the model dtype (upstream's order of operations).

    F.rms_norm is one fused kernel on CUDA where the spelled-out formula was seven (−0.67 ms per batch-1 decode
    step on an H200, same greedy frames; docs/archive/benchmark-log.md); it computes x·rsqrt(mean(x²) + eps) like
    upstream.
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return normed.type_as(x) * self.weight


def invariant_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None
) -> torch.Tensor:
    """Plain softmax attention whose per-row arithmetic does not depend on the batch (SDPA's CPU kernel splits
    work by batch × heads, which changes the summation order). q (B, H, Q, hd), keys/values (B, H, L, hd)."""
    scores = (q @ keys.transpose(-1, -2)) * (q.shape[-1] ** -0.5)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ values


def reduction_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None
) -> torch.Tensor:
    """Softmax attention written as broadcast products and sums in fp32, for inductor to turn into reductions
    spread over the whole GPU (cuDNN's SDPA runs one CTA per kv head for a single decode row). Only inside a
    compiled region: run eagerly it would materialise (B, H, Q, L, hd). q (B, H, Q, hd), keys/values (B, H, L, hd)."""
    scores = (q.float().unsqueeze(3) * keys.float().unsqueeze(2)).sum(-1) * (q.shape[-1] ** -0.5)  # (B, H, Q, L)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return (probs.unsqueeze(-1) * values.float().unsqueeze(2)).sum(-2).to(q.dtype)  # (B, H, Q, hd)


class Attention(nn.Module):
    batch_invariant = False  # see Linear; set through DualARTransformer.set_batch_invariant
    # Cached single-token attention inside compiled regions: "auto" = reduction_attention for one row (on the
    # H200: batch-1 step 3.83 → 3.27 ms; at batch 8 it was slower, 4.56 → 5.81 ms, so SDPA there), "reduction"
    # = for every batch (bench/step_variants.py's what-if), "sdpa" = never. Eager paths always use SDPA.
    decode_attention = "auto"
    # Cached single-token attention through model.decode_attention's kernel, which reads each row's keys only up to
    # its position (the slow stack's layers only: their mask is exactly "positions ≤ input_pos"); set through
    # DualARTransformer.use_length_attention. Takes precedence over decode_attention.
    length_attention = False

    def __init__(self, dim: int, n_head: int, n_local_heads: int, qkv_bias: bool) -> None:
        super().__init__()
        self.n_head = n_head
        self.n_local_heads = n_local_heads
        self.head_dim = dim // n_head
        self.dim = dim
        self.qk_width = (n_head + n_local_heads) * self.head_dim  # wqkv's query and key heads: what RoPE rotates
        self.wqkv = Linear(dim, (n_head + 2 * n_local_heads) * self.head_dim, bias=qkv_bias)
        self.wo = Linear(dim, dim, bias=False)

    def forward(
        self,
        x: torch.Tensor,  # (B, T, dim)
        freqs: torch.Tensor,  # (B, T, hd/2, 2) or (T, hd/2, 2)
        k_cache: torch.Tensor | None = None,  # (B, n_local_heads, L, hd) view, written in place
        v_cache: torch.Tensor | None = None,
        input_pos: torch.Tensor | None = None,  # (B, T) absolute positions to write
        mask: torch.Tensor | None = None,  # (B, 1, T, L) bool, True = visible; None = all of the view visible
    ) -> torch.Tensor:
        return self.wo(self.attend(self.wqkv(x), freqs, k_cache, v_cache, input_pos, mask))

    def attend(
        self,
        qkv: torch.Tensor,  # (B, T, (n_head + 2 n_local_heads) hd): the wqkv product
        freqs: torch.Tensor,
        k_cache: torch.Tensor | None = None,
        v_cache: torch.Tensor | None = None,
        input_pos: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        rotated: bool = False,
        cached: bool = False,
    ) -> torch.Tensor:
        """Everything between the two projections: RoPE (unless `rotated`: qkv's query and key heads come rotated),
        the cache writes (unless `cached`: the caller wrote qkv's keys and values), attention → (B, T, dim)."""
        bsz, seqlen, _ = qkv.shape
        # RoPE over the q and k heads in one pass: the same arithmetic per element, half the kernel launches
        qk = qkv[..., : self.qk_width].view(bsz, seqlen, self.n_head + self.n_local_heads, self.head_dim)
        q, k = (qk if rotated else apply_rope(qk, freqs)).split([self.n_head, self.n_local_heads], dim=2)
        v = qkv[..., self.qk_width :].view(bsz, seqlen, self.n_local_heads, self.head_dim)

        group = self.n_head // self.n_local_heads
        # Query head h reads kv head h // group (upstream's repeat_interleave). Folding the group into the query
        # length lets every query of a kv head share one K/V read without materialising repeated K/V.
        q = q.transpose(1, 2).reshape(bsz, self.n_local_heads, group * seqlen, self.head_dim)  # (B, Hkv, G·T, hd)
        if k_cache is None or v_cache is None:
            keys, values = k.transpose(1, 2), v.transpose(1, 2)  # (B, Hkv, T, hd)
            causal = torch.ones(seqlen, seqlen, dtype=torch.bool, device=qkv.device).tril()
            attn_mask: torch.Tensor | None = causal.repeat(group, 1)  # (G·T, T)
        else:
            assert input_pos is not None
            if not cached:
                rows = torch.arange(bsz, device=qkv.device).unsqueeze(1)  # (B, 1)
                k_cache[rows, :, input_pos] = k.to(k_cache.dtype)  # indexes (B, T, Hkv, hd)
                v_cache[rows, :, input_pos] = v.to(v_cache.dtype)
            keys, values = k_cache, v_cache
            attn_mask = None
            if mask is not None:
                attn_mask = mask.unsqueeze(2).expand(bsz, 1, group, seqlen, mask.shape[-1])
                attn_mask = attn_mask.reshape(bsz, 1, group * seqlen, mask.shape[-1])
        if self.length_attention and k_cache is not None and seqlen == 1 and not self.batch_invariant:
            assert input_pos is not None
            y = length_attention(q, keys, values, input_pos[:, 0], length_offset=1)  # keys [0, pos] of each row
        elif self.batch_invariant or qkv.device.type == "cpu":
            # also the faster choice on CPU: SDPA's CPU kernel costs milliseconds per call at these sizes
            y = invariant_attention(q, keys, values, attn_mask)
        elif self._by_reduction(bsz, seqlen, k_cache is not None):
            y = reduction_attention(q, keys, values, attn_mask)
        else:
            y = F.scaled_dot_product_attention(q, keys, values, attn_mask=attn_mask)  # (B, Hkv, G·T, hd)
        return y.reshape(bsz, self.n_head, seqlen, self.head_dim).transpose(1, 2).reshape(bsz, seqlen, self.dim)

    def _by_reduction(self, bsz: int, seqlen: int, cached: bool) -> bool:
        if not cached or seqlen != 1 or not torch.compiler.is_compiling():
            return False
        return self.decode_attention == "reduction" or (self.decode_attention == "auto" and bsz == 1)


class FeedForward(nn.Module):
    """SwiGLU. After `fuse()`, w1 and w3 are views into one (2·I, dim) weight and their two products are one matmul
    (one GEMV instead of two per layer in a decode step): each output is the same dot product, so the result equals
    the unfused one up to the BLAS kernel's summation order."""

    def __init__(self, dim: int, intermediate_size: int) -> None:
        super().__init__()
        self.w1 = Linear(dim, intermediate_size, bias=False)
        self.w3 = Linear(dim, intermediate_size, bias=False)
        self.w2 = Linear(intermediate_size, dim, bias=False)
        self.w13: torch.Tensor | None = None

    @torch.no_grad()
    def fuse(self) -> None:
        """Store w1 and w3 in one tensor (their parameters become views of it, so state_dict and load_state_dict
        still see the official keys; `.to()` and friends fuse the moved weights again)."""
        if self.w13 is not None:
            return
        w13 = torch.cat([self.w1.weight, self.w3.weight])
        n = self.w1.weight.shape[0]
        self.w1.weight = nn.Parameter(w13[:n], requires_grad=self.w1.weight.requires_grad)
        self.w3.weight = nn.Parameter(w13[n:], requires_grad=self.w3.weight.requires_grad)
        self.w13 = w13

    def _apply(self, fn: Any, recurse: bool = True) -> FeedForward:
        fused = self.w13 is not None
        self.w13 = None
        super()._apply(fn, recurse)
        if fused:  # the moved w1 and w3 are separate tensors now
            self.fuse()
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.w13 is None:
            return self.w2(F.silu(self.w1(x)) * self.w3(x))
        gate, up = self.w1.forward_weight(x, self.w13).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


class TransformerBlock(nn.Module):
    def __init__(
        self, dim: int, n_head: int, n_local_heads: int, intermediate_size: int, qkv_bias: bool, norm_eps: float
    ) -> None:
        super().__init__()
        self.attention = Attention(dim, n_head, n_local_heads, qkv_bias)
        self.feed_forward = FeedForward(dim, intermediate_size)
        self.attention_norm = RMSNorm(dim, norm_eps)
        self.ffn_norm = RMSNorm(dim, norm_eps)

    @region
    def forward(
        self,
        x: torch.Tensor,
        freqs: torch.Tensor,
        k_cache: torch.Tensor | None = None,
        v_cache: torch.Tensor | None = None,
        input_pos: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if self._by_gemv_kernels(x):
            return self._few_rows(x, freqs, k_cache, v_cache, input_pos, mask)
        h = x + self.attention(self.attention_norm(x), freqs, k_cache, v_cache, input_pos, mask)
        return h + self.feed_forward(self.ffn_norm(h))

    def _by_gemv_kernels(self, x: torch.Tensor) -> bool:
        """Up to gemv.MAX_ROWS rows of one position each inside a compiled region with model.gemv's kernels on (not
        batch-invariant mode: there a row must compute as it does beside others), fused w1/w3, no qkv bias."""
        attention, ff = self.attention, self.feed_forward
        return (
            ff.w13 is not None
            and x.dim() == 3
            and x.shape[1] == 1
            and attention.wqkv.bias is None
            and not (attention.batch_invariant or attention.wqkv.batch_invariant)
            and gemv.applies(x, attention.wqkv.weight)
        )

    def _few_rows(
        self,
        x: torch.Tensor,
        freqs: torch.Tensor,
        k_cache: torch.Tensor | None,
        v_cache: torch.Tensor | None,
        input_pos: torch.Tensor | None,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """forward for a few one-position rows as four model.gemv kernels around the attention: the two norms, RoPE,
        the cache writes and the residual adds ride on the products (no kernels of their own), SwiGLU on w2's."""
        attention, ff = self.attention, self.feed_forward
        assert ff.w13 is not None
        norm1, norm2 = self.attention_norm, self.ffn_norm
        rope_rows = attention.qk_width
        if k_cache is not None and v_cache is not None and input_pos is not None:  # keys, values written by the kernel
            qkv = gemv.attention_input(
                x, attention.wqkv.weight, norm1.weight, norm1.eps, freqs, rope_rows, k_cache, v_cache, input_pos
            )
            cached = True
        else:
            qkv = gemv.linear(x, attention.wqkv.weight, norm1.weight, norm1.eps, rope=freqs, rope_rows=rope_rows)
            cached = False
        y = attention.attend(qkv, freqs, k_cache, v_cache, input_pos, mask, rotated=True, cached=cached)
        h = gemv.linear(y, attention.wo.weight, residual=x)
        gate_up = gemv.linear(h, ff.w13, norm2.weight, norm2.eps)
        return gemv.linear(gate_up, ff.w2.weight, swiglu=True, residual=h)

"""Rotary position embeddings exactly as Fish Speech 1.5 computes them.

Interleaved pairs (GPT-J / Meta style, not rotate-half). The (cos, sin) table is rounded to bfloat16 even when the
model runs in fp32 — skipping that rounding moves fp32 logits by ~1e-4 (spec §1.2). The rotation itself runs in
fp32 and is cast back to the activation dtype.
"""

from __future__ import annotations

import torch


def build_rope_table(seq_len: int, head_dim: int, base: float) -> torch.Tensor:
    """(seq_len, head_dim // 2, 2) fp32 table of bf16-rounded (cos, sin)."""
    # explicit device: the table is real data even when the model is built under a meta-device context
    exponent = torch.arange(0, head_dim, 2, dtype=torch.float32, device="cpu")[: head_dim // 2] / head_dim
    inv_freq = 1.0 / (float(base) ** exponent)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32, device="cpu"), inv_freq)  # (L, hd/2)
    table = torch.stack([torch.cos(angles), torch.sin(angles)], dim=-1)
    return table.to(torch.bfloat16).to(torch.float32)


def apply_rope(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Rotate x (B, T, H, hd) by freqs (B, T, hd/2, 2) (or broadcastable (T, hd/2, 2))."""
    xf = x.float().reshape(*x.shape[:-1], -1, 2)  # (B, T, H, hd/2, 2)
    if freqs.dim() == 3:
        freqs = freqs.unsqueeze(0)
    freqs = freqs.unsqueeze(2)  # (B, T, 1, hd/2, 2)
    cos, sin = freqs[..., 0], freqs[..., 1]
    x0, x1 = xf[..., 0], xf[..., 1]
    out = torch.stack([x0 * cos - x1 * sin, x1 * cos + x0 * sin], dim=-1)
    return out.flatten(-2).type_as(x)

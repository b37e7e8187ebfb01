"""Static key/value caches laid out for many independent slots (one slot = one stream).

Slow cache: one tensor per k and v of shape (n_layer, n_slots, n_local_heads, max_seq_len, head_dim), preallocated
once and written by index, so shapes never change and one CUDA graph per batch bucket can replay over it. Each slot
has its own position (the engine tracks it). A batched decode step works on the leading rows `[0, B)` as a
zero-copy view; the engine keeps active streams packed there with `move_slot`. The fast (codebook) cache is tiny
and rewritten every frame. Knows nothing about sampling or scheduling.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Cache lengths are rounded up to a multiple of this, as upstream's setup_caches does.
SEQ_ALIGN = 8


@dataclass(frozen=True, slots=True)
class CacheView:
    """The part of a cache one forward pass reads and writes: rows [row0, row0+B), positions [0, attn_len)."""

    k: torch.Tensor  # (n_layer, B, n_local_heads, attn_len, head_dim) view
    v: torch.Tensor


class KVCache:
    """Preallocated per-slot KV storage for one transformer stack."""

    def __init__(
        self,
        n_layer: int,
        n_slots: int,
        n_local_heads: int,
        max_seq_len: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        max_seq_len = -(-max_seq_len // SEQ_ALIGN) * SEQ_ALIGN
        shape = (n_layer, n_slots, n_local_heads, max_seq_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    @property
    def n_slots(self) -> int:
        return self.k.shape[1]

    @property
    def max_seq_len(self) -> int:
        return self.k.shape[3]

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def bytes_per_slot(self) -> int:
        return self.nbytes // self.n_slots

    def view(self, row0: int, rows: int, attn_len: int) -> CacheView:
        if row0 < 0 or row0 + rows > self.n_slots:
            raise IndexError(f"cache rows [{row0}, {row0 + rows}) outside [0, {self.n_slots})")
        if not 0 < attn_len <= self.max_seq_len:
            raise IndexError(f"attention length {attn_len} outside (0, {self.max_seq_len}]")
        return CacheView(self.k[:, row0 : row0 + rows, :, :attn_len], self.v[:, row0 : row0 + rows, :, :attn_len])

    def rows(self, row0: int, count: int = 1) -> KVCache:
        """A cache whose row 0 is row `row0` of this one (shared storage): lets one stream decode in any slot."""
        sub = object.__new__(KVCache)
        sub.k = self.k[:, row0 : row0 + count]
        sub.v = self.v[:, row0 : row0 + count]
        return sub

    def gather(self, rows: torch.Tensor, length: int) -> KVCache:
        """A new cache holding copies of positions [0, length) of `rows` (B,), in that order."""
        out = object.__new__(KVCache)
        out.k = self.k[:, rows, :, :length].clone()
        out.v = self.v[:, rows, :, :length].clone()
        return out

    def scatter(self, src: KVCache, rows: torch.Tensor, length: int) -> None:
        """Write positions [0, length) of src's rows 0..B−1 back into `rows` (the inverse of `gather`)."""
        self.k[:, rows, :, :length] = src.k[:, :, :, :length]
        self.v[:, rows, :, :length] = src.v[:, :, :, :length]

    def permute_slots(self, dst: torch.Tensor, src: torch.Tensor, length: int) -> None:
        """Slot dst[i] takes positions [0, length) of slot src[i], for all i at once (every source is read before any
        slot is written, so slots may trade places): one gather and one scatter per tensor."""
        if length <= 0 or dst.numel() == 0:
            return
        self.k[:, dst, :, :length] = self.k[:, src, :, :length]
        self.v[:, dst, :, :length] = self.v[:, src, :, :length]

    def move_slot(self, src: int, dst: int, length: int) -> None:
        """Copy positions [0, length) of slot src into slot dst (used to keep active slots packed)."""
        if src == dst or length <= 0:
            return
        self.k[:, dst, :, :length].copy_(self.k[:, src, :, :length])
        self.v[:, dst, :, :length].copy_(self.v[:, src, :, :length])

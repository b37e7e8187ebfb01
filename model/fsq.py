"""Grouped residual finite scalar quantization (FSQ) of the firefly codec: codes ↔ continuous features.

Owns the code arithmetic (digits `(idx // basis) mod L`, values `(d − ⌊L/2⌋)/⌊L/2⌋`, residual scale `(L−1)^−r`),
the per-group `project_in`/`project_out` Linears (upstream names `rvqs.{g}.project_{in,out}`), out-of-range code
clamping with a device-side counter, and the encoder's bound-and-round (vector_quantize_pytorch 1.14.24, which
bounds the projected input once before the residual loop and again inside every stage). No convolutions here.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

# FSQ bound() squeezes values to just inside the level range; upstream's eps.
FSQ_BOUND_EPS = 1e-3


class ResidualFSQ(nn.Module):
    """One group: project_in (encoder only) / project_out (decoder) around the residual FSQ stages."""

    def __init__(self, dim: int, levels: tuple[int, ...], with_encoder: bool) -> None:
        super().__init__()
        codebook_dim = len(levels)
        # Upstream uses Identity (and stores no keys) when the group is already codebook_dim wide.
        self.project_out: nn.Module = nn.Linear(codebook_dim, dim) if dim != codebook_dim else nn.Identity()
        self.project_in: nn.Module | None = None
        if with_encoder:
            self.project_in = nn.Linear(dim, codebook_dim) if dim != codebook_dim else nn.Identity()


class GroupedResidualFSQ(nn.Module):
    """`n_groups` independent residual FSQs over equal channel slices; codes rows are `group · n_codebooks + stage`."""

    levels: torch.Tensor  # (C,) int64 number of levels per codebook dim
    basis: torch.Tensor  # (C,) int64 mixed-radix place values
    half_width: torch.Tensor  # (C,) int64 ⌊L/2⌋
    scales: torch.Tensor  # (R, C) fp32 residual stage scales
    clamped_codes: torch.Tensor  # () int64

    def __init__(
        self, dim: int, levels: tuple[int, ...], n_groups: int, n_codebooks: int, with_encoder: bool = False
    ) -> None:
        super().__init__()
        self.levels_list = tuple(levels)
        self.n_groups = n_groups
        self.n_codebooks = n_codebooks
        self.group_dim = dim // n_groups
        self.codebook_size = 1
        for n in levels:
            self.codebook_size *= n
        self.rvqs = nn.ModuleList(ResidualFSQ(self.group_dim, self.levels_list, with_encoder) for _ in range(n_groups))
        self.init_buffers()

    def init_buffers(self, device: torch.device | str | None = None) -> None:
        """(Re)create the non-persistent constant buffers on `device` (after a meta-device build)."""
        # computed on the CPU, as upstream computes them at construction, then moved: on the meta device these ops
        # run torch's Python reference kernels, whose first use imports torch._dynamo (1.5 s of a CPU server's start)
        target = torch.get_default_device() if device is None else torch.device(device)
        cpu = torch.device("cpu")
        levels = torch.tensor(self.levels_list, dtype=torch.int64, device=cpu)
        basis = torch.cumprod(torch.cat([levels.new_ones(1), levels[:-1]]), dim=0)
        half_width = levels // 2
        stages = torch.arange(self.n_codebooks, device=cpu, dtype=torch.float32)[:, None]
        # (levels − 1) ** −r computed in fp32 exactly as upstream's `scales` buffer. (R, C)
        scales = (levels.to(torch.float32) - 1) ** -stages
        levels, basis, half_width, scales = (t.to(target) for t in (levels, basis, half_width, scales))
        self.register_buffer("levels", levels, persistent=False)
        self.register_buffer("basis", basis, persistent=False)
        self.register_buffer("half_width", half_width, persistent=False)
        self.register_buffer("scales", scales, persistent=False)
        # Number of out-of-range codes seen by decode(); read it off the hot path (it never forces a sync).
        self.register_buffer("clamped_codes", torch.zeros((), dtype=torch.int64, device=target), persistent=False)

    def groups(self) -> list[ResidualFSQ]:
        return [cast(ResidualFSQ, m) for m in self.rvqs]

    # --- decode -------------------------------------------------------------------------------------------------

    def codes_to_values(self, codes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Integer codes (B, rows, T) → summed residual FSQ values (B, G, T, C) before project_out."""
        bsz, rows, length = codes.shape
        if rows != self.n_groups * self.n_codebooks:
            raise ValueError(
                f"codes have {rows} rows; this codec needs n_groups·n_codebooks = {self.n_groups * self.n_codebooks}"
            )
        codes = codes.to(torch.int64)
        bad = (codes < 0) | (codes >= self.codebook_size)
        self.clamped_codes.add_(bad.sum())
        codes = codes.clamp(0, self.codebook_size - 1)
        digits = (codes[..., None] // self.basis) % self.levels  # (B, rows, T, C)
        values = (digits - self.half_width) / self.half_width  # exact in fp32, as upstream's implicit codebook
        values = values.view(bsz, self.n_groups, self.n_codebooks, length, -1)
        values = values * self.scales[None, None, :, None, :]
        return values.sum(dim=2).to(dtype)  # (B, G, T, C)

    def decode(self, codes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Codes (B, rows, T) → features (B, D, T); codes outside [0, codebook_size) are clamped and counted."""
        values = self.codes_to_values(codes, dtype)  # (B, G, T, C)
        outs = [rvq.project_out(values[:, g]) for g, rvq in enumerate(self.groups())]  # G × (B, T, Dg)
        return torch.cat(outs, dim=-1).transpose(1, 2)  # (B, D, T)

    # --- encode -------------------------------------------------------------------------------------------------

    def bound(self, z: torch.Tensor) -> torch.Tensor:
        """Squash z (…, C) into the level range: tanh(z + shift)·half_l − offset (upstream FSQ.bound)."""
        half_l = (self.levels - 1) * (1 + FSQ_BOUND_EPS) / 2
        offset = (self.levels % 2 == 0).to(torch.float32) * 0.5  # 0.5 for even level counts, else 0
        shift = (offset / half_l).atanh()
        return (z + shift).tanh() * half_l - offset

    def project_in(self, x: torch.Tensor) -> torch.Tensor:
        """Features (B, T, D) → continuous pre-quantization values (B, T, G·C), groups concatenated."""
        chunks = x.chunk(self.n_groups, dim=-1)
        outs = []
        for rvq, c in zip(self.groups(), chunks, strict=True):
            if rvq.project_in is None:
                raise RuntimeError("this FSQ was built without its encoder half (with_encoder=False)")
            outs.append(rvq.project_in(c))
        return torch.cat(outs, dim=-1)

    def quantize(self, z: torch.Tensor) -> torch.Tensor:
        """Continuous values (B, T, G·C) from project_in → codes (B, rows, T) int64."""
        bsz, length, _ = z.shape
        z = z.float().view(bsz, length, self.n_groups, -1)  # (B, T, G, C)
        residual = self.bound(z)
        indices = []
        for r in range(self.n_codebooks):
            scale = self.scales[r]
            level_idx = self.bound(residual / scale).round()  # integers in [−⌊L/2⌋, ⌈L/2⌉)
            residual = residual - level_idx / self.half_width * scale
            indices.append(((level_idx + self.half_width) * self.basis).sum(dim=-1).to(torch.int64))  # (B, T, G)
        codes = torch.stack(indices, dim=-1)  # (B, T, G, R)
        return codes.reshape(bsz, length, -1).transpose(1, 2)  # (B, G·R, T)

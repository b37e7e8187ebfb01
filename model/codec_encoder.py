"""Encoder half of the firefly codec: log-mel → ConvNeXt backbone → quantizer downsample → FSQ codes.

Owns the ConvNeXt backbone (`backbone.*`: causal k=7 stem + channels-first LayerNorm, LayerNorm + 1×1 conv between
stages, ConvNeXt blocks, final LayerNorm), the quantizer's strided downsample stages (`quantizer.downsample.*`) and
the encode flow with its intermediate tensors. Used for reference (voice-cloning) audio only; the streaming decode
path never touches it. Audio must already be mono at the codec's sample rate (see audio_prep).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
from torch import nn

from .codec_config import BackboneConfig, QuantizerConfig
from .codec_layers import CausalConv1d, ConvNeXtBlock
from .fsq import GroupedResidualFSQ
from .mel import LogMelSpectrogram

# Upstream ConvNeXtEncoder constants: stem kernel (fixed, independent of the block kernel) and LayerNorm eps.
STEM_KERNEL_SIZE = 7
BACKBONE_NORM_EPS = 1e-6


class ChannelsFirstLayerNorm(nn.Module):
    """LayerNorm over dim 1 of (B, C, T), written out as upstream does: (x − μ)/√(σ² + eps)·w + b."""

    def __init__(self, dim: int, eps: float = BACKBONE_NORM_EPS) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, C, T)
        mean = x.mean(1, keepdim=True)
        var = (x - mean).pow(2).mean(1, keepdim=True)
        x = (x - mean) / torch.sqrt(var + self.eps)
        return self.weight[:, None] * x + self.bias[:, None]


class ConvNeXtEncoder(nn.Module):
    """Mel (B, n_mels, T) → features (B, dims[-1], T); every op keeps the frame rate."""

    def __init__(self, cfg: BackboneConfig) -> None:
        super().__init__()
        dims = cfg.dims
        stem = nn.ModuleList(
            [CausalConv1d(cfg.input_channels, dims[0], STEM_KERNEL_SIZE), ChannelsFirstLayerNorm(dims[0])]
        )
        mids = [
            nn.ModuleList([ChannelsFirstLayerNorm(dims[i]), nn.Conv1d(dims[i], dims[i + 1], kernel_size=1)])
            for i in range(len(dims) - 1)
        ]
        self.downsample_layers = nn.ModuleList([stem, *mids])
        self.stages = nn.ModuleList(
            nn.ModuleList(ConvNeXtBlock(dim, cfg.kernel_size) for _ in range(depth))
            for dim, depth in zip(dims, cfg.depths, strict=True)
        )
        self.norm = ChannelsFirstLayerNorm(dims[-1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, n_mels, T)
        for down, stage in zip(self.downsample_layers, self.stages, strict=True):
            for layer in cast(nn.ModuleList, down):
                x = layer(x)
            for block in cast(nn.ModuleList, stage):
                x = block(x)
        return self.norm(x)  # (B, D, T)


def build_downsample(cfg: QuantizerConfig) -> nn.ModuleList:
    """Stages [strided causal conv (k = s = factor, right-padded to a whole stride), ConvNeXtBlock]."""
    dims = cfg.all_dims
    return nn.ModuleList(
        nn.ModuleList([CausalConv1d(dims[i], dims[i + 1], factor, stride=factor), ConvNeXtBlock(dims[i + 1])])
        for i, factor in enumerate(cfg.downsample_factor)
    )


@dataclass(frozen=True, slots=True)
class EncodeTrace:
    """Every intermediate of one encode call (shapes for B inputs of N samples, F = N // hop)."""

    mel: torch.Tensor  # (B, n_mels, F) fp32
    backbone_features: torch.Tensor  # (B, D, F)
    downsampled: torch.Tensor  # (B, D, ⌈F/4⌉)
    project_in_out: torch.Tensor  # (B, ⌈F/4⌉, G·C) continuous values before bound/round
    codes: torch.Tensor  # (B, rows, ⌈F/4⌉) int64


def run_encoder(
    audio: torch.Tensor,
    spec_transform: LogMelSpectrogram,
    backbone: ConvNeXtEncoder,
    downsample: nn.ModuleList,
    fsq: GroupedResidualFSQ,
    dtype: torch.dtype,
) -> EncodeTrace:
    """Audio (B, N) float at the codec rate → codes, exactly as upstream `FireflyArchitecture.encode`.

    Upstream multiplies mel and features by a length mask; with one shared length N it is all ones.
    """
    if not torch.is_floating_point(audio):
        raise ValueError(f"audio must be a float tensor in [-1, 1], got {audio.dtype}")
    mel = spec_transform(audio)  # (B, n_mels, F) fp32
    if mel.shape[-1] == 0:
        raise ValueError("audio is shorter than one mel frame")
    feats = backbone(mel.to(dtype))  # (B, D, F)
    z = feats
    for stage in downsample:
        for layer in cast(nn.ModuleList, stage):
            z = layer(z)
    pre = fsq.project_in(z.transpose(1, 2))  # (B, F', G·C)
    codes = fsq.quantize(pre)
    return EncodeTrace(mel=mel, backbone_features=feats, downsampled=z, project_in_out=pre, codes=codes)

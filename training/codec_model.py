"""Training-mode firefly codec: fishgate's own `FireflyCodec` modules with weight norm and straight-through FSQ.

The inference codec stores folded conv weights and quantizes with a gradient-free `round`. Here the same module tree
(`model.vocoder.FireflyCodec(with_encoder=True)`) gets torch weight-norm parametrizations on every conv upstream
weight-normalises (so `state_dict()` has upstream's `.parametrizations.weight.original0/1` keys, which
`model.codec_checkpoint.load_codec` folds), and the FSQ is re-run with straight-through rounding. The codes it
returns equal `FireflyCodec.encode`'s for the same weights (tested). Knows nothing about losses or optimizers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
from torch import nn
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import weight_norm

from model.codec_checkpoint import is_encoder_key
from model.codec_config import CodecConfig
from model.codec_layers import CausalLayer, ConvNeXtBlock
from model.fsq import GroupedResidualFSQ
from model.vocoder import FireflyCodec

# HiFiGAN's init for its convs (normal, std 0.01); weight norm then starts with g = ‖v‖.
HEAD_INIT_STD = 0.01
# ConvNeXt layer scale at init. Upstream trains from 1e-6 over days; a minutes-long run wants the blocks active sooner.
LAYER_SCALE_INIT = 0.1
# Gain on FSQ project_in's default init. With it the bounded pre-quantization values spread over several levels at
# the start (std ≈ 1 on speech); without it they sit within ±0.5 and round to one code: the first H200 run used
# 1–2 % of the codes after 1,400 steps (measured: project_in output std 0.17 at init on teacher audio).
PROJECT_IN_INIT_GAIN = 6.0


@dataclass
class CodecForward:
    audio: torch.Tensor  # (B, N') reconstruction, N' = frames · samples_per_frame
    codes: torch.Tensor  # (B, rows, frames) int64, exactly what inference encoding gives
    mel: torch.Tensor  # (B, n_mels, F) the encoder's input (fp32)


def quantize_ste(fsq: GroupedResidualFSQ, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FSQ of project_in outputs z (B, T, G·C) with straight-through rounding.

    Returns values (B, G, T, C) — the summed residual stage values the decoder's project_out reads — and codes
    (B, rows, T). The arithmetic is `GroupedResidualFSQ.quantize`'s (bound once, then bound-and-round per stage).
    """
    bsz, length, _ = z.shape
    z = z.float().view(bsz, length, fsq.n_groups, -1)  # (B, T, G, C)
    residual = fsq.bound(z)
    total = torch.zeros_like(residual)
    indices = []
    for r in range(fsq.n_codebooks):
        scale = fsq.scales[r]
        bounded = fsq.bound(residual / scale)
        level = bounded + (bounded.round() - bounded).detach()  # round forward, identity backward
        value = level / fsq.half_width * scale
        residual = residual - value.detach()  # as vector_quantize_pytorch: the residual does not backpropagate
        total = total + value
        indices.append(((level.detach() + fsq.half_width) * fsq.basis).sum(dim=-1).to(torch.int64))  # (B, T, G)
    codes = torch.stack(indices, dim=-1).reshape(bsz, length, -1).transpose(1, 2)  # (B, G·R, T)
    return total.permute(0, 2, 1, 3), codes


def project_out(fsq: GroupedResidualFSQ, values: torch.Tensor) -> torch.Tensor:
    """values (B, G, T, C) → decoder features (B, D, T), as `GroupedResidualFSQ.decode` does after the digits."""
    outs = [rvq.project_out(values[:, g]) for g, rvq in enumerate(fsq.groups())]
    return torch.cat(outs, dim=-1).transpose(1, 2)


class TrainableCodec(nn.Module):
    """Encoder + FSQ (straight-through) + decoder of one `FireflyCodec`, trainable end to end."""

    def __init__(self, config: CodecConfig, seed: int | None = None) -> None:
        super().__init__()
        if seed is not None:
            torch.manual_seed(seed)
        self.config = config
        self.codec = FireflyCodec(config, with_encoder=True)
        self.codec.init_buffers("cpu")
        self._init_weights()
        for conv in self.weight_normed_convs():
            weight_norm(conv, name="weight", dim=0)

    def weight_normed_convs(self) -> list[nn.Conv1d | nn.ConvTranspose1d]:
        """The inner convs upstream wraps in weight norm (HiFiGAN head: conv_pre, ups, resblocks, conv_post)."""
        layers = [m for m in self.codec.modules() if isinstance(m, CausalLayer) and m.weight_normed]
        return [cast(nn.Conv1d | nn.ConvTranspose1d, layer.conv) for layer in layers]

    @torch.no_grad()
    def _init_weights(self) -> None:
        for conv in self.weight_normed_convs():
            conv.weight.normal_(0.0, HEAD_INIT_STD)
            if conv.bias is not None:
                conv.bias.zero_()
        for m in self.codec.modules():
            if isinstance(m, ConvNeXtBlock):
                m.gamma.fill_(LAYER_SCALE_INIT)
        for rvq in self.codec.quantizer.residual_fsq.groups():
            if isinstance(rvq.project_in, nn.Linear):
                rvq.project_in.weight.mul_(PROJECT_IN_INIT_GAIN)

    def encoder_parameters(self) -> list[nn.Parameter]:
        """Backbone, quantizer downsample and FSQ project_in: everything that decides the codes."""
        return [p for n, p in self.codec.named_parameters() if is_encoder_key(n)]

    def encoder_parameters_require_grad(self, flag: bool) -> None:
        for p in self.encoder_parameters():
            p.requires_grad_(flag)

    @property
    def fsq(self) -> GroupedResidualFSQ:
        return self.codec.quantizer.residual_fsq

    def encode_values(self, audio: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Audio (B, N) → (FSQ values (B, G, T, C), codes (B, rows, T), mel (B, n_mels, F))."""
        codec = self.codec
        assert codec.spec_transform is not None and codec.backbone is not None
        assert codec.quantizer.downsample is not None
        with torch.autocast(audio.device.type, enabled=False):
            mel = codec.spec_transform(audio.float())  # (B, n_mels, F) fp32
        z = codec.backbone(mel)
        for stage in codec.quantizer.downsample:
            for layer in cast(nn.ModuleList, stage):
                z = layer(z)
        pre = self.fsq.project_in(z.transpose(1, 2))  # (B, T, G·C)
        values, codes = quantize_ste(self.fsq, pre)
        return values, codes, mel

    def decode_values(self, values: torch.Tensor) -> torch.Tensor:
        """FSQ values (B, G, T, C) → audio (B, T·samples_per_frame)."""
        feats = project_out(self.fsq, values)
        return self.codec.head(self.codec.quantizer.upsample_features(feats))[:, 0]

    def forward(self, audio: torch.Tensor) -> CodecForward:
        frozen = not any(p.requires_grad for p in self.encoder_parameters())
        with torch.set_grad_enabled(torch.is_grad_enabled() and not frozen):
            values, codes, mel = self.encode_values(audio)
        return CodecForward(self.decode_values(values), codes, mel)

    def inference_state_dict(self) -> dict[str, torch.Tensor]:
        """The generator state in upstream's layout (weight-norm pairs), detached, on the CPU."""
        return {k: v.detach().cpu().contiguous() for k, v in self.codec.state_dict().items()}

    def load_inference_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.codec.load_state_dict({k: v.float() for k, v in state.items()}, strict=True)


def is_parametrized(codec: TrainableCodec) -> bool:
    """True when every weight-normed conv carries its parametrization (sanity check for checkpoints)."""
    return all(parametrize.is_parametrized(conv) for conv in codec.weight_normed_convs())

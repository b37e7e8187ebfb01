"""The firefly-gan-vq codec module: codes → audio (FSQ decode → quantizer.upsample → HiFiGAN head) and back.

Owns the HiFiGAN head (`head.*`), the quantizer container (`quantizer.residual_fsq/upsample/downsample`) and
`FireflyCodec`, whose parameter names equal upstream's state_dict with weight norm folded (`<conv>.conv.weight`).
Every decode-path layer is causal and takes an optional `LeftContext`, so `vocoder_stream` reuses this exact code
for chunked decoding. Loading weights from disk lives in codec_checkpoint; the encoder flow in codec_encoder.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from . import codec_layers
from .codec_config import CodecConfig, HeadConfig, QuantizerConfig
from .codec_encoder import ConvNeXtEncoder, EncodeTrace, build_downsample, run_encoder
from .codec_layers import CausalConv1d, CausalConvTranspose1d, CausalLayer, ConvNeXtBlock, LeftContext, is_time_minor
from .fsq import GroupedResidualFSQ
from .mel import LogMelSpectrogram


class ResBlock1(nn.Module):
    """For each dilation d: x += conv2_d(silu(conv1_d(silu(x)))) — both convs dilated (unlike classic HiFiGAN)."""

    def __init__(self, channels: int, kernel_size: int, dilations: tuple[int, ...]) -> None:
        super().__init__()

        def conv(d: int) -> CausalConv1d:
            return CausalConv1d(channels, channels, kernel_size, dilation=d, weight_normed=True)

        self.convs1 = nn.ModuleList(conv(d) for d in dilations)
        self.convs2 = nn.ModuleList(conv(d) for d in dilations)

    def forward(self, x: torch.Tensor, ctx: LeftContext | None = None) -> torch.Tensor:  # (B, C, T)
        fused = codec_layers.fuse_bias(x)  # the biases folded into the join and the residual add (same values)
        for c1, c2 in zip(self.convs1, self.convs2, strict=True):
            if fused:
                first, second = cast(CausalConv1d, c1), cast(CausalConv1d, c2)
                y = first(x, ctx, silu_first=True, defer_bias=True)
                y = second(y, ctx, silu_first=True, in_bias=first.conv.bias, defer_bias=True)
                x = codec_layers.add_bias_residual(x, y, second.conv.bias)
            else:
                x = x + c2(c1(x, ctx, silu_first=True), ctx, silu_first=True)
        return x


class ParallelBlock(nn.Module):
    """Mean of ResBlock1s with different kernel sizes (stack-then-mean, as upstream)."""

    def __init__(self, channels: int, kernel_sizes: tuple[int, ...], dilations: tuple[tuple[int, ...], ...]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(ResBlock1(channels, k, d) for k, d in zip(kernel_sizes, dilations, strict=True))

    def forward(self, x: torch.Tensor, ctx: LeftContext | None = None) -> torch.Tensor:
        outs = [block(x, ctx) for block in self.blocks]
        if is_time_minor(x):  # the same mean over (B, T, C) views, so the result keeps the channels-last layout
            return torch.stack([o.transpose(1, 2) for o in outs], dim=0).mean(dim=0).transpose(1, 2)
        return torch.stack(outs, dim=0).mean(dim=0)


class HiFiGANHead(nn.Module):
    """Features (B, num_mels, T) at the mel rate → waveform (B, 1, T·hop) in (−1, 1)."""

    def __init__(self, cfg: HeadConfig) -> None:
        super().__init__()
        ch = cfg.upsample_initial_channel
        self.conv_pre = CausalConv1d(cfg.num_mels, ch, cfg.pre_conv_kernel_size, weight_normed=True)
        self.ups = nn.ModuleList()
        self.resblocks = nn.ModuleList()
        for i, (rate, kernel) in enumerate(zip(cfg.upsample_rates, cfg.upsample_kernel_sizes, strict=True)):
            c_in, c_out = ch // 2**i, ch // 2 ** (i + 1)
            self.ups.append(CausalConvTranspose1d(c_in, c_out, kernel, stride=rate, weight_normed=True))
            self.resblocks.append(ParallelBlock(c_out, cfg.resblock_kernel_sizes, cfg.resblock_dilation_sizes))
        self.conv_post = CausalConv1d(c_out, 1, cfg.post_conv_kernel_size, weight_normed=True)

    def forward(self, x: torch.Tensor, ctx: LeftContext | None = None) -> torch.Tensor:
        x = self.conv_pre(x, ctx)
        for up, block in zip(self.ups, self.resblocks, strict=True):
            x = block(up(x, ctx, silu_first=True), ctx)
        return torch.tanh(self.conv_post(x, ctx, silu_first=True))


class Quantizer(nn.Module):
    """Upstream DownsampleFiniteScalarQuantize: residual_fsq + upsample (decoder) [+ downsample (encoder)]."""

    def __init__(self, cfg: QuantizerConfig, with_encoder: bool) -> None:
        super().__init__()
        dims = cfg.all_dims
        self.residual_fsq = GroupedResidualFSQ(dims[-1], cfg.levels, cfg.n_groups, cfg.n_codebooks, with_encoder)
        stages = list(enumerate(cfg.downsample_factor))[::-1]
        self.upsample = nn.ModuleList(
            nn.ModuleList([CausalConvTranspose1d(dims[i + 1], dims[i], f, stride=f), ConvNeXtBlock(dims[i])])
            for i, f in stages
        )
        self.downsample: nn.ModuleList | None = build_downsample(cfg) if with_encoder else None

    def upsample_features(self, z: torch.Tensor, ctx: LeftContext | None = None) -> torch.Tensor:
        for stage in self.upsample:
            for layer in cast(nn.ModuleList, stage):
                z = layer(z, ctx)
        return z  # (B, D, T·prod(downsample_factor))


class FireflyCodec(nn.Module):
    """firefly-gan-vq-fsq: `decode` codes (B, rows, T) → audio (B, T·samples_per_frame); `encode` the reverse.

    Build on the meta device and load with `codec_checkpoint.load_codec`. `clamped_codes` counts (on device)
    every code outside [0, codebook_size) that decode clamped; the LLM can emit up to its own codebook size.
    """

    def __init__(self, config: CodecConfig, with_encoder: bool = False) -> None:
        super().__init__()
        self.config = config
        self.with_encoder = with_encoder
        self.quantizer = Quantizer(config.quantizer, with_encoder)
        self.head = HiFiGANHead(config.head)
        self.backbone: ConvNeXtEncoder | None = None
        self.spec_transform: LogMelSpectrogram | None = None
        if with_encoder:
            st = config.spec_transform
            self.backbone = ConvNeXtEncoder(config.backbone)
            self.spec_transform = LogMelSpectrogram(
                sample_rate=st.sample_rate,
                n_fft=st.n_fft,
                win_length=st.win_length,
                hop_length=st.hop_length,
                n_mels=st.n_mels,
            )

    def init_buffers(self, device: torch.device | str | None = None) -> None:
        """(Re)create every non-persistent buffer on `device` (needed after building on the meta device)."""
        self.quantizer.residual_fsq.init_buffers(device)
        if self.spec_transform is not None:
            self.spec_transform.init_buffers(device)

    @property
    def dtype(self) -> torch.dtype:
        return self.head.conv_pre.conv.weight.dtype

    @property
    def clamped_codes(self) -> torch.Tensor:
        """int64 scalar on the codec's device; reading `.item()` syncs, so do it off the hot path."""
        return self.quantizer.residual_fsq.clamped_codes

    def _decode_path_modules(self) -> list[nn.Module]:
        """Every module codes → audio runs through after FSQ (quantizer.upsample, then the head), in a fixed order."""
        return [*self.quantizer.upsample.modules(), *self.head.modules()]

    def causal_layers(self) -> list[CausalLayer]:
        """Decode-path layers that need left context when streaming, in a fixed order."""
        return [m for m in self.decode_path_layers() if m.context_shape[1] > 0]

    def decode_path_layers(self) -> list[CausalLayer]:
        """Every causal conv layer codes → audio runs through, in module order."""
        return [m for m in self._decode_path_modules() if isinstance(m, CausalLayer)]

    # --- decode -------------------------------------------------------------------------------------------------

    def fsq_decode(self, codes: torch.Tensor) -> torch.Tensor:
        """Codes (B, rows, T) → features (B, D, T) at the code rate (upstream z_fsq)."""
        return self.quantizer.residual_fsq.decode(codes, self.dtype)

    def upsampled_features(self, codes: torch.Tensor, ctx: LeftContext | None = None) -> torch.Tensor:
        """Codes (B, rows, T) → HiFiGAN input (B, num_mels, T·downsample) at the mel rate (upstream z_upsampled)."""
        return self.quantizer.upsample_features(self.fsq_decode(codes), ctx)

    def decode_with_context(
        self, codes: torch.Tensor, ctx: LeftContext | None, channels_last: bool = False
    ) -> torch.Tensor:
        """Codes (B, rows, T) → audio (B, T·samples_per_frame); `ctx` carries streaming state (None = fresh).

        `channels_last` stores every activation time-major (channel stride 1) from the FSQ output on; with a
        context the layers keep that layout (see `StreamingDecoder(channels_last=True)`). Same values."""
        if codes.ndim != 3:
            raise ValueError(f"codes must be (batch, rows, frames), got shape {tuple(codes.shape)}")
        z = self.fsq_decode(codes)
        if channels_last:
            z = z.transpose(1, 2).contiguous().transpose(1, 2)
        return self.head(self.quantizer.upsample_features(z, ctx), ctx)[:, 0]

    def decode_path_convs(self) -> list[nn.Conv1d | nn.ConvTranspose1d]:
        """The convolutions codes → audio runs through (quantizer.upsample and the head), in module order."""
        return [m for m in self._decode_path_modules() if isinstance(m, nn.Conv1d | nn.ConvTranspose1d)]

    @torch.no_grad()
    def decode(self, codes: torch.Tensor, frame_lengths: torch.Tensor | None = None) -> torch.Tensor:
        """Codes (B, rows, T) int → audio (B, T·samples_per_frame) float in the codec dtype.

        `frame_lengths` (B,) zeroes each row's audio past its length, as upstream's masks do (the decoder is
        causal, so masking the features beforehand would not change the kept samples).
        """
        audio = self.decode_with_context(codes, None)
        if frame_lengths is not None:
            spf = self.config.samples_per_frame
            pos = torch.arange(audio.shape[-1], device=audio.device)
            audio = audio * (pos[None, :] < frame_lengths.to(audio.device)[:, None] * spf)
        return audio

    # --- encode -------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def encode_trace(self, audio: torch.Tensor) -> EncodeTrace:
        """Audio (B, N) mono float at `config.sample_rate` → codes plus every intermediate tensor."""
        if self.backbone is None or self.spec_transform is None or self.quantizer.downsample is None:
            raise RuntimeError("this codec was loaded without its encoder; load it with with_encoder=True")
        if audio.ndim != 2:
            raise ValueError(f"audio must be (batch, samples), got shape {tuple(audio.shape)}")
        return run_encoder(
            audio.to(self.head.conv_pre.conv.weight.device),
            self.spec_transform,
            self.backbone,
            self.quantizer.downsample,
            self.quantizer.residual_fsq,
            self.dtype,
        )

    def encode(self, audio: torch.Tensor) -> torch.Tensor:
        """Audio (B, N) mono float at 44.1 kHz → codes (B, rows, ⌈(N // hop) / downsample⌉) int64."""
        return self.encode_trace(audio).codes

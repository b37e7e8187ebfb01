"""Shared helpers for the codec tests: cached fixture codecs, a small random codec, chunked decoding, threads.

The 2-vCPU test machines lose ~20× on tiny conv kernels to OpenMP wake-ups between two threads, so the codec
tests run single-threaded (`one_thread`); results are compared with tolerances, never bitwise, so the thread
count does not change what they check.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from functools import cache
from pathlib import Path

import pytest
import torch

from model.codec_checkpoint import load_codec
from model.codec_config import BackboneConfig, CodecConfig, HeadConfig, QuantizerConfig, SpecTransformConfig
from model.vocoder import FireflyCodec
from model.vocoder_stream import StreamingDecoder


@pytest.fixture
def one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@cache
def fixture_codec(path: Path, with_encoder: bool = False) -> FireflyCodec:
    """The fixture folder's codec, loaded once per test session (fp32, CPU)."""
    return load_codec(path, with_encoder=with_encoder)


def small_config() -> CodecConfig:
    """A random-weight codec with the real structure but hop 32 (128 samples per code frame), so long runs are cheap.

    2 groups × 2 residual stages (4 code rows) exercise the residual FSQ; kernels 4 / stride 2 keep one frame of
    transposed-conv history per stage.
    """
    return CodecConfig(
        spec_transform=SpecTransformConfig(n_mels=8, hop_length=32),
        backbone=BackboneConfig(input_channels=8, depths=(1,), dims=(16,)),
        head=HeadConfig(
            hop_length=32,
            upsample_rates=(2, 2, 2, 2, 2),
            upsample_kernel_sizes=(4, 4, 4, 4, 4),
            num_mels=16,
            upsample_initial_channel=32,
        ),
        quantizer=QuantizerConfig(input_dim=16, n_groups=2, n_codebooks=2),
    )


@cache
def small_codec(seed: int = 0) -> FireflyCodec:
    torch.manual_seed(seed)
    codec = FireflyCodec(small_config()).eval().requires_grad_(False)
    with torch.no_grad():  # make the waveform clearly non-zero so comparisons are meaningful
        codec.head.conv_post.conv.weight.mul_(20.0)
    return codec


def decode_chunked(
    stream: StreamingDecoder, codes: torch.Tensor, slots: torch.Tensor, schedule: Sequence[int]
) -> torch.Tensor:
    """Feed `codes` (B, rows, T) in chunks of the given sizes (cycled until T frames are consumed)."""
    outs, pos, i = [], 0, 0
    total = codes.shape[-1]
    while pos < total:
        n = min(schedule[i % len(schedule)], total - pos)
        outs.append(stream.decode(codes[:, :, pos : pos + n], slots))
        pos, i = pos + n, i + 1
    return torch.cat(outs, dim=-1)

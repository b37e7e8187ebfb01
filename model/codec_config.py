"""Configuration of the firefly-gan-vq codec (upstream `firefly_gan_vq.yaml`) as a frozen dataclass tree.

Owns the field names and defaults of the four config sections (spec_transform, backbone, head, quantizer), the
official values, parsing of the fixture/upstream JSON layout, consistency checks and derived rates. It knows
nothing about modules or weights.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any

# Upstream yaml keys that name a class to instantiate; they carry no configuration.
IGNORED_KEYS = frozenset({"_target_"})


@dataclass(frozen=True, slots=True)
class SpecTransformConfig:
    sample_rate: int = 44100
    n_mels: int = 160
    n_fft: int = 2048
    hop_length: int = 512
    win_length: int = 2048


@dataclass(frozen=True, slots=True)
class BackboneConfig:
    input_channels: int = 160  # = spec_transform.n_mels
    depths: tuple[int, ...] = (3, 3, 9, 3)
    dims: tuple[int, ...] = (128, 256, 384, 512)
    drop_path_rate: float = 0.2  # training only; kept so configs round-trip
    kernel_size: int = 7  # depthwise kernel of the ConvNeXt blocks (the stem conv is always 7)


@dataclass(frozen=True, slots=True)
class HeadConfig:
    hop_length: int = 512
    upsample_rates: tuple[int, ...] = (8, 8, 2, 2, 2)
    upsample_kernel_sizes: tuple[int, ...] = (16, 16, 4, 4, 4)
    resblock_kernel_sizes: tuple[int, ...] = (3, 7, 11)
    resblock_dilation_sizes: tuple[tuple[int, ...], ...] = ((1, 3, 5), (1, 3, 5), (1, 3, 5))
    num_mels: int = 512  # input channels of the head = quantizer.input_dim
    upsample_initial_channel: int = 512
    pre_conv_kernel_size: int = 13
    post_conv_kernel_size: int = 13


@dataclass(frozen=True, slots=True)
class QuantizerConfig:
    input_dim: int = 512
    n_groups: int = 8
    n_codebooks: int = 1  # residual FSQ stages per group
    levels: tuple[int, ...] = (8, 5, 5, 5)
    downsample_factor: tuple[int, ...] = (2, 2)
    downsample_dims: tuple[int, ...] | None = None  # None: every stage keeps input_dim (upstream default)

    @property
    def all_dims(self) -> tuple[int, ...]:
        """Channel count before the first downsample stage and after each one."""
        dims = self.downsample_dims or tuple(self.input_dim for _ in self.downsample_factor)
        return (self.input_dim, *dims)


def _section(cls: type, d: dict[str, Any], where: str) -> Any:
    names = {f.name for f in fields(cls)}
    unknown = sorted(set(d) - names - IGNORED_KEYS)
    if unknown:
        raise ValueError(f"codec config section {where!r} has unknown fields {unknown}; known: {sorted(names)}")
    kwargs: dict[str, Any] = {}
    for k, v in d.items():
        if k in IGNORED_KEYS:
            continue
        kwargs[k] = tuple(tuple(x) if isinstance(x, list) else x for x in v) if isinstance(v, list) else v
    return cls(**kwargs)


@dataclass(frozen=True, slots=True)
class CodecConfig:
    spec_transform: SpecTransformConfig = SpecTransformConfig()
    backbone: BackboneConfig = BackboneConfig()
    head: HeadConfig = HeadConfig()
    quantizer: QuantizerConfig = QuantizerConfig()

    def __post_init__(self) -> None:
        self.validate()

    @classmethod
    def official(cls) -> CodecConfig:
        """The values of upstream `firefly_gan_vq.yaml` (the dataclass defaults)."""
        return cls()

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CodecConfig:
        """Parse the fixture / upstream-yaml layout: {spec_transform, backbone, head, quantizer}."""
        sections = {"spec_transform": SpecTransformConfig, "backbone": BackboneConfig, "head": HeadConfig}
        sections["quantizer"] = QuantizerConfig
        unknown = sorted(set(d) - set(sections) - IGNORED_KEYS)
        if unknown:
            raise ValueError(f"codec config has unknown sections {unknown}; expected {sorted(sections)}")
        missing = sorted(set(sections) - set(d))
        if missing:
            raise ValueError(f"codec config lacks sections {missing}")
        return cls(**{name: _section(sc, d[name], name) for name, sc in sections.items()})

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def validate(self) -> None:
        st, bb, hd, q = self.spec_transform, self.backbone, self.head, self.quantizer
        problems = []
        if math.prod(hd.upsample_rates) != hd.hop_length or hd.hop_length != st.hop_length:
            problems.append(
                f"prod(head.upsample_rates)={math.prod(hd.upsample_rates)} must equal head.hop_length="
                f"{hd.hop_length} and spec_transform.hop_length={st.hop_length}"
            )
        if len(hd.upsample_rates) != len(hd.upsample_kernel_sizes):
            problems.append("head.upsample_rates and head.upsample_kernel_sizes differ in length")
        if len(hd.resblock_kernel_sizes) != len(hd.resblock_dilation_sizes):
            problems.append("head.resblock_kernel_sizes and head.resblock_dilation_sizes differ in length")
        if hd.upsample_initial_channel // 2 ** len(hd.upsample_rates) < 1:  # stage i has initial // 2**(i+1)
            problems.append("head.upsample_initial_channel is too small for the number of upsample stages")
        if hd.num_mels != q.input_dim:
            problems.append(f"head.num_mels={hd.num_mels} must equal quantizer.input_dim={q.input_dim}")
        if q.all_dims[-1] % q.n_groups:
            problems.append(f"quantized dim {q.all_dims[-1]} is not divisible by quantizer.n_groups={q.n_groups}")
        if len(q.all_dims) != len(q.downsample_factor) + 1:
            problems.append("quantizer.downsample_dims must have one entry per downsample_factor")
        if len(bb.depths) != len(bb.dims):
            problems.append("backbone.depths and backbone.dims differ in length")
        if bb.input_channels != st.n_mels:
            problems.append(f"backbone.input_channels={bb.input_channels} must equal n_mels={st.n_mels}")
        if bb.dims and bb.dims[-1] != q.input_dim:
            problems.append(f"backbone.dims[-1]={bb.dims[-1]} must equal quantizer.input_dim={q.input_dim}")
        if problems:
            raise ValueError("inconsistent codec config: " + "; ".join(problems))

    # --- derived quantities -------------------------------------------------------------------------------------

    @property
    def sample_rate(self) -> int:
        return self.spec_transform.sample_rate

    @property
    def downsample_total(self) -> int:
        """Mel frames per code frame."""
        return math.prod(self.quantizer.downsample_factor)

    @property
    def samples_per_frame(self) -> int:
        """Audio samples per code frame (2048 for the official codec)."""
        return self.spec_transform.hop_length * self.downsample_total

    @property
    def frame_rate_hz(self) -> float:
        return self.sample_rate / self.samples_per_frame

    @property
    def rows(self) -> int:
        """Code rows per frame, ordered group-major: row = group * n_codebooks + stage."""
        return self.quantizer.n_groups * self.quantizer.n_codebooks

    @property
    def codebook_size(self) -> int:
        """Number of valid codes per row (prod(levels) = 1000 for the official codec)."""
        return math.prod(self.quantizer.levels)

"""Stateful, batched, causal streaming decoder for the firefly codec: many independent slots (sessions).

Owns one preallocated state buffer `(max_slots, state_numel)` holding, per slot, every causal layer's last inputs
(each conv's `(k−1)·d` steps, each transposed conv's `⌈k/s⌉−1` frames) at fixed offsets. A call gathers the rows
of its slots, runs the codec's own decode code with those rows as left context, and scatters the new rows back,
so concatenated chunks equal one offline decode. Shapes depend only on (B, F); there are no host syncs or
data-dependent branches, so a call can be captured in a CUDA graph. It knows nothing about sessions or queues.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import vocoder_kernels
from .codec_layers import cat_time
from .compiled_regions import region
from .vocoder import FireflyCodec

# How a streaming chunk joins a silu-first conv's history with silu(x) (`_SlotContext.extend`):
#   "cat"    silu, then cat: two passes over the activation (the cats were 19 of 80 ms at 64 × 24 frames, H200);
#   "out"    silu written into the joined buffer (`silu.out`): one pass, but ATen's generic strided kernel;
#   "triton" model.vocoder_kernels.join_silu: one pass at full width, any strides;
#   "auto"   triton on CUDA where Triton runs (vocoder_kernels.supported), else out; cat on CPU, where a strided
#            `out=` takes ATen's scalar silu (it rounds differently from the vectorised one, ~3e-8) and a 24-frame
#            chunk of the default voice took 31 ms either way.
# Compiled (torch.compile) chunks always take "cat": inductor fuses it into one kernel (and refuses strided `out=`).
SILU_JOIN = "auto"


def _silu_join(x: torch.Tensor) -> str:
    if SILU_JOIN != "auto":
        return SILU_JOIN
    if x.device.type != "cuda":
        return "cat"
    return "triton" if vocoder_kernels.supported(x.device) else "out"


class _SlotContext:
    """LeftContext for one call: slices of the gathered state rows in, newest layer inputs out."""

    def __init__(
        self,
        layout: dict[int, tuple[int, int, int]],
        prev: torch.Tensor,
        channels_last: bool,
    ) -> None:
        self._layout = layout
        self._prev = prev  # (B, state_numel)
        self._channels_last = channels_last  # each layer's history stored (W, C) instead of (C, W)
        self._new: dict[int, torch.Tensor] = {}

    def extend(
        self, layer: nn.Module, x: torch.Tensor, silu: bool = False, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        offset, channels, width = self._layout[id(layer)]
        rows = self._prev[:, offset : offset + channels * width]
        if self._channels_last:
            prev = rows.view(-1, width, channels).transpose(1, 2)  # (B, C, W), channel stride 1
        else:
            prev = rows.view(-1, channels, width)  # (B, C, W)
        join = _silu_join(x) if silu and not torch.compiler.is_compiling() else "cat"
        if bias is not None and join != "triton":  # a deferred bias (codec_layers.FUSE_BIAS) where no kernel folds it
            x = x + bias[:, None]
            bias = None
        if join == "triton":  # one pass at full width (model.vocoder_kernels), in the decoder's layout
            xin = vocoder_kernels.join_silu(prev, x, time_major=self._channels_last, bias=bias)
        elif join == "out" and not self._channels_last:  # one pass, but ATen's generic kernel for the strided output
            xin = x.new_empty(x.shape[0], channels, width + x.shape[-1])
            xin[..., :width].copy_(prev)
            torch.ops.aten.silu.out(x, out=xin[..., width:])
        else:
            xin = cat_time(prev, F.silu(x) if silu else x)  # (B, C, W + T), in x's layout
        self._new[id(layer)] = xin[..., -width:]
        return xin

    def new_state(self) -> torch.Tensor:
        """The next state rows (B, state_numel), in layout order."""
        missing = [k for k in self._layout if k not in self._new]
        if missing:
            raise RuntimeError(f"{len(missing)} causal layers were not run in this decode call")
        bsz = self._prev.shape[0]
        if self._channels_last:
            return torch.cat([self._new[k].transpose(1, 2).reshape(bsz, -1) for k in self._layout], dim=1)
        return torch.cat([self._new[k].reshape(bsz, -1) for k in self._layout], dim=1)


class StreamingDecoder:
    """Chunked decode for up to `max_slots` independent streams sharing one codec.

    `decode(codes (B, rows, F), slots (B,))` returns `(B, F·samples_per_frame)` audio that continues each slot's
    previous chunks exactly; `reset(slots)` starts those slots afresh (zero history = a new utterance). Slots in one
    call must be distinct. State lives on the codec's device in its dtype (run without autocast). The decoder is
    bound to this codec object: its layers are found by identity, so build a new decoder for a copied codec.

    `channels_last=True` keeps every activation and the carried state time-major (channel stride 1) and stores the
    decode-path conv weights of `codec` that way too (in place; values unchanged), the layout in which cuDNN runs
    bf16 convolutions on tensor cores. The audio equals the default layout's to float rounding.
    """

    def __init__(
        self,
        codec: FireflyCodec,
        max_slots: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        channels_last: bool = False,
    ) -> None:
        if max_slots < 1:
            raise ValueError(f"max_slots must be at least 1, got {max_slots}")
        weight = codec.head.conv_pre.conv.weight
        self.device = weight.device
        self.dtype = weight.dtype
        wanted = torch.device(device) if device is not None else weight.device
        same_device = wanted.type == weight.device.type and wanted.index in (None, weight.device.index)
        if not same_device or (dtype is not None and dtype != weight.dtype):
            raise ValueError(
                f"streaming state ({wanted}, {dtype}) must match the codec ({weight.device}, "
                f"{weight.dtype}); load the codec with that device and dtype"
            )
        self.codec = codec
        self.channels_last = channels_last
        if channels_last:  # weights stored (out, k, in) in memory, values unchanged: cuDNN's NHWC kernels read them
            for conv in codec.decode_path_convs():
                conv.weight.data = conv.weight.data.transpose(1, 2).contiguous().transpose(1, 2)
            for layer in codec.decode_path_layers():
                layer.time_minor = True
        self.max_slots = max_slots
        self.samples_per_frame = codec.config.samples_per_frame
        self._layout: dict[int, tuple[int, int, int]] = {}
        offset = 0
        for layer in codec.causal_layers():
            channels, width = layer.context_shape
            self._layout[id(layer)] = (offset, channels, width)
            offset += channels * width
        self.state_numel = offset
        self.state = torch.zeros(max_slots, offset, device=self.device, dtype=self.dtype)

    @property
    def state_bytes_per_slot(self) -> int:
        return self.state_numel * self.state.element_size()

    def reset(self, slots: torch.Tensor) -> None:
        """Forget the history of `slots` (LongTensor (B,) on the state's device); in place, no sync."""
        self.state.index_fill_(0, slots, 0)

    @torch.no_grad()
    def decode(self, codes: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Codes (B, rows, F) int + slots (B,) LongTensor → audio (B, F·samples_per_frame); updates state in place."""
        if codes.ndim != 3 or slots.ndim != 1 or slots.shape[0] != codes.shape[0]:
            raise ValueError(
                f"need codes (B, rows, F) and slots (B,), got {tuple(codes.shape)} and {tuple(slots.shape)}"
            )
        return _decode_chunk(self, codes, slots)


@region(dynamic_dims={1: (0, 2), 2: (0,)})  # batch and frames symbolic: one compilation for every graph shape
def _decode_chunk(decoder: StreamingDecoder, codes: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """One chunk for the given slots: gather their state rows, decode with them as left context, scatter the new
    rows back. A compiled region: inside `compiled(backend)` (model.compiled_regions) it runs through torch.compile,
    with batch and frames as symbolic sizes, so the engine's 7 batch buckets × 6 chunk sizes cost a few compilations
    (sizes 1 are specialised), not 42 of ~35 s each (measured on the H200 with static shapes)."""
    prev = decoder.state.index_select(0, slots)  # (B, state_numel)
    ctx = _SlotContext(decoder._layout, prev, decoder.channels_last)
    audio = decoder.codec.decode_with_context(codes, ctx, decoder.channels_last)  # (B, F·spf)
    decoder.state.index_copy_(0, slots, ctx.new_state())
    return audio

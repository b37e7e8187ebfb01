"""Causal convolution layers of the firefly codec, usable offline (zero left padding) or with carried state.

Owns `CausalConv1d` (upstream FishConvNet), `CausalConvTranspose1d` (FishTransConvNet), `ConvNeXtBlock` and the
`LeftContext` seam: a layer given a context takes its left input history from it instead of zeros and hands back
its newest inputs, so chunked decoding equals offline decoding. Parameter names match upstream (`<m>.conv.weight`);
weight norm is folded before loading (see codec_checkpoint). Slots, buffers and batching live in vocoder_stream.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from . import vocoder_kernels

# ConvNeXt block constants from upstream (LayerNorm eps, MLP expansion ratio).
CONVNEXT_NORM_EPS = 1e-6
CONVNEXT_MLP_RATIO = 4


def is_time_minor(x: torch.Tensor) -> bool:
    """True when (B, C, T) is stored channels-last (time-major memory, channel stride 1): the layout in which cuDNN
    runs bf16 convolutions on tensor cores without transposing. A streaming decoder may keep this layout end to end."""
    return x.ndim == 3 and x.shape[1] > 1 and x.stride(1) == 1


def as_time_minor(x: torch.Tensor) -> torch.Tensor:
    """x itself when it is stored time-major already, else a time-major copy (same values)."""
    if is_time_minor(x) or x.shape[1] == 1:
        return x
    return x.transpose(1, 2).contiguous().transpose(1, 2)


def cat_time(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`cat([a, b], dim=-1)` for (B, C, T) tensors that keeps a channels-last layout (plain cat returns NCL)."""
    if is_time_minor(b):
        return torch.cat([a.transpose(1, 2), b.transpose(1, 2)], dim=1).transpose(1, 2)
    return torch.cat([a, b], dim=-1)


# How a decode-path conv adds its bias: "aten" (inside F.conv1d: cuDNN's output, then ATen's broadcast add, which
# runs its generic elementwise kernel), "triton" (model.vocoder_kernels.add_channel_bias_ at full width, in place, in
# either layout; inference only — no autograd — and not under torch.compile) or "auto": triton where it runs (CUDA
# with Triton, Volta or newer), else aten. On an H200: 60.2 → 52.3 ms at 64 × 24 frames, 2.43 → 2.31 ms at
# 1 × 8 (default layout; 223 generic elementwise kernels, 14.6 ms, were mostly these adds).
BIAS_ADD = "auto"


def _triton_bias(x: torch.Tensor) -> bool:
    return (
        BIAS_ADD in ("triton", "auto")
        and not torch.is_grad_enabled()
        and not torch.compiler.is_compiling()
        and vocoder_kernels.supported(x.device)
    )


# Fold a resblock's conv biases into the passes around them (model.vocoder.ResBlock1): the first conv's bias into the
# second conv's history join (silu(y + b) as it joins), the second's into the residual add (x + y + b, one kernel).
# Two fewer passes over the activation per conv pair. "on" (the default) applies where the bias kernel runs
# (`_triton_bias`). On an H200 (64 × 24 frames; docs/archive/benchmark-log.md): channels-last 33.1 → 29.5 ms
# untuned, 29.9 → 26.5 ms autotuned; default layout 52.2 → 50.2 ms; 1 × 8 frames −0.1 ms in each.
FUSE_BIAS = "on"


def fuse_bias(x: torch.Tensor) -> bool:
    return FUSE_BIAS == "on" and _triton_bias(x)


def add_bias_residual(x: torch.Tensor, y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`x + (y + bias)`: one Triton pass where x and y share a dense layout, else ATen's adds."""
    if bias is None:
        return x + y
    if x.stride() == y.stride() and (x.is_contiguous() or vocoder_kernels.is_dense_time_major(x)):
        return vocoder_kernels.add_bias_residual(x, y, bias)
    return x + (y + bias[:, None])


def _add_bias(y: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """A conv output (B, C, T) plus its bias: in place by the Triton kernel where the output is one dense array
    (contiguous or time-major), else ATen's add."""
    if y.is_contiguous() or vocoder_kernels.is_dense_time_major(y):
        return vocoder_kernels.add_channel_bias_(y, bias)
    return y + bias[:, None]


def _conv_time_major(
    x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, *, stride: int, dilation: int, groups: int
) -> torch.Tensor:
    """conv1d for a time-major input (B, C, T) and weight (out, in, k) stored (out, k, in), as a conv2d over
    (B, C, 1, T): those 4-D views are dense channels-last (NHWC), so cuDNN reads them as they are. conv1d decides the
    memory format on the 3-D tensors, where there is no channels-last, and copied every input to channels-first and
    then, for the channels-last weight, back (H200: 199 strided copies, 32 of 61 ms at 64 × 24 frames)."""
    y = F.conv2d(x.unsqueeze(2), w.unsqueeze(2), b, stride=(1, stride), dilation=(1, dilation), groups=groups)
    return y.squeeze(2)


# (in channels, kernel, dilation) of decode-path convs that a channels-last decoder runs channels-first, through
# transposing copies, unless cuDNN autotunes (torch.backends.cudnn.benchmark while the graphs are captured): its
# heuristic gives the channels-last (256, 7, 5) convs a grouped direct kernel, 183 of the untuned layout's 213 ms at
# 64 × 24 frames on an H200. With this set the untuned layout takes 33.1 ms (1 × 8: 1.48 ms), against 29.9 ms
# autotuned, and captures in under a second a graph instead of 5–16 s.
CHANNELS_FIRST_CONVS: frozenset[tuple[int, int, int]] = frozenset({(256, 7, 5)})


class LeftContext(Protocol):
    """Supplies a stateful layer's previous inputs and records its newest ones (implemented by vocoder_stream)."""

    def extend(
        self, layer: nn.Module, x: torch.Tensor, silu: bool = False, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Return `cat(previous inputs (B, C, W), x)` along time — `silu(x + bias)` in place of x when `silu` (bias
        optional, (C,)) — and remember its last W steps as the new state."""
        ...


class CausalLayer(nn.Module):
    """A layer whose output at step t depends on inputs up to t only; `context_shape` = (channels, history)."""

    weight_normed: bool = False  # upstream wraps the conv in weight norm (its checkpoint stores g and v)
    # set by StreamingDecoder(channels_last=True): outputs are made time-major whatever the conv kernel returned
    # (cuDNN's choice of output layout differs between CUDA and CPU and under torch.compile), and depthwise convs
    # always take the multiply-add path
    time_minor: bool = False

    @property
    def context_shape(self) -> tuple[int, int]:
        raise NotImplementedError


class CausalConv1d(CausalLayer):
    """Conv1d with left zero padding `(k-1)·d − (s−1)` and right padding only to complete a partial stride."""

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int,
        *,
        dilation: int = 1,
        stride: int = 1,
        groups: int = 1,
        weight_normed: bool = False,
    ) -> None:
        super().__init__()
        self.conv = nn.Conv1d(in_channels, out_channels, kernel_size, stride=stride, dilation=dilation, groups=groups)
        self.stride = stride
        self.dilation = dilation
        self.groups = groups
        self.span = (kernel_size - 1) * dilation + 1  # effective kernel size
        self.left_pad = self.span - stride
        self.weight_normed = weight_normed

    @property
    def context_shape(self) -> tuple[int, int]:
        if self.stride != 1:
            raise ValueError("strided convolutions (encoder only) cannot carry streaming state")
        return (self.conv.in_channels, self.left_pad)

    def forward(
        self,
        x: torch.Tensor,
        ctx: LeftContext | None = None,
        silu_first: bool = False,
        in_bias: torch.Tensor | None = None,
        defer_bias: bool = False,
    ) -> torch.Tensor:  # (B, C_in, T)
        """`silu_first`: convolve silu(x) (the context applies it while joining history and x: one pass, not two);
        `in_bias` (with silu_first): silu(x + in_bias), a previous conv's deferred bias; `defer_bias`: return the
        convolution without this conv's bias, for the caller to fold into a later pass (FUSE_BIAS)."""
        if in_bias is not None and not silu_first:
            raise ValueError("in_bias is folded into the silu of silu_first")
        if ctx is not None and self.left_pad > 0:
            x = ctx.extend(self, x, silu=silu_first, bias=in_bias)
            right = 0
        else:
            if in_bias is not None:
                x = x + in_bias[:, None]
            x = F.silu(x) if silu_first else x
            length = x.shape[-1]
            n_out = math.ceil((length - self.span + self.left_pad) / self.stride) + 1
            right = (n_out - 1) * self.stride + self.span - self.left_pad - length
            x = F.pad(x, (self.left_pad, right))
        w, b = self.conv.weight, self.conv.bias
        depthwise = self.groups > 1 and self.groups == self.conv.in_channels == self.conv.out_channels
        if depthwise and (self.time_minor or is_time_minor(x)):
            return self._depthwise_time_minor(x)
        # A channels-last decoder runs some convs channels-first, input and weight (PyTorch picks the channels-last
        # kernels when either is); as_time_minor below brings the output back. One output channel (the head's
        # conv_post, at the audio rate) too: a precaution whose effect alone is not measured (two slow 91 ms cuDNN
        # calls once blamed on it were two dilated 256-channel convs); the copies cost microseconds.
        # CHANNELS_FIRST_CONVS: shapes cuDNN's heuristic (not its autotuning) handles badly channels-last.
        shape = (self.conv.in_channels, self.conv.kernel_size[0], self.dilation)
        channels_first = self.conv.out_channels == 1 or (
            shape in CHANNELS_FIRST_CONVS and not torch.backends.cudnn.benchmark
        )
        if self.time_minor and channels_first:
            x, w = x.contiguous(), w.contiguous()
        conv = _conv_time_major if self.time_minor and not channels_first else F.conv1d
        add_after = b is not None and not defer_bias and _triton_bias(x)  # this conv's bias, by the Triton kernel
        y = conv(
            x, w, None if defer_bias or add_after else b, stride=self.stride, dilation=self.dilation, groups=self.groups
        )  # (B, C_out, T/s)
        if self.time_minor:
            y = as_time_minor(y)
        return _add_bias(y, b) if add_after and b is not None else y

    def _depthwise_time_minor(self, x: torch.Tensor) -> torch.Tensor:
        """Depthwise conv on a channels-last input as k shifted multiply-adds in fp32, output channels-last.
        cuDNN's grouped kernel for this layout took 90 ms per call at 64 × 24 frames on an H200 (the ConvNeXt
        dwconvs); these few elementwise passes are microseconds, and one fused kernel when compiled."""
        if self.stride != 1:
            raise ValueError("the channels-last depthwise path is for stride 1 (the decode path)")
        xt = x.transpose(1, 2)  # (B, L, C), contiguous in memory
        n_out = xt.shape[1] - self.span + 1
        w = self.conv.weight[:, 0, :].float()  # (C, k)
        acc = self.conv.bias.float() if self.conv.bias is not None else torch.zeros_like(w[:, 0])
        for j in range(w.shape[1]):
            acc = acc + xt[:, j * self.dilation : j * self.dilation + n_out, :].float() * w[:, j]
        return acc.to(x.dtype).transpose(1, 2)  # (B, C, T)


class CausalConvTranspose1d(CausalLayer):
    """ConvTranspose1d whose output is trimmed by `k − s` on the right, so T frames give exactly T·s samples.

    Offline, output sample t sums input frames ⌈(t−k+1)/s⌉…⌊t/s⌋; with a context the layer prepends the last
    `⌈k/s⌉ − 1` input frames and keeps only the outputs of the new frames, which reproduces the offline sums.
    """

    def __init__(
        self, in_channels: int, out_channels: int, kernel_size: int, *, stride: int, weight_normed: bool = False
    ) -> None:
        super().__init__()
        if kernel_size < stride:
            raise ValueError(f"transposed conv kernel {kernel_size} shorter than its stride {stride} leaves gaps")
        self.conv = nn.ConvTranspose1d(in_channels, out_channels, kernel_size, stride=stride)
        self.stride = stride
        self.history_frames = -(-kernel_size // stride) - 1
        self.weight_normed = weight_normed

    @property
    def context_shape(self) -> tuple[int, int]:
        return (self.conv.in_channels, self.history_frames)

    def forward(
        self, x: torch.Tensor, ctx: LeftContext | None = None, silu_first: bool = False
    ) -> torch.Tensor:  # (B, C_in, T)
        """`silu_first`: as CausalConv1d's."""
        n_new = x.shape[-1]
        skip = 0
        if ctx is not None and self.history_frames > 0:
            x = ctx.extend(self, x, silu=silu_first)
            skip = self.history_frames * self.stride
        elif silu_first:
            x = F.silu(x)
        if self.time_minor and self.conv.kernel_size[0] % self.stride == 0:
            return self._as_matmul(x, n_new)
        b = self.conv.bias
        if b is not None and _triton_bias(x):
            y = _add_bias(F.conv_transpose1d(x, self.conv.weight, None, stride=self.stride), b)
        else:
            y = F.conv_transpose1d(x, self.conv.weight, b, stride=self.stride)
        y = y[..., skip : skip + n_new * self.stride]  # (B, C_out, T·s)
        return as_time_minor(y) if self.time_minor else y

    def _as_matmul(self, x: torch.Tensor, n_new: int) -> torch.Tensor:
        """The transposed conv for kernel = m·stride as one matmul plus m − 1 shifted adds, time-major in and out:
        input frame i writes output blocks i … i+m−1 (s steps each), so block u sums the products of frames
        u, u−1, …, u−m+1. `x` holds the m − 1 history frames first (as the context prepends them); the result is the
        n_new blocks after them. On a channels-last input cuDNN ran the head's two k = 16, s = 8 upsamplers through
        its grouped direct kernel: 183 ms at 64 × 24 frames on an H200."""
        w = self.conv.weight  # (C_in, C_out, k)
        c_in, c_out, k = w.shape
        s = self.stride
        m = k // s
        z = x.transpose(1, 2) @ w.permute(0, 2, 1).reshape(c_in, k * c_out)  # (B, T', k·C_out), k = (q, r)
        z = z.view(x.shape[0], x.shape[2], m, s * c_out)
        first = x.shape[2] - n_new  # the history frames (m − 1 with a context, 0 without)
        y = z[:, first : first + n_new, 0]
        for q in range(1, m):  # frame u − q's q-th block; frames before the input are zeros (offline) or history
            lo = first - q
            part = z[:, max(lo, 0) : lo + n_new, q]
            y = y + (F.pad(part, (0, 0, n_new - part.shape[1], 0)) if lo < 0 else part)
        y = y.reshape(x.shape[0], n_new * s, c_out).transpose(1, 2)  # (B, C_out, T·s), time-major
        if self.conv.bias is None:
            return y
        if _triton_bias(x):  # y is the matmul's or the sum's own memory: the kernel may write it
            return _add_bias(y, self.conv.bias)
        return y + self.conv.bias[:, None]


class ConvNeXtBlock(nn.Module):
    """Causal depthwise conv → LayerNorm over channels → Linear(4×) → exact GELU → Linear → ·gamma → residual."""

    def __init__(self, dim: int, kernel_size: int = 7) -> None:
        super().__init__()
        self.dwconv = CausalConv1d(dim, dim, kernel_size, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=CONVNEXT_NORM_EPS)
        self.pwconv1 = nn.Linear(dim, CONVNEXT_MLP_RATIO * dim)
        self.pwconv2 = nn.Linear(CONVNEXT_MLP_RATIO * dim, dim)
        self.gamma = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, ctx: LeftContext | None = None) -> torch.Tensor:  # (B, D, T)
        h = self.dwconv(x, ctx).transpose(1, 2)  # (B, T, D)
        h = self.pwconv2(F.gelu(self.pwconv1(self.norm(h))))
        return x + (self.gamma * h).transpose(1, 2)

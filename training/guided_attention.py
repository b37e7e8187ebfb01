"""Guided attention (Tachibana et al., 2017) for the DualAR: a training-only loss that makes one attention head read
the text in order.

An early DualAR trained here (training/TRAINING.md) spoke fluent babble: it predicted codes from the codes before them
and barely read the text (the token loss changed by 0.11 nats per token under another utterance's text). Attention-based
TTS models find the text↔speech alignment slowly and, with ~20 h of speech, overfit first. This loss pushes one head of
one slow layer towards the diagonal: for frame i of N and text token j of M, the head's attention restricted to the
utterance's text is penalised by W = 1 − exp(−(j/M − i/N)² / 2σ²). Inference is untouched (the head is an ordinary head
of the official architecture; the loss only shapes what it learns), so exported checkpoints load as before.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from model.dual_ar import DualARTransformer
from model.layers import TransformerBlock
from model.rope import apply_rope

from .dual_ar_data import Example


@dataclass(frozen=True, slots=True)
class GuideConfig:
    weight: float = 0.0  # 0 = off
    layer: int = 1  # which slow layer's head is guided (layer 0 sees only token embeddings)
    head: int = 0  # which query head of that layer
    sigma: float = 0.2  # width of the allowed band around the diagonal, in fractions of the utterance (DC-TTS: 0.2)


def guide_tensors(
    examples: Sequence[Example], length: int, sigma: float, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """For the model input of `collate(examples)` (positions [0, length)): mask (B, length, length), True where a
    frame query is scored against its own utterance's text keys, and the penalty W there (0 elsewhere). Built on
    `device` from the examples' spans (a batch's (B, T, T) would be slow to build and copy from the host)."""
    most = max((len(e.spans) for e in examples), default=0)
    table = torch.zeros(len(examples), max(most, 1), 4, dtype=torch.int64)
    for b, example in enumerate(examples):
        for s, span in enumerate(example.spans):
            table[b, s] = torch.tensor(span)
    table = table.to(device)
    q = torch.arange(length, device=device).view(1, length, 1)
    k = torch.arange(length, device=device).view(1, 1, length)
    mask = torch.zeros(len(examples), length, length, dtype=torch.bool, device=device)
    weight = torch.zeros(len(examples), length, length, device=device)
    for s in range(most):
        text_start, text_end, frames_start, frames_end = (table[:, s, c].view(-1, 1, 1) for c in range(4))
        inside = (q >= frames_start) & (q < frames_end) & (k >= text_start) & (k < text_end)
        i = (q - frames_start) / (frames_end - frames_start).clamp_min(1)
        j = (k - text_start) / (text_end - text_start).clamp_min(1)
        mask |= inside
        weight = torch.where(inside, 1.0 - torch.exp(-((j - i) ** 2) / (2 * sigma**2)), weight)
    return mask, weight


def guided_loss(scores: torch.Tensor, mask: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Mean over guided frame queries of Σ_j softmax_over_text(scores)_j · W_j. scores (B, T, T) of one head."""
    rows = mask.any(-1)  # (B, T) queries with text to score
    if not bool(rows.any()):
        return scores.sum() * 0.0
    s = scores[rows].float().masked_fill(~mask[rows], -math.inf)  # (R, T)
    attention = torch.softmax(s, dim=-1)
    return (attention * weight[rows]).sum(-1).mean()


class HeadScores:
    """Records one head's pre-softmax attention scores (B, T, T) in the teacher-forced forward of a DualAR (a forward
    pre-hook on the layer's attention recomputes that head's q and k from the same inputs: one small extra matmul)."""

    def __init__(self, model: DualARTransformer, layer: int, head: int) -> None:
        block = model.layers[layer]
        assert isinstance(block, TransformerBlock)
        attention = block.attention
        if not 0 <= head < attention.n_head:
            raise ValueError(f"guided head {head} does not exist: layer {layer} has {attention.n_head} heads")
        self.scores: torch.Tensor | None = None
        self.active = False
        group = attention.n_head // attention.n_local_heads
        hd = attention.head_dim
        q_cols = slice(head * hd, (head + 1) * hd)
        kv_head = head // group
        k_cols = slice(attention.dim + kv_head * hd, attention.dim + (kv_head + 1) * hd)

        def hook(_module: Any, args: tuple[Any, ...]) -> None:
            if not self.active:
                return
            x, freqs = args[0], args[1]
            qkv = attention.wqkv(x)  # (B, T, ·)
            q = apply_rope(qkv[..., q_cols].unsqueeze(2), freqs).squeeze(2)  # (B, T, hd)
            k = apply_rope(qkv[..., k_cols].unsqueeze(2), freqs).squeeze(2)
            self.scores = (q @ k.transpose(1, 2)) * hd**-0.5

        self._handle: RemovableHandle = attention.register_forward_pre_hook(hook)

    def take(self) -> torch.Tensor:
        scores, self.scores = self.scores, None
        if scores is None:
            raise RuntimeError("no scores recorded: set active before the forward")
        return scores

    def remove(self) -> None:
        self._handle.remove()

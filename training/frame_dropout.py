"""Frame dropout for DualAR training: hide a random fraction of the previous frames from the slow stack's input.

Teacher forcing lets an autoregressive TTS model predict most of the next frame from the frames before it, so the text
earns little gradient and a small model learns to babble (here, without it: the token loss moved by 0.11 nats per token
under another utterance's text). Tacotron keeps dropout of 0.5 on its decoder's frame input (the "pre-net") for this
reason; word dropout does the same for text decoders (Bowman et al., 2016). Here each semantic frame of the slow stack's
input is replaced, with probability `p`, by a zero embedding (token and codebook rows alike: position stays in RoPE).
Text and control tokens are never dropped, the fast stack's teacher-forced codes are untouched (it reads the codes of
the frame being predicted, not the input), and the targets are unchanged. Training only: a forward pre-hook on the first
slow layer, inactive in eval mode, so the model class, its weights and inference are unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from model.dual_ar import DualARTransformer


class FrameDropout:
    """Zeroes the first slow layer's input at a random `p` of the semantic-frame positions of the armed batch."""

    def __init__(self, model: DualARTransformer, p: float) -> None:
        if not 0.0 <= p < 1.0:
            raise ValueError(f"frame dropout {p} must be in [0, 1): 1 would hide every frame")
        self.p = p
        self.model = model
        self._keep: torch.Tensor | None = None

        def hook(module: Any, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
            keep, self._keep = self._keep, None
            if keep is None or not module.training:
                return None
            x = args[0]
            return (x * keep.unsqueeze(-1).to(x.dtype), *args[1:])

        self._handle: RemovableHandle = model.layers[0].register_forward_pre_hook(hook)

    def keep_mask(self, inp: torch.Tensor) -> torch.Tensor:
        """inp (B, 1+nc, T) → (B, T) float: 0 at dropped semantic frames, 1 everywhere else."""
        tokens = inp[:, 0]
        draw = torch.rand(tokens.shape, device=tokens.device)  # torch's RNG: the trainer seeds it
        return (~(self.model.is_semantic(tokens) & (draw < self.p))).float()

    def arm(self, inp: torch.Tensor) -> None:
        """Drop frames in the next forward over `inp` (the model input, B × (1+nc) × T); a no-op when p is 0."""
        self._keep = self.keep_mask(inp) if self.p > 0 else None

    def remove(self) -> None:
        self._handle.remove()

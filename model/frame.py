"""One DualAR frame for a batch of rows: sample the main token, then run the fast codebook loop.

This is upstream's `decode_one_token_ar` made batched and sync-free: code 0 comes from the sampled main token
(`token − semantic_begin`, floored at 0 — and, unlike upstream, capped at codebook_size−1 so a padding token can
never index past the table), codes 1..nc−1 are sampled from the fast head with their own repetition windows.
The same function serves prefill (no window) and the graph-captured decode step (ring-buffer window).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .dual_ar import DualARTransformer
from .kv_cache import KVCache
from .sampling import noise_from_keys, noise_keys, sample

# Upstream's repetition-penalty window, in frames.
PENALTY_WINDOW_FRAMES = 16

# noise(stream, n) -> (B, n) Exp(1) draws; stream 0 is the main token, j the j-th codebook.
NoiseFn = Callable[[int, int], torch.Tensor]


@dataclass(frozen=True, slots=True)
class SamplingTensors:
    """Per-row sampling parameters, each (B,) float32 on the model's device."""

    temperature: torch.Tensor
    top_p: torch.Tensor
    repetition_penalty: torch.Tensor

    @staticmethod
    def fill(
        rows: int, temperature: float, top_p: float, repetition_penalty: float, device: torch.device | str = "cpu"
    ) -> SamplingTensors:
        def full(v: float) -> torch.Tensor:
            return torch.full((rows,), v, dtype=torch.float32, device=device)

        return SamplingTensors(full(temperature), full(top_p), full(repetition_penalty))


def frame_noise(seed: torch.Tensor, step: torch.Tensor, vocab: int, num_codebooks: int, codebook_size: int) -> NoiseFn:
    """All of one frame's noise streams drawn up front in three batched hashes (bitwise what per-stream
    `exponential_noise` calls give): the main token's (B, vocab) and codebooks 1..nc−1 as (B, nc−1, codebook_size)."""
    keys = noise_keys(seed, step, 0, num_codebooks)  # (B, nc)
    main = noise_from_keys(keys[:, 0], vocab)
    codes = noise_from_keys(keys[:, 1:], codebook_size)

    def noise(stream: int, n: int) -> torch.Tensor:
        if n != (vocab if stream == 0 else codebook_size):
            raise ValueError(f"frame_noise drew stream {stream} with a different width than {n}")
        return main if stream == 0 else codes[:, stream - 1]

    return noise


@dataclass(frozen=True, slots=True)
class FrameTrace:
    """Raw logits of one frame, for parity tests: slow (B, vocab), fast (B, nc, cs) incl. unused position 0."""

    slow_logits: torch.Tensor
    fast_in_hidden: torch.Tensor
    fast_logits: torch.Tensor


def sample_frame(
    model: DualARTransformer,
    logits: torch.Tensor,  # (B, vocab) slow logits of the last position
    fast_hidden: torch.Tensor,  # (B, fast_dim) projected pre-norm slow hidden
    fast_cache: KVCache,
    params: SamplingTensors,
    noise: NoiseFn,
    *,
    window: torch.Tensor | None = None,  # (B, 1+nc, W) previous frames, or None (first frame: no penalty)
    trace: list[FrameTrace] | None = None,
) -> torch.Tensor:
    """Returns the frame (B, 1+nc) int64: [main token, code_0, …, code_{nc−1}]."""
    c = model.config
    vocab = logits.shape[-1]
    t, p, rp = params.temperature, params.top_p, params.repetition_penalty
    main = sample(logits, None if window is None else window[:, 0], t, p, rp, noise(0, vocab))

    fast_logits = [model.fast_step(fast_hidden, fast_cache, 0)]  # fills the fast cache; logits unused
    code = torch.clamp(main - model.semantic_begin_id, 0, c.codebook_size - 1)
    codes = [code]
    for j in range(1, c.num_codebooks):
        step_logits = model.fast_step(model.fast_embeddings(code), fast_cache, j)
        fast_logits.append(step_logits)
        code = sample(step_logits, None if window is None else window[:, j + 1], t, p, rp, noise(j, c.codebook_size))
        codes.append(code)
    if trace is not None:
        trace.append(FrameTrace(logits.detach().clone(), fast_hidden.detach().clone(), torch.stack(fast_logits, 1)))
    return torch.stack([main, *codes], dim=1)

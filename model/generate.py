"""Single-stream reference generation: upstream's `generate()` loop, written plainly on top of `sample_frame`.

This is the slow path every fast path is tested against (the engine's batched, graph-captured loop must produce
the same frames), and what offline one-shot synthesis uses. Frame 0 comes from the prefill with no repetition
penalty; later frames use a 16-frame window of loop frames (zeros until filled, as upstream). Generation stops
after the `<|im_end|>` frame or `max_new_tokens` frames. Unlike upstream, an `<|im_end|>` as the very first frame
also stops (upstream would keep generating past it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .dual_ar import DualARTransformer
from .frame import PENALTY_WINDOW_FRAMES, FrameTrace, NoiseFn, SamplingTensors, sample_frame
from .kv_cache import KVCache
from .sampling import exponential_noise


@dataclass
class Generation:
    frames: torch.Tensor  # (1+nc, N) int64: the generated frames, including a final <|im_end|> frame if any
    ended: bool  # True if the model produced <|im_end|>
    trace: list[FrameTrace] = field(default_factory=list)


def ones_noise(rows: int, device: torch.device | str) -> Callable[[int], NoiseFn]:
    """Noise of all ones: argmax(probs) — deterministic greedy draws, for parity with greedy fixtures."""
    return lambda _frame: lambda _stream, n: torch.ones(rows, n, device=device)


def seeded_noise(seed: int, device: torch.device | str, first_step: int = 0) -> Callable[[int], NoiseFn]:
    """Counter-based noise for one stream: frame i draws with step first_step + i."""
    seed_t = torch.tensor([seed], dtype=torch.int64, device=device)

    def for_frame(i: int) -> NoiseFn:
        step_t = torch.tensor([first_step + i], dtype=torch.int64, device=device)
        return lambda stream, n: exponential_noise(seed_t, step_t, stream, n)

    return for_frame


@torch.inference_mode()
def generate(
    model: DualARTransformer,
    prompt: torch.Tensor,  # (1+nc, T)
    max_new_tokens: int,
    params: SamplingTensors,  # rows = 1
    noise_for_frame: Callable[[int], NoiseFn],
    im_end_id: int,
    *,
    cache: KVCache | None = None,
    slot: int = 0,
    start_pos: int = 0,
    record_trace: bool = False,
) -> Generation:
    """Generate up to max_new_tokens frames after `prompt`, written into `cache[slot]` from `start_pos` on."""
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be at least 1")
    device = prompt.device
    seqlen = prompt.shape[-1]
    if cache is None:
        cache = model.make_cache(1, start_pos + seqlen + max_new_tokens)
    fast_cache = model.make_fast_cache(1)
    room = min(cache.max_seq_len, model.config.max_seq_len) - (start_pos + seqlen)
    max_new_tokens = min(max_new_tokens, room)
    if max_new_tokens < 1:
        raise ValueError(f"the prompt fills the model's context of {model.config.max_seq_len} positions")

    trace: list[FrameTrace] | None = [] if record_trace else None
    logits, hidden = model.prefill(prompt, cache, slot, start_pos)
    frame = sample_frame(
        model, logits.unsqueeze(0), hidden.unsqueeze(0), fast_cache, params, noise_for_frame(0), trace=trace
    )
    frames = [frame[0]]
    window = torch.zeros(1, prompt.shape[0], PENALTY_WINDOW_FRAMES, dtype=torch.int64, device=device)
    pos = start_pos + seqlen
    for i in range(max_new_tokens - 1):
        if int(frame[0, 0]) == im_end_id:
            break
        # decode_slow works on rows [0, B); a single stream in another slot gets its own one-row view
        logits, hidden = model.decode_slow(frame, cache.rows(slot), torch.tensor([pos], device=device), pos + 1)
        frame = sample_frame(
            model, logits, hidden, fast_cache, params, noise_for_frame(i + 1), window=window, trace=trace
        )
        window[:, :, i % PENALTY_WINDOW_FRAMES] = frame
        frames.append(frame[0])
        pos += 1
    out = torch.stack(frames, dim=1)
    return Generation(out, bool(out[0, -1] == im_end_id), trace or [])

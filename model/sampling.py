"""Token sampling exactly as upstream Fish Speech 1.5, batched with per-row parameters, plus counter-based noise.

Order (spec §2.3): repetition penalty over a window (once per distinct id) → top-p on the *untempered* logits →
temperature (clamped at 1e-5, so 0 means greedy) → softmax → exponential race `argmax(probs / q)`. The noise `q` is
an input: parity tests feed upstream's recorded draws, the engine feeds `exponential_noise`, a stateless hash of
(seed, step, stream, index) so a seeded stream never depends on what else runs. No host syncs anywhere.
"""

from __future__ import annotations

import torch

from .compiled_regions import region
from .small_sort import sort_descending

# Upstream divides by max(temperature, 1e-5): temperature 0 means greedy.
MIN_TEMPERATURE = 1e-5
# Constants of a 32-bit integer hash ("lowbias32" family). Both are < 2**31 so that a product with a 32-bit value
# stays below 2**63 and int64 tensor arithmetic never overflows.
HASH_MUL_1 = 0x21F0AAAD
HASH_MUL_2 = 0x735A2D97
MASK_32 = 0xFFFFFFFF
# Distinct salts keep the hash inputs (seed, step, stream, index) from aliasing each other.
SALT_STEP = 0x5BD1E995
SALT_STREAM = 0x27D4EB2F
SALT_SEED_HI = 0x165667B1


@torch.library.custom_op("fishgate::cumsum_last_dim", mutates_args=())
def cumsum_last_dim(x: torch.Tensor) -> torch.Tensor:
    """torch.cumsum over the last dimension, opaque to torch.compile: inductor's split-scan codegen fails on
    (8, 102048) in torch 2.11 (docs/archive/benchmark-log.md), and ATen's kernel keeps compiled sampling's top-p
    bitwise eager's."""
    return torch.cumsum(x, dim=-1)


@cumsum_last_dim.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def apply_repetition_penalty(logits: torch.Tensor, window: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """logits (B, V), window (B, W) ids, penalty (B,) → new logits; each distinct id is penalised once."""
    window = window.long()
    score = torch.gather(logits, 1, window)
    rp = penalty.to(logits.dtype).unsqueeze(1)
    score = torch.where(score < 0, score * rp, score / rp)
    return logits.scatter(1, window, score)


def logits_to_probs(
    logits: torch.Tensor,  # (B, V)
    window: torch.Tensor | None,  # (B, W) or None for no penalty
    temperature: torch.Tensor,  # (B,)
    top_p: torch.Tensor,  # (B,)
    repetition_penalty: torch.Tensor,  # (B,)
) -> torch.Tensor:
    if window is not None:
        logits = apply_repetition_penalty(logits, window, repetition_penalty)
    sorted_logits, sorted_idx = sort_descending(logits)  # the codebooks' rows by one Triton program each on CUDA
    probs = torch.softmax(sorted_logits, dim=-1)
    # the custom op only where inductor would see the cumsum (its Python dispatch costs ~35 µs a call eagerly)
    cum_probs = cumsum_last_dim(probs) if torch.compiler.is_compiling() else torch.cumsum(probs, dim=-1)
    remove_sorted = cum_probs > top_p.to(cum_probs.dtype).unsqueeze(1)
    remove_sorted[:, 0] = False  # always keep the most likely token
    remove = remove_sorted.scatter(1, sorted_idx, remove_sorted)
    logits = logits.masked_fill(remove, float("-inf"))
    logits = logits / torch.clamp(temperature.to(logits.dtype), min=MIN_TEMPERATURE).unsqueeze(1)
    return torch.softmax(logits, dim=-1)


def sample_index(probs: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Exponential race: argmax(probs / q) with q ~ Exp(1) i.i.d. is a draw from probs. (B, V) → (B,) int64."""
    return first_argmax(probs / q)


# Rows longer than this take their argmax in chunks of ARGMAX_CHUNK: inductor reduces an argmax in one program per
# row, and over the 102,048-token vocabulary that one program took 21 µs of a 2.55 ms one-row step (H200).
ARGMAX_SPLIT_OVER = 8192
ARGMAX_CHUNK = 1024


def first_argmax(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, -1) of a (B, V) tensor with no NaN: the first index of each row's maximum. Long rows go in
    two stages (each chunk's maximum and its first index, then the first chunk holding the row's maximum), which
    names the same index; the padding past V is -inf, below any value of x that can be a maximum."""
    width = x.shape[-1]
    if width <= ARGMAX_SPLIT_OVER:
        return torch.argmax(x, dim=-1)
    pad = -width % ARGMAX_CHUNK
    if pad:
        x = torch.nn.functional.pad(x, (0, pad), value=float("-inf"))
    part_max, part_index = x.view(x.shape[0], -1, ARGMAX_CHUNK).max(dim=-1)
    best = torch.argmax(part_max, dim=-1, keepdim=True)
    return (best * ARGMAX_CHUNK + torch.gather(part_index, 1, best))[:, 0]


@region
def sample(
    logits: torch.Tensor,
    window: torch.Tensor | None,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    repetition_penalty: torch.Tensor,
    q: torch.Tensor,
) -> torch.Tensor:
    return sample_index(logits_to_probs(logits, window, temperature, top_p, repetition_penalty), q)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """Bijective 32-bit integer hash on int64 tensors holding values in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = (x * HASH_MUL_1) & MASK_32
    x = x ^ (x >> 15)
    x = (x * HASH_MUL_2) & MASK_32
    return x ^ (x >> 15)


@region
def noise_keys(seed: torch.Tensor, step: torch.Tensor, first_stream: int, n_streams: int) -> torch.Tensor:
    """Per-row keys (B, n_streams) int64 of streams first_stream, first_stream+1, … (see exponential_noise)."""
    seed_lo = seed & MASK_32
    seed_hi = (seed >> 32) & MASK_32
    key = _mix32(seed_lo ^ _mix32(seed_hi ^ SALT_SEED_HI))
    key = _mix32(key ^ _mix32((step & MASK_32) ^ SALT_STEP))  # (B,)
    streams = torch.arange(first_stream, first_stream + n_streams, device=seed.device, dtype=torch.int64)
    return _mix32(key.unsqueeze(1) ^ ((streams * SALT_STREAM) & MASK_32))  # (B, S)


@region
def noise_from_keys(keys: torch.Tensor, n: int) -> torch.Tensor:
    """Keys (...) int64 → Exp(1) draws (..., n) float32: element i hashes (key, i); 24-bit uniforms → -log(u)."""
    index = torch.arange(n, device=keys.device, dtype=torch.int64)
    k = keys.unsqueeze(-1)
    bits = _mix32(_mix32(k ^ index) ^ k)  # (..., n)
    uniform = ((bits >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))
    return -torch.log(uniform)


def exponential_noise(seed: torch.Tensor, step: torch.Tensor, stream: int, n: int) -> torch.Tensor:
    """Counter-based Exp(1) noise: (B, n) float32 from per-row seed (B,) int64 and step (B,) int64.

    Element [b, i] depends only on (seed[b], step[b], stream, i), so a row's draws are identical whatever batch it
    runs in. `stream` separates the main token (0) from codebook j (j). Drawing several streams at once
    (`noise_keys` with n_streams > 1) gives bitwise the same values with far fewer kernel launches.
    """
    return noise_from_keys(noise_keys(seed, step, stream, 1)[:, 0], n)

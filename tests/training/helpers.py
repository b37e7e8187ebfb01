"""Shared fixtures of the training tests: synthetic teacher data, a memorised tiny DualAR, single-threaded torch.

Everything is tiny (training/configs.py: DUAL_AR_TINY, CODEC_TINY) so a training test runs in seconds on 2 cores.
The memorised DualAR is trained once per test session and shared by the DualAR and export tests.
"""

from __future__ import annotations

import math
from functools import cache

import numpy as np
import torch

from tests.model.codec_testing import one_thread  # noqa: F401 - re-exported: tiny kernels run faster on one thread
from training.configs import DUAL_AR_TINY
from training.dual_ar_data import CodesPack, ContextMix
from training.dual_ar_train import DualARTrainConfig, DualARTrainResult, train_dual_ar

SAMPLE_RATE_HZ = 44100
TEXTS = ("Hello there.", "A quick test!")
MEMORISE_STEPS = 120


def chirp(seconds: float, seed: int = 0, rate_hz: int = SAMPLE_RATE_HZ) -> np.ndarray:
    """A voiced-speech-like test signal: a gliding harmonic tone with a slow loudness envelope (float32)."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate_hz)) / rate_hz
    f0 = 120 + 80 * np.sin(2 * math.pi * (0.7 + 0.2 * rng.random()) * t)  # glide 40–200 Hz around 120
    phase = 2 * math.pi * np.cumsum(f0) / rate_hz
    tone = sum(np.sin(k * phase) / k for k in range(1, 6))
    envelope = 0.5 + 0.5 * np.sin(2 * math.pi * 1.3 * t) ** 2
    return (0.15 * tone * envelope).astype(np.float32)


@cache
def memorised_codes() -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(0)
    return tuple(rng.integers(0, 1000, (4, 18)).astype(np.int16) for _ in TEXTS)


def memorised_pack() -> CodesPack:
    return CodesPack(
        ids=["a", "b"], texts=list(TEXTS), splits=["train", "train"], codes=list(memorised_codes()),
        samples_per_frame=2048, sample_rate_hz=SAMPLE_RATE_HZ,
    )  # fmt: skip


@cache
def memorised_dual_ar() -> DualARTrainResult:
    """DUAL_AR_TINY trained until it reproduces both utterances alone and the second after the first (history)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cfg = DualARTrainConfig(
            dual_ar=DUAL_AR_TINY, lr=3e-3, warmup_steps=10, total_steps=MEMORISE_STEPS, total_seconds=0.0,
            mix=ContextMix(p_history=0.5, p_reference=0.0), val_fraction=0.0,
        )  # fmt: skip
        with torch.enable_grad():  # the first caller may be inside no_grad
            return train_dual_ar(cfg, memorised_pack(), max_steps=MEMORISE_STEPS, log_every=10)
    finally:
        torch.set_num_threads(before)

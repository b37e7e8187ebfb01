"""GPU only: the CUDA-graph reconstruction step (GraphedReconStep) trains like the eager step.

Run first in a training hold (`pytest tests/training/test_codec_graph_gpu.py`, ~30 s): if it fails, train without
`--cuda-graph`. Same init, same crops, same learning-rate schedule: after 20 steps the graphed and eager runs agree
to float tolerance (cuDNN may pick different algorithms, so not bitwise) and both lower the loss.
"""

from __future__ import annotations

import time

import pytest
import torch

from training.codec_train import CodecTrainConfig, train_codec
from training.configs import CODEC_SMALL

from .helpers import chirp
from .test_codec_train import InMemoryAudio

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

STEPS = 20


def _train(graph: bool) -> tuple[dict[str, torch.Tensor], list[float], float]:
    cfg = CodecTrainConfig(
        codec=CODEC_SMALL, batch_size=8, warmup_steps=5, total_steps=100, total_seconds=0.0, cuda_graph=graph,
        gain_db_range=(0.0, 0.0), holdout_fraction=0.0,
    )  # fmt: skip
    audio = InMemoryAudio(chirp(8.0))
    audio.audio = audio.audio.cuda()  # as AudioShard keeps it: crops are cut on the training device
    deterministic = torch.backends.cudnn.deterministic
    torch.backends.cudnn.deterministic = True
    try:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        result = train_codec(cfg, audio, device="cuda", max_steps=STEPS, log_every=1, eval_every=10**9)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
    finally:
        torch.backends.cudnn.deterministic = deterministic
    state = {k: v.detach().float().cpu() for k, v in result.model.state_dict().items()}
    return state, [h["mel"] for h in result.history if "mel" in h], seconds


def test_graphed_steps_train_like_eager_steps() -> None:
    eager, eager_mel, eager_s = _train(graph=False)
    graphed, graphed_mel, graphed_s = _train(graph=True)
    assert len(eager_mel) == len(graphed_mel) == STEPS
    assert graphed_mel[-1] < graphed_mel[0] and eager_mel[-1] < eager_mel[0]
    for a, b in zip(eager_mel, graphed_mel, strict=True):
        assert abs(a - b) <= 1e-3 * max(1.0, abs(a)), (eager_mel, graphed_mel)
    for name, value in eager.items():
        torch.testing.assert_close(graphed[name], value, rtol=1e-3, atol=1e-4, msg=name)
    print(f"eager {eager_s:.2f} s, graphed {graphed_s:.2f} s for {STEPS} steps (incl. warm-up and capture)")

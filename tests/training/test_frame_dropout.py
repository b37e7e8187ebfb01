"""Frame dropout: only semantic frames of the slow stack's input are hidden, at the asked rate, in training mode only;
the hidden frames look to the model exactly like zero embeddings; a training run with it still learns."""

from __future__ import annotations

import pytest
import torch

from model.config import DualARConfig
from model.dual_ar import DualARTransformer
from training.checkpoints import byte_tokenizer
from training.configs import DUAL_AR_TINY
from training.dual_ar_data import SequenceBuilder
from training.dual_ar_init import init_dual_ar
from training.dual_ar_train import DualARTrainConfig, train_dual_ar
from training.frame_dropout import FrameDropout

from .helpers import memorised_pack, one_thread  # noqa: F401


def tiny_model() -> tuple[DualARTransformer, torch.Tensor]:
    torch.manual_seed(0)
    tokenizer = byte_tokenizer()
    model = DualARTransformer(DualARConfig.from_dict(DUAL_AR_TINY), tokenizer.semantic_begin_id)
    init_dual_ar(model, 0.02)
    pack = memorised_pack()
    tokens, _ = SequenceBuilder(tokenizer, model.config.num_codebooks).utterance(pack.texts[0], pack.codes[0])
    return model, tokens.unsqueeze(0)


def is_frame(model: DualARTransformer, inp: torch.Tensor) -> torch.Tensor:
    tokens = inp[:, 0]
    return (tokens >= model.semantic_begin_id) & (tokens <= model.semantic_end_id)


def test_only_semantic_frames_are_dropped_at_about_the_asked_rate() -> None:
    model, inp = tiny_model()
    frames = is_frame(model, inp)
    assert 0 < int(frames.sum()) < frames.numel()  # text and frames both present
    torch.manual_seed(1)
    keeps = torch.stack([FrameDropout(model, 0.3).keep_mask(inp) for _ in range(200)])
    assert bool((keeps[:, ~frames] == 1).all())  # text and control tokens: never
    assert float(1 - keeps[:, frames].mean()) == pytest.approx(0.3, abs=0.02)
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        FrameDropout(model, 1.0)


def test_a_dropped_frame_is_a_zero_embedding_and_eval_mode_is_untouched() -> None:
    model, inp = tiny_model()
    model.eval()
    plain = model(inp)[2]
    dropout = FrameDropout(model, 0.5)
    dropout.arm(inp)
    assert torch.equal(model(inp)[2], plain)  # eval mode: the armed mask is ignored (and consumed)
    model.train()  # the tiny model has no other dropout, so training mode is deterministic here
    torch.manual_seed(2)
    keep = dropout.keep_mask(inp)
    torch.manual_seed(2)
    dropout.arm(inp)
    hidden = model(inp)[2]
    assert not torch.equal(hidden, plain) and bool((keep == 0).any())
    # the same forward with the dropped positions' embeddings zeroed by hand
    handle = model.layers[0].register_forward_pre_hook(lambda _m, a: (a[0] * keep.unsqueeze(-1), *a[1:]))
    torch.testing.assert_close(model(inp)[2], hidden, rtol=0, atol=0)
    handle.remove()
    assert torch.equal(model(inp)[2], plain)  # not armed: nothing dropped
    first_frame = int(is_frame(model, inp)[0].nonzero()[0])
    torch.testing.assert_close(hidden[:, :first_frame], plain[:, :first_frame], rtol=0, atol=0)  # causal: text alone


@pytest.mark.usefixtures("one_thread")
def test_training_with_frame_dropout_still_learns() -> None:
    cfg = DualARTrainConfig(
        dual_ar=DUAL_AR_TINY, lr=3e-3, warmup_steps=5, total_steps=60, total_seconds=0.0, val_fraction=0.0,
        frame_dropout=0.3,
    )  # fmt: skip
    result = train_dual_ar(cfg, memorised_pack(), max_steps=60, log_every=10)
    losses = [h["loss"] for h in result.history if "loss" in h]
    assert losses[-1] < 0.6 * losses[0], losses

"""Guided attention: utterance spans in training examples, the diagonal penalty, the recorded head scores (equal
to what the layer computes), and a training run that lowers the loss."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from model.text_split import clean_text
from training.checkpoints import byte_tokenizer
from training.configs import DUAL_AR_TINY
from training.dual_ar_data import Example, ExampleFactory, SequenceBuilder
from training.dual_ar_train import DualARTrainConfig, train_dual_ar
from training.guided_attention import GuideConfig, HeadScores, guide_tensors, guided_loss

from .helpers import TEXTS, memorised_codes, memorised_dual_ar, memorised_pack, one_thread  # noqa: F401


def check_span(example: Example, span: tuple[int, int, int, int], text: str, codes: np.ndarray) -> None:
    tok = byte_tokenizer()
    text_start, text_end, frames_start, frames_end = span
    assert example.tokens[0, text_start:text_end].tolist() == tok.encode(clean_text(text))
    np.testing.assert_array_equal(example.tokens[1:, frames_start:frames_end].numpy(), codes)
    assert int(example.tokens[0, frames_end]) == tok.im_end_id


def test_spans_point_at_each_utterances_text_and_frames() -> None:
    pack = memorised_pack()
    builder = SequenceBuilder(byte_tokenizer(), 4)
    factory = ExampleFactory(pack, builder)
    built = builder.example(pack.texts[1], pack.codes[1], history=[(pack.texts[0], pack.codes[0])],
                            reference=(pack.texts[0], pack.codes[0]))  # fmt: skip
    cached = factory.example(1, history=[0], reference=0)
    assert built.spans == cached.spans and len(built.spans) == 2
    assert torch.equal(built.tokens, cached.tokens)
    for span, i in zip(built.spans, (0, 1), strict=True):
        check_span(built, span, pack.texts[i], pack.codes[i])
    alone = factory.example(0)
    check_span(alone, alone.spans[0], pack.texts[0], pack.codes[0])


def test_guide_is_zero_on_the_diagonal_and_near_one_far_from_it() -> None:
    example = Example(torch.zeros(5, 30, dtype=torch.int64), torch.zeros(30, dtype=torch.bool), ((2, 6, 10, 18),))
    mask, weight = guide_tensors([example], 29, sigma=0.2)
    assert mask.shape == weight.shape == (1, 29, 29)
    expected = torch.zeros(29, 29, dtype=torch.bool)
    expected[10:18, 2:6] = True
    assert torch.equal(mask[0], expected) and float(weight[0][~expected].abs().max()) == 0.0
    assert float(weight[0, 10, 2]) == 0.0  # first frame, first character
    assert float(weight[0, 16, 5]) == pytest.approx(1 - math.exp(-((3 / 4 - 6 / 8) ** 2) / 0.08))  # on the diagonal
    assert float(weight[0, 17, 2]) > 0.99  # last frame, first character
    empty = Example(torch.zeros(5, 30, dtype=torch.int64), torch.zeros(30, dtype=torch.bool))
    assert not guide_tensors([empty], 29, sigma=0.2)[0].any()


def test_guided_loss_prefers_diagonal_attention() -> None:
    example = Example(torch.zeros(5, 40, dtype=torch.int64), torch.zeros(40, dtype=torch.bool), ((0, 10, 10, 30),))
    mask, weight = guide_tensors([example], 40, sigma=0.2)
    frame = torch.arange(40).view(40, 1).float()
    key = torch.arange(40).view(1, 40).float()
    diagonal = -50 * ((key / 10) - (frame - 10) / 20).abs()  # frame i of 20 looks at text i/2
    anti = -50 * ((key / 10) - (1 - (frame - 10) / 20)).abs()
    assert float(guided_loss(diagonal.unsqueeze(0), mask, weight)) < 0.1
    assert float(guided_loss(anti.unsqueeze(0), mask, weight)) > 0.5


@pytest.mark.parametrize("head", [0, 1, 2, 3])  # 4 query heads over 2 kv heads: each reads kv head head // 2
def test_recorded_head_scores_are_the_layers_own(head: int) -> None:
    """softmax(recorded scores, causal) @ that head's values == the layer's output for that head (before wo)."""
    model = memorised_dual_ar().model
    layer = 1
    attention = model.layers[layer].attention
    recorder = HeadScores(model, layer, head)
    seen: list[torch.Tensor] = []
    handle = attention.wo.register_forward_pre_hook(lambda _m, args: seen.append(args[0]))
    values: list[torch.Tensor] = []
    handle_v = attention.wqkv.register_forward_hook(lambda _m, _a, out: values.append(out))
    try:
        inp = SequenceBuilder(byte_tokenizer(), 4).utterance(TEXTS[0], memorised_codes()[0])[0].unsqueeze(0)
        recorder.active = True
        with torch.no_grad():
            model(inp)
        scores = recorder.take()
    finally:
        recorder.remove()
        handle.remove()
        handle_v.remove()
    hd, group = attention.head_dim, attention.n_head // attention.n_local_heads
    kv_head = head // group
    qkv = values[-1]  # the layer's own projection (the recorder's is computed separately)
    v = qkv[..., attention.dim + (attention.n_local_heads + kv_head) * hd :][..., :hd]
    t = scores.shape[-1]
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    expected = torch.softmax(scores.masked_fill(~causal, -math.inf), -1) @ v
    torch.testing.assert_close(seen[-1][..., head * hd : (head + 1) * hd], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.usefixtures("one_thread")
def test_training_with_guidance_lowers_the_guided_loss() -> None:
    cfg = DualARTrainConfig(
        dual_ar=DUAL_AR_TINY, lr=3e-3, warmup_steps=5, total_steps=60, total_seconds=0.0, val_fraction=0.0,
        guide=GuideConfig(weight=1.0, layer=1, head=0),
    )  # fmt: skip
    result = train_dual_ar(cfg, memorised_pack(), max_steps=60, log_every=10)
    guided = [h["guided_loss"] for h in result.history if "guided_loss" in h]
    assert len(guided) >= 5 and guided[-1] < 0.5 * guided[0], guided

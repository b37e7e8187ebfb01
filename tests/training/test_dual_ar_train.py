"""DualAR training: sequences in the engine's prompt format, loss masks, overfitting, generation, resume."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from model.config import DualARConfig
from model.dual_ar import DualARTransformer
from model.frame import SamplingTensors
from model.generate import generate, ones_noise
from model.prompt import PromptBuilder
from training.checkpoints import byte_tokenizer, load_resume
from training.configs import DUAL_AR_TINY
from training.dual_ar_data import (
    CodesPack,
    ContextMix,
    ExampleFactory,
    SequenceBuilder,
    build_examples,
    collate,
    make_batches,
)
from training.dual_ar_init import init_dual_ar
from training.dual_ar_train import (
    DualARTrainConfig,
    dual_ar_loss,
    evaluate,
    mismatched_examples,
    sample_codes,
    train_dual_ar,
)

from .helpers import TEXTS, memorised_codes, memorised_dual_ar, memorised_pack, one_thread  # noqa: F401


def test_utterance_is_the_engine_prompt_then_frames_then_im_end() -> None:
    tok = byte_tokenizer()
    builder = SequenceBuilder(tok, 4)
    codes = np.arange(12, dtype=np.int16).reshape(4, 3) * 7
    tokens, target = builder.utterance("Hi, you.", codes)
    prompt = PromptBuilder(tok, 4).target("Hi, you.")  # what Backend.segment_tokens feeds the engine
    n = prompt.shape[1]
    assert torch.equal(tokens[:, :n], prompt.long())
    assert tokens[0, n : n + 3].tolist() == [tok.semantic_begin_id + int(c) for c in codes[0]]
    assert torch.equal(tokens[1:, n : n + 3], torch.as_tensor(codes, dtype=torch.int64))
    assert tokens[:, -1].tolist() == [tok.im_end_id, 0, 0, 0, 0]
    assert target.tolist() == [False] * n + [True] * 4


def test_history_and_reference_context() -> None:
    tok = byte_tokenizer()
    builder = SequenceBuilder(tok, 4)
    a, b, r = (np.full((4, k), k, dtype=np.int16) for k in (2, 3, 5))
    ex = builder.example("second", b, history=[("first", a)], reference=("ref", r))
    prefix = PromptBuilder(tok, 4).prefix([("ref", torch.as_tensor(r))])
    assert prefix is not None
    first, _ = builder.utterance("first", a)
    second, _ = builder.utterance("second", b)
    assert torch.equal(ex.tokens, torch.cat([prefix.long(), first, second], dim=1))
    pack = CodesPack(["a", "b", "r"], ["first", "second", "ref"], ["train"] * 3, [a, b, r], 2048, 44100)
    cached = ExampleFactory(pack, builder).example(1, history=[0], reference=2)
    assert torch.equal(cached.tokens, ex.tokens) and torch.equal(cached.target, ex.target)
    # loss on both spoken parts (frames + end frame), never on the reference prefix or the prompts
    assert int(ex.target.sum()) == (2 + 1) + (3 + 1)
    assert not ex.target[: prefix.shape[1]].any()


def test_make_batches_respects_the_token_budget() -> None:
    lengths = [random.Random(i).randrange(10, 200) for i in range(300)]
    batches = make_batches(lengths, 1000, random.Random(0))
    assert sorted(i for b in batches for i in b) == list(range(300))
    assert all(max(lengths[i] for i in b) * len(b) <= 1000 for b in batches if len(b) > 1)


@torch.no_grad()
def test_loss_ignores_padding() -> None:
    """Right padding (pad ids or garbage) leaves the loss unchanged: it is causal and masked to the frame targets."""
    tok = byte_tokenizer()
    builder = SequenceBuilder(tok, 4)
    ex = build_examples(ExampleFactory(memorised_pack(), builder), [0], 2048, ContextMix(0.0, 0.0), seed=0)[0]
    model = memorised_dual_ar().model
    alone, _ = dual_ar_loss(model, ex.tokens[None], ex.target[None], tok.im_end_id)
    tokens, target = collate(
        [ex, builder.example("a much longer text than the first", memorised_codes()[1])], tok.pad_id
    )
    padded, _ = dual_ar_loss(model, tokens[:1], target[:1], tok.im_end_id)
    n = ex.tokens.shape[1]
    assert tokens.shape[2] > n + 5
    tokens[0, 0, n:] = torch.randint(0, 1000, (tokens.shape[2] - n,))
    garbage, _ = dual_ar_loss(model, tokens[:1], target[:1], tok.im_end_id)
    assert abs(float(alone) - float(padded)) < 1e-5 and abs(float(alone) - float(garbage)) < 1e-5


@pytest.mark.usefixtures("one_thread")
def test_overfit_then_generation_reproduces_the_codes() -> None:
    result = memorised_dual_ar()
    first = next(h for h in result.history if "loss" in h)
    last = [h for h in result.history if "loss" in h][-1]
    assert last["loss"] < 0.02 * first["loss"], (first["loss"], last["loss"])
    assert last["token_acc"] == 1.0 and last["codebook_acc"] == 1.0 and last["end_recall"] == 1.0
    # free-running, greedy: every frame and the closing <|im_end|>
    for (codes, ended), expected in zip(
        sample_codes(result.model, TEXTS, temperature=0.0, repetition_penalty=1.0), memorised_codes(), strict=True
    ):
        assert ended
        np.testing.assert_array_equal(codes, expected)
    # the second text after the first (history as generate_long / the engine lay it out)
    tok = byte_tokenizer()
    builder = SequenceBuilder(tok, 4)
    first_utt, _ = builder.utterance(TEXTS[0], memorised_codes()[0])
    prompt = torch.cat([first_utt, builder.prompts.target(TEXTS[1]).long()], dim=1)
    gen = generate(
        result.model, prompt, 40, SamplingTensors.fill(1, 0.0, 1.0, 1.0), ones_noise(1, "cpu"), tok.im_end_id
    )
    assert gen.ended
    np.testing.assert_array_equal(gen.frames[1:, :-1].numpy(), memorised_codes()[1])


def test_text_gap_tells_a_model_that_reads_the_text_from_one_that_does_not() -> None:
    """val_text_gap = token loss under another utterance's text − under its own: clearly positive for a model that
    follows the text (the memorised one), about zero for one that ignores it (fresh weights)."""
    tok = byte_tokenizer()
    pack = memorised_pack()
    factory = ExampleFactory(pack, SequenceBuilder(tok, 4))
    right = build_examples(factory, [0, 1], 10_000, ContextMix(0.0, 0.0), seed=0)
    wrong = mismatched_examples(factory, [0, 1], 10_000)
    assert len(wrong) == len(right) == 2 and mismatched_examples(factory, [0], 10_000) == []
    cfg = DualARTrainConfig(dual_ar=DUAL_AR_TINY)

    def gap(model: DualARTransformer) -> float:
        def loss(examples):
            return evaluate(model, examples, cfg, tok.pad_id, tok.im_end_id, torch.device("cpu"))["val_token_loss"]

        return loss(wrong) - loss(right)

    fresh = DualARTransformer(DualARConfig.from_dict(DUAL_AR_TINY), tok.semantic_begin_id)
    init_dual_ar(fresh, cfg.init_std)
    assert gap(memorised_dual_ar().model) > 0.1  # measured 0.27: its codes, once started, carry the rest
    assert abs(gap(fresh.eval())) < 0.02  # measured 0.001


@pytest.mark.usefixtures("one_thread")
def test_resume_restores_weights_and_step(tmp_path) -> None:
    cfg = DualARTrainConfig(dual_ar=DUAL_AR_TINY, warmup_steps=2, total_steps=10, total_seconds=0.0, val_fraction=0.0)
    pack = memorised_pack()
    first = train_dual_ar(cfg, pack, max_steps=3, out=tmp_path)
    parts, meta = load_resume(tmp_path / "dual_ar_resume.safetensors")
    assert meta["step"] == 3 and meta["kind"] == "dual_ar" and meta["dual_ar_config"] == DUAL_AR_TINY
    for k, v in first.model.state_dict().items():
        if k in parts["model"]:
            torch.testing.assert_close(parts["model"][k], v, rtol=0, atol=0)  # fp32 while small: exact
    second = train_dual_ar(cfg, pack, max_steps=2, resume=tmp_path / "dual_ar_resume.safetensors")
    assert second.step == 5


def test_validation_split_is_stable_and_excludes_test() -> None:
    ids = [f"utt{i:04d}" for i in range(500)]
    splits = ["test" if i % 10 == 0 else "train" for i in range(500)]
    pack = CodesPack(ids, ids, splits, [np.zeros((4, 1), np.int16)] * 500, 2048, 44100)
    train, val = pack.train_val_indices(0.05)
    assert train and val and not set(train) & set(val)
    assert all(splits[i] == "train" for i in train + val)
    assert 10 <= len(val) <= 40
    assert pack.train_val_indices(0.05) == (train, val)


@pytest.mark.usefixtures("one_thread")
def test_a_growing_pack_is_picked_up_between_epochs(tmp_path) -> None:
    """--codes-refresh: when the file changes, the next epoch trains on the larger pack; validation stays fixed."""
    cfg = DualARTrainConfig(dual_ar=DUAL_AR_TINY, warmup_steps=2, total_steps=50, total_seconds=0.0, max_tokens=64)
    pack = memorised_pack()
    refresh = tmp_path / "live.npz"
    grown = CodesPack(
        ids=[*pack.ids, "c"], texts=[*pack.texts, "More."], splits=[*pack.splits, "train"],
        codes=[*pack.codes, memorised_codes()[0]], samples_per_frame=2048, sample_rate_hz=44100,
    )  # fmt: skip
    grown.save(refresh)
    logged: list[dict] = []
    train_dual_ar(cfg, pack, max_steps=6, refresh=refresh, on_log=logged.append)
    refreshes = [e for e in logged if "refreshed_utterances" in e]
    assert refreshes and refreshes[0]["refreshed_utterances"] == 3 and refreshes[0]["train_utterances"] == 3


def test_residual_dropout_acts_in_training_only() -> None:
    from model.config import DualARConfig
    from model.dual_ar import DualARTransformer
    from training.dual_ar_train import add_residual_dropout

    tok = byte_tokenizer()
    torch.manual_seed(0)
    model = DualARTransformer(DualARConfig.from_dict(DUAL_AR_TINY), tok.semantic_begin_id)
    inp = SequenceBuilder(tok, 4).utterance(TEXTS[0], memorised_codes()[0])[0].unsqueeze(0)
    model.eval()
    before = model(inp)[0]
    handles = add_residual_dropout(model, 0.5)
    assert len(handles) == 2 * (model.config.n_layer + model.config.n_fast_layer)
    torch.testing.assert_close(model(inp)[0], before, rtol=0, atol=0)  # eval: untouched
    model.train()
    assert not torch.equal(model(inp)[0], before)
    assert add_residual_dropout(model, 0.0) == []


def test_a_resume_file_that_does_not_exist_is_refused(tmp_path) -> None:
    """`--resume` names a file the user means: a typo must not start a fresh run that looks like a resumed one."""
    from training.dual_ar_train import main

    missing = tmp_path / "nope.safetensors"
    with pytest.raises(SystemExit, match=r"--resume .*nope\.safetensors: no such file \(leave --resume out"):
        main(["--codes", str(tmp_path / "codes.npz"), "--out", str(tmp_path / "out"), "--resume", str(missing)])

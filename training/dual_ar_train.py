"""DualAR training on (text, codes) pairs through `DualARTransformer.forward` (the parity-tested teacher-forced path).

Loss = CE of the slow head on the next token at frame positions (the semantic tokens and the closing `<|im_end|>`)
+ CE of the fast head on every codebook of each semantic frame (upstream's two terms, summed). Sequences are the
engine's prompts (training/dual_ar_data.py). One call trains until `--train-seconds`, then writes
`dual_ar_resume.safetensors` (latest), `dual_ar_best.safetensors` (best validation loss), `dual_ar_log.jsonl` and
`dual_ar_samples.npz` (codes sampled for a few validation texts, to vocode on a CPU). Usage in TRAINING.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from model.config import DualARConfig
from model.dual_ar import DualARTransformer
from model.frame import SamplingTensors
from model.generate import generate, seeded_noise
from model.layers import Attention, FeedForward

from .checkpoints import byte_tokenizer, load_resume, require_resume_file, save_resume
from .codec_train import lr_at
from .configs import DUAL_AR_CANDIDATES, named_config
from .dual_ar_data import (
    CodesPack,
    ContextMix,
    Example,
    ExampleFactory,
    SequenceBuilder,
    build_examples,
    collate,
    make_batches,
)
from .dual_ar_init import init_dual_ar
from .frame_dropout import FrameDropout
from .guided_attention import GuideConfig, HeadScores, guide_tensors, guided_loss
from .run_log import jsonl_log

RESUME_NAME = "dual_ar_resume.safetensors"
BEST_NAME = "dual_ar_best.safetensors"
LOG_NAME = "dual_ar_log.jsonl"
SAMPLES_NAME = "dual_ar_samples.npz"
# Validation batches per evaluation (a fixed prefix of the validation set).
EVAL_BATCHES = 8
SAMPLE_TEXTS = 3


@dataclass(frozen=True, slots=True)
class DualARTrainConfig:
    dual_ar: dict[str, Any]  # config.json contents
    max_tokens: int = 16384  # batch size · padded length
    lr: float = 2e-3  # stable on the H200 (training/TRAINING.md), loss still falling when the time ran out
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = 0.05
    total_seconds: float = 1440.0  # cosine LR horizon in training seconds over all calls (calls are time-boxed)
    total_steps: int = 0  # or a horizon in steps (used when total_seconds is 0)
    warmup_steps: int = 300
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0
    init_std: float = 0.02  # upstream's initializer_range
    # residual dropout on every attention and feed-forward output while training: without it, 20 h of audio
    # overfitted after ~40 epochs (val loss 2.93 at step 3,500, 3.13 at 5,000 while the train loss kept falling)
    dropout: float = 0.1
    frame_dropout: float = 0.0  # fraction of input frames hidden from the slow stack (training/frame_dropout.py)
    mix: ContextMix = field(default_factory=ContextMix)
    guide: GuideConfig = field(default_factory=GuideConfig)  # guided attention on one head (off by default)
    val_fraction: float = 0.02  # of `train`, when the pack has no `val` split
    seed: int = 0


@dataclass
class DualARTrainResult:
    model: DualARTransformer
    step: int
    history: list[dict[str, float]] = field(default_factory=list)
    best_val: float = math.inf


def add_residual_dropout(model: DualARTransformer, p: float) -> list[torch.utils.hooks.RemovableHandle]:
    """Dropout on the output of every Attention and FeedForward (slow and fast stacks) in training mode only.

    Training-side only: forward hooks, so the model class, its weights and inference are unchanged."""
    if p <= 0:
        return []

    def hook(module: nn.Module, _inputs: Any, output: torch.Tensor) -> torch.Tensor:
        return F.dropout(output, p, training=module.training)

    return [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, Attention | FeedForward)]


def dual_ar_loss(
    model: DualARTransformer, tokens: torch.Tensor, target: torch.Tensor, im_end_id: int
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """tokens (B, 1+nc, L), target (B, L) → (token CE + codebook CE, metrics as 0-d tensors: no host sync)."""
    inp, labels, mask = tokens[:, :, :-1], tokens[:, :, 1:], target[:, 1:]
    token_logits, codebook_logits, _ = model(inp)
    label_tok = labels[:, 0]  # (B, T)
    token_loss = F.cross_entropy(token_logits[mask].float(), label_tok[mask])
    semantic = mask & model.is_semantic(label_tok)
    cb_logits = codebook_logits[semantic].float()  # (N, nc, cs)
    cb_labels = labels[:, 1:].transpose(1, 2)[semantic]  # (N, nc)
    cb_loss = F.cross_entropy(cb_logits.flatten(0, 1), cb_labels.flatten())
    with torch.no_grad():
        hit = token_logits.argmax(-1) == label_tok
        ends = mask & (label_tok == im_end_id)
        metrics = {
            "token_loss": token_loss.detach(),
            "codebook_loss": cb_loss.detach(),
            "token_acc": hit[mask].float().mean(),
            "end_recall": (hit & ends).sum() / ends.sum().clamp_min(1),
            "codebook_acc": (cb_logits.argmax(-1) == cb_labels).float().mean(),
        }
    return token_loss + cb_loss, metrics


def mismatched_examples(factory: ExampleFactory, indices: Sequence[int], max_seq_len: int) -> list[Example]:
    """Each validation utterance's codes under the next utterance's text: the token loss on these minus the loss
    with the right text (`val_text_gap`, nats per token) says how much the model reads the text. Teacher forcing
    keeps it modest (the codes so far predict much of the next frame), but a model that ignores the text scores
    ~0: a babbling model (WER ~100 %, training/TRAINING.md) scored 0.11."""
    builder = factory.builder
    out = []
    for n, i in enumerate(indices):
        j = indices[(n + 1) % len(indices)]
        tokens, target = builder.utterance(factory.pack.texts[j], factory.pack.codes[i])
        if len(indices) > 1 and tokens.shape[1] <= max_seq_len:
            out.append(Example(tokens, target))
    return out


@torch.no_grad()
def evaluate(
    model: DualARTransformer, examples: Sequence[Example], cfg: DualARTrainConfig, pad_id: int, im_end_id: int,
    device: torch.device,
) -> dict[str, float]:  # fmt: skip
    """Mean loss and metrics over the first EVAL_BATCHES batches of `examples` (fixed order)."""
    model.eval()
    batches = make_batches([e.tokens.shape[1] for e in examples], cfg.max_tokens, random.Random(0))[:EVAL_BATCHES]
    totals: dict[str, float] = {}
    for batch in batches:
        tokens, target = collate([examples[i] for i in batch], pad_id)
        loss, metrics = dual_ar_loss(model, tokens.to(device), target.to(device), im_end_id)
        for k, v in {"loss": loss, **metrics}.items():
            totals[k] = totals.get(k, 0.0) + float(v) / len(batches)
    return {f"val_{k}": v for k, v in totals.items()}


def train_dual_ar(
    cfg: DualARTrainConfig,
    pack: CodesPack,
    *,
    device: torch.device | str = "cpu",
    max_steps: int | None = None,
    max_seconds: float | None = None,
    resume: Path | None = None,
    out: Path | None = None,
    log_every: int = 50,
    eval_every: int = 500,
    save_every_s: float = 180.0,
    on_log: Callable[[dict[str, Any]], None] | None = None,
    refresh: Path | None = None,
) -> DualARTrainResult:
    """Train from scratch or `resume` on the pack's train split; validate on its val split (if any). When the file
    `refresh` appears or changes (a larger pack from the same codec), the next epoch trains on it."""
    device = torch.device(device)
    tokenizer = byte_tokenizer()
    config = DualARConfig.from_dict(cfg.dual_ar)
    torch.manual_seed(cfg.seed)
    model = DualARTransformer(config, tokenizer.semantic_begin_id)
    init_dual_ar(model, cfg.init_std)
    add_residual_dropout(model, cfg.dropout)
    frame_dropout = FrameDropout(model, cfg.frame_dropout)
    head_scores = HeadScores(model, cfg.guide.layer, cfg.guide.head) if cfg.guide.weight > 0 else None
    step, best_val = 0, math.inf
    meta_prev: dict[str, Any] = {}
    if resume is not None:
        parts, meta_prev = load_resume(resume)
        model.load_state_dict(parts["model"], strict=True)
        step, best_val = int(meta_prev.get("step", 0)), float(meta_prev.get("best_val", math.inf))
    model.to(device)
    if device.type == "cuda":
        # fp32 weights and activations with TF32 matmuls: DualARTransformer.forward writes fast-head logits into an
        # fp32 buffer, which bf16 autocast cannot fill, and a 4 M-parameter model is launch-bound anyway
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    factory = ExampleFactory(pack, SequenceBuilder(tokenizer, config.num_codebooks))
    train_idx, val_idx = pack.train_val_indices(cfg.val_fraction)
    rng = random.Random(cfg.seed * 7919 + step)
    val_examples = build_examples(factory, val_idx, config.max_seq_len, ContextMix(0.0, 0.0), seed=0)
    val_mismatched = mismatched_examples(factory, val_idx, config.max_seq_len)
    val_ids = {pack.ids[i] for i in val_idx}  # held out of every refreshed pack too
    if not build_examples(factory, train_idx, config.max_seq_len, ContextMix(0.0, 0.0), seed=0):
        raise ValueError(
            f"no training example fits max_seq_len={config.max_seq_len}: the pack has {len(train_idx)} 'train' "
            "utterances; check the manifest's split field or use shorter utterances"
        )
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr, betas=cfg.betas,
    )  # fmt: skip
    history: list[dict[str, float]] = []
    t_start = last_save = time.monotonic()
    elapsed_prev = float(meta_prev.get("elapsed_s", 0.0))
    first_step = step

    def meta() -> dict[str, Any]:
        return {
            "kind": "dual_ar", "step": step, "dual_ar_config": cfg.dual_ar, "train_config": dataclasses.asdict(cfg),
            "elapsed_s": elapsed_prev + time.monotonic() - t_start, "best_val": best_val,
            "max_frames_per_char": pack.max_frames_per_char(), "history_tail": history[-5:],
        }  # fmt: skip

    def stop() -> bool:
        if max_steps is not None and step - first_step >= max_steps:
            return True
        return max_seconds is not None and time.monotonic() - t_start >= max_seconds

    refreshed_at = 0.0
    while not stop():
        if refresh is not None and refresh.exists() and refresh.stat().st_mtime > refreshed_at:
            # a growing pack (the teacher still speaking): later epochs see the new utterances; validation stays
            # the first pack's, so its loss remains comparable
            refreshed_at = refresh.stat().st_mtime
            pack = CodesPack.load(refresh)
            factory = ExampleFactory(pack, SequenceBuilder(tokenizer, config.num_codebooks))
            train_idx = [i for i in pack.train_val_indices(cfg.val_fraction)[0] if pack.ids[i] not in val_ids]
            entry_r: dict[str, float] = {
                "step": step,
                "refreshed_utterances": len(pack.ids),
                "train_utterances": len(train_idx),
            }
            history.append(entry_r)
            if on_log is not None:
                on_log(entry_r)
        examples = build_examples(factory, train_idx, config.max_seq_len, cfg.mix, seed=rng.randrange(2**31))
        for batch in make_batches([e.tokens.shape[1] for e in examples], cfg.max_tokens, rng):
            if stop():
                break
            model.train()
            lr = lr_at(cfg, step, elapsed_prev + time.monotonic() - t_start, step - first_step)
            for group in opt.param_groups:
                group["lr"] = lr
            members = [examples[i] for i in batch]
            tokens, target = collate(members, tokenizer.pad_id)
            if head_scores is not None:
                head_scores.active = True
            tokens = tokens.to(device)
            frame_dropout.arm(tokens[:, :, :-1])  # the model input of dual_ar_loss
            loss, metrics = dual_ar_loss(model, tokens, target.to(device), tokenizer.im_end_id)
            if head_scores is not None:
                head_scores.active = False
                mask, weight = guide_tensors(members, tokens.shape[2] - 1, cfg.guide.sigma, device)
                guided = guided_loss(head_scores.take(), mask, weight)
                loss = loss + cfg.guide.weight * guided
                metrics["guided_loss"] = guided.detach()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            opt.step()
            step += 1
            if step % log_every == 0 or step == first_step + 1:
                entry = {"step": step, "lr": lr, "loss": float(loss.detach()), "grad_norm": float(grad_norm)}
                entry.update({k: float(v) for k, v in metrics.items()})
                entry["elapsed_s"] = time.monotonic() - t_start
                history.append(entry)
                if on_log is not None:
                    on_log(entry)
            if val_examples and step % eval_every == 0:
                val = evaluate(model, val_examples, cfg, tokenizer.pad_id, tokenizer.im_end_id, device)
                if val_mismatched:
                    wrong = evaluate(model, val_mismatched, cfg, tokenizer.pad_id, tokenizer.im_end_id, device)
                    val["val_text_gap"] = wrong["val_token_loss"] - val["val_token_loss"]
                history.append({"step": step, **val})
                if on_log is not None:
                    on_log({"step": step, **val})
                if val["val_loss"] < best_val and out is not None:
                    best_val = val["val_loss"]
                    save_resume(out / BEST_NAME, {"model": model}, meta())
            if out is not None and time.monotonic() - last_save >= save_every_s:
                save_resume(out / RESUME_NAME, {"model": model}, meta())
                last_save = time.monotonic()
    if out is not None:
        save_resume(out / RESUME_NAME, {"model": model}, meta())
    model.eval()  # the result is for inference: no dropout
    return DualARTrainResult(model, step, history, best_val)


@torch.no_grad()
def sample_codes(
    model: DualARTransformer, texts: Sequence[str], *, temperature: float = 0.7, top_p: float = 0.7,
    repetition_penalty: float = 1.2, seed: int = 0, frames_per_char: float = 4.0,
) -> list[tuple[np.ndarray, bool]]:  # fmt: skip
    """Free-running generation (model.generate, the engine's reference loop) → [(codes (nc, n), ended)]."""
    model.eval()
    tokenizer = byte_tokenizer()
    builder = SequenceBuilder(tokenizer, model.config.num_codebooks)
    device = model.embeddings.weight.device
    params = SamplingTensors.fill(1, temperature, top_p, repetition_penalty, device)
    out = []
    for text in texts:
        prompt = builder.prompts.target(text).to(device)
        limit = math.ceil(frames_per_char * len(text)) + 4
        gen = generate(model, prompt, limit, params, seeded_noise(seed, device), tokenizer.im_end_id)
        frames = gen.frames[:, :-1] if gen.ended else gen.frames
        out.append((frames[1:].cpu().numpy().astype(np.int16), gen.ended))
    return out


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--codes", type=Path, required=True, help="codes.npz from training.encode_codes")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--config", default="small", help=f"small, tiny, {', '.join(DUAL_AR_CANDIDATES)} or JSON")
    parser.add_argument("--resume", type=Path)
    parser.add_argument("--train-seconds", type=float, default=480.0)
    parser.add_argument("--max-steps", type=int)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    defaults = DualARTrainConfig(dual_ar={})
    for name in ("max_tokens", "total_steps", "warmup_steps", "seed"):
        parser.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(defaults, name))
    parser.add_argument("--lr", type=float, default=defaults.lr)
    parser.add_argument("--dropout", type=float, default=defaults.dropout)
    parser.add_argument(
        "--frame-dropout", type=float, default=defaults.frame_dropout, help="input frames hidden from the slow stack"
    )
    parser.add_argument("--total-seconds", type=float, default=defaults.total_seconds, help="LR horizon, all calls")
    parser.add_argument("--p-history", type=float, default=defaults.mix.p_history)
    parser.add_argument("--p-reference", type=float, default=defaults.mix.p_reference)
    parser.add_argument("--eval-every", type=int, default=500, help="steps between validations")
    parser.add_argument("--guided-weight", type=float, default=defaults.guide.weight, help="0 = no guided attention")
    parser.add_argument("--guided-layer", type=int, default=defaults.guide.layer)
    parser.add_argument("--guided-head", type=int, default=defaults.guide.head)
    parser.add_argument("--guided-sigma", type=float, default=defaults.guide.sigma)
    parser.add_argument("--codes-refresh", type=Path, help="a codes.npz that grows while training (re-read per epoch)")
    args = parser.parse_args(argv)

    resume = require_resume_file(args.resume)
    dual_ar = json.loads(Path(args.config).read_text()) if args.config.endswith(".json") else None
    dual_ar = dual_ar or named_config(args.config, DUAL_AR_CANDIDATES)
    if resume is not None:
        dual_ar = load_resume(resume)[1].get("dual_ar_config", dual_ar)  # the resumed model's shape wins
    cfg = DualARTrainConfig(
        dual_ar=dual_ar, max_tokens=args.max_tokens, lr=args.lr, dropout=args.dropout, total_steps=args.total_steps,
        total_seconds=args.total_seconds, frame_dropout=args.frame_dropout,
        warmup_steps=args.warmup_steps, mix=ContextMix(args.p_history, args.p_reference), seed=args.seed,
        guide=GuideConfig(args.guided_weight, args.guided_layer, args.guided_head, args.guided_sigma),
    )  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    pack = CodesPack.load(args.codes)
    print(json.dumps({"utterances": len(pack.ids), "device": args.device, "resume": str(resume)}), flush=True)
    with jsonl_log(args.out / LOG_NAME) as on_log:
        result = train_dual_ar(
            cfg, pack, device=args.device, max_steps=args.max_steps, max_seconds=args.train_seconds, resume=resume,
            out=args.out, on_log=on_log, refresh=args.codes_refresh, eval_every=args.eval_every,
        )  # fmt: skip
        held_out = pack.indices("test") or pack.train_val_indices(cfg.val_fraction)[1] or pack.indices("train")
        texts = [pack.texts[i] for i in held_out[:SAMPLE_TEXTS]]
        samples = sample_codes(result.model.float(), texts)
        arrays: dict[str, Any] = {f"codes_{k}": c for k, (c, _) in enumerate(samples)}
        arrays.update(texts=np.array(texts), ended=np.array([e for _, e in samples]))
        np.savez_compressed(args.out / SAMPLES_NAME, **arrays)
        on_log({"samples_frames": [int(c.shape[1]) for c, _ in samples], "samples_ended": [e for _, e in samples]})


if __name__ == "__main__":
    main()

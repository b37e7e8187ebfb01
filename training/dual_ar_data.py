"""DualAR training data: (text, codes) pairs → teacher-forced sequences in the engine's exact prompt format.

A codes pack (`codes.npz`, written by training/encode_codes.py) holds every utterance's codes (rows, frames), text,
id and split. One utterance becomes what the engine feeds and expects for one segment: `PromptBuilder.target(text)`
(user turn, `<|im_start|>assistant\\n<|voice|>`), then one frame per code column (`<|semantic:c0|>` + codes), then
the `<|im_end|>` frame. Optional context, as the engine builds it: the previous utterance as history (segment +
its frames, spec §2.5) and a reference-voice prefix (system + reference turn). Loss positions are the frames and
the end frame of the spoken parts. Knows nothing about models or optimizers.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from model.prompt import PromptBuilder
from model.text_split import clean_text
from model.tokenizer import FishTokenizer

USER_TURN_START = "<|im_start|>user\n"  # what PromptBuilder puts before a segment's text


@dataclass(frozen=True, slots=True)
class CodesPack:
    ids: list[str]
    texts: list[str]
    splits: list[str]
    codes: list[np.ndarray]  # each (rows, frames) int16
    samples_per_frame: int
    sample_rate_hz: int

    def save(self, path: Path) -> None:
        offsets = np.cumsum([0, *(c.shape[1] for c in self.codes)]).astype(np.int64)
        rows = self.codes[0].shape[0] if self.codes else 0
        flat = np.concatenate(self.codes, axis=1) if self.codes else np.zeros((rows, 0), np.int16)
        np.savez_compressed(
            path, codes=flat.astype(np.int16), offsets=offsets, ids=np.array(self.ids), texts=np.array(self.texts),
            splits=np.array(self.splits), samples_per_frame=self.samples_per_frame, sample_rate_hz=self.sample_rate_hz,
        )  # fmt: skip

    @classmethod
    def load(cls, path: Path) -> CodesPack:
        with np.load(path, allow_pickle=False) as z:
            offsets = z["offsets"]
            flat = z["codes"]
            codes = [flat[:, offsets[i] : offsets[i + 1]] for i in range(len(offsets) - 1)]
            return cls(
                ids=[str(x) for x in z["ids"]], texts=[str(x) for x in z["texts"]],
                splits=[str(x) for x in z["splits"]], codes=codes, samples_per_frame=int(z["samples_per_frame"]),
                sample_rate_hz=int(z["sample_rate_hz"]),
            )  # fmt: skip

    def indices(self, split: str) -> list[int]:
        return [i for i, s in enumerate(self.splits) if s == split]

    def train_val_indices(self, val_fraction: float) -> tuple[list[int], list[int]]:
        """(train, validation): the `val` split if the pack has one, else a stable `val_fraction` of `train`
        chosen by a hash of the id (the same utterances in every call). `test` is never used for training."""
        train, val = self.indices("train"), self.indices("val")
        if val:
            return train, val
        held = {i for i in train if zlib.crc32(self.ids[i].encode()) % 10_000 < val_fraction * 10_000}
        return [i for i in train if i not in held], sorted(held)

    def max_frames_per_char(self) -> float:
        """Largest frames / characters ratio among utterances (the engine's runaway cap is a multiple of it)."""
        return max((c.shape[1] / max(len(t), 1) for c, t in zip(self.codes, self.texts, strict=True)), default=0.0)


# Where one spoken utterance lies in an example: its text tokens [text_start, text_end) and its code frames
# [frames_start, frames_end) (the closing `<|im_end|>` frame excluded); positions in the example's tokens.
Span = tuple[int, int, int, int]


@dataclass(frozen=True, slots=True)
class Example:
    tokens: torch.Tensor  # (1+nc, L) int64: prompt and frames, as the engine's KV cache would hold them
    target: torch.Tensor  # (L,) bool: position i is a loss target (predicted from position i−1)
    spans: tuple[Span, ...] = ()  # one per spoken utterance (history and the utterance itself), in order


class SequenceBuilder:
    """Turns (text, codes) into training sequences with the engine's PromptBuilder."""

    def __init__(self, tokenizer: FishTokenizer, num_codebooks: int) -> None:
        self.tokenizer = tokenizer
        self.num_codebooks = num_codebooks
        self.prompts = PromptBuilder(tokenizer, num_codebooks)
        self._text_start = len(tokenizer.encode_with_specials(USER_TURN_START))  # where a segment's text begins

    def frames(self, codes: np.ndarray | torch.Tensor) -> torch.Tensor:
        """Codes (rows, T) → generated frames (1+nc, T+1): semantic token + codes, then the `<|im_end|>` frame."""
        c = torch.as_tensor(np.asarray(codes), dtype=torch.int64)[: self.num_codebooks]
        if c.shape[0] < self.num_codebooks:
            raise ValueError(f"codes have {c.shape[0]} rows; the model predicts {self.num_codebooks} codebooks")
        out = torch.zeros(1 + self.num_codebooks, c.shape[1] + 1, dtype=torch.int64)
        out[0, :-1] = c[0] + self.tokenizer.semantic_begin_id
        out[1:, :-1] = c
        out[0, -1] = self.tokenizer.im_end_id
        return out

    def span(self, text: str, utterance: torch.Tensor, n_frames: int, offset: int = 0) -> Span:
        """The Span of `utterance` (= self.utterance(text, codes of n_frames)[0]) placed at `offset`: the user turn's
        text follows `<|im_start|>user\n`; the frames come last but for the closing `<|im_end|>` frame."""
        text_end = self._text_start + len(self.tokenizer.encode(clean_text(text)))
        frames_end = utterance.shape[1] - 1
        return offset + self._text_start, offset + text_end, offset + frames_end - n_frames, offset + frames_end

    def utterance(self, text: str, codes: np.ndarray | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        prompt = self.prompts.target(text).to(torch.int64)
        frames = self.frames(codes)
        target = torch.cat(
            [torch.zeros(prompt.shape[1], dtype=torch.bool), torch.ones(frames.shape[1], dtype=torch.bool)]
        )
        return torch.cat([prompt, frames], dim=1), target

    def example(
        self,
        text: str,
        codes: np.ndarray,
        history: Sequence[tuple[str, np.ndarray]] = (),
        reference: tuple[str, np.ndarray] | None = None,
    ) -> Example:
        """prefix (reference, no loss) + history utterances (loss on their frames) + the utterance itself."""
        parts, targets, spans = [], [], []
        if reference is not None:
            prefix = self.prompts.prefix([(reference[0], torch.as_tensor(np.asarray(reference[1])))])
            assert prefix is not None
            parts.append(prefix.to(torch.int64))
            targets.append(torch.zeros(prefix.shape[1], dtype=torch.bool))
        for h_text, h_codes in (*history, (text, codes)):
            tok, tgt = self.utterance(h_text, h_codes)
            spans.append(self.span(h_text, tok, np.asarray(h_codes).shape[1], sum(p.shape[1] for p in parts)))
            parts.append(tok)
            targets.append(tgt)
        return Example(torch.cat(parts, dim=1), torch.cat(targets), tuple(spans))


@dataclass(frozen=True, slots=True)
class ContextMix:
    p_history: float = 0.3  # fraction of examples that carry the previous utterance as history
    p_reference: float = 0.1  # fraction that carry a reference-voice prefix
    max_reference_frames: int = 200  # references are a few seconds (~10 s at 21.5 Hz)


class ExampleFactory:
    """Examples of one pack, with each utterance's tokens built once (an epoch only re-draws the context)."""

    def __init__(self, pack: CodesPack, builder: SequenceBuilder) -> None:
        self.pack = pack
        self.builder = builder
        self._utterances: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._prefixes: dict[int, torch.Tensor] = {}
        self._spans: dict[int, Span] = {}

    def utterance(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if i not in self._utterances:
            self._utterances[i] = self.builder.utterance(self.pack.texts[i], self.pack.codes[i])
        return self._utterances[i]

    def span(self, i: int, offset: int) -> Span:
        if i not in self._spans:
            self._spans[i] = self.builder.span(self.pack.texts[i], self.utterance(i)[0], self.pack.codes[i].shape[1])
        text_start, text_end, frames_start, frames_end = self._spans[i]
        return text_start + offset, text_end + offset, frames_start + offset, frames_end + offset

    def prefix(self, j: int) -> torch.Tensor:
        if j not in self._prefixes:
            ref = (self.pack.texts[j], torch.as_tensor(np.asarray(self.pack.codes[j])))
            prefix = self.builder.prompts.prefix([ref])
            assert prefix is not None
            self._prefixes[j] = prefix.to(torch.int64)
        return self._prefixes[j]

    def example(self, i: int, history: Sequence[int] = (), reference: int | None = None) -> Example:
        """Same layout as SequenceBuilder.example, from cached parts."""
        parts, targets, spans = [], [], []
        if reference is not None:
            prefix = self.prefix(reference)
            parts.append(prefix)
            targets.append(torch.zeros(prefix.shape[1], dtype=torch.bool))
        for k in (*history, i):
            tok, tgt = self.utterance(k)
            spans.append(self.span(k, sum(p.shape[1] for p in parts)))
            parts.append(tok)
            targets.append(tgt)
        return Example(torch.cat(parts, dim=1), torch.cat(targets), tuple(spans))


def build_examples(
    factory: ExampleFactory, indices: Sequence[int], max_seq_len: int, mix: ContextMix, seed: int
) -> list[Example]:
    """One example per utterance, with a random context: the preceding utterance (in `indices` order) as history,
    and/or another short utterance as the reference voice. Context that would not fit is dropped."""
    rng = random.Random(seed)
    codes = factory.pack.codes
    refs = [i for i in indices if codes[i].shape[1] <= mix.max_reference_frames]
    out = []
    for n, i in enumerate(indices):
        history = [indices[n - 1]] if n > 0 and rng.random() < mix.p_history else []
        reference = rng.choice(refs) if refs and rng.random() < mix.p_reference else None
        ex = factory.example(i, history, reference if reference != i else None)
        if ex.tokens.shape[1] > max_seq_len:  # drop the context, then the utterance itself if still too long
            ex = factory.example(i)
        if ex.tokens.shape[1] <= max_seq_len:
            out.append(ex)
    return out


def make_batches(lengths: Sequence[int], max_tokens: int, rng: random.Random) -> list[list[int]]:
    """Shuffled batches of similar length with batch_size · max_len ≤ max_tokens (length-sorted within pools)."""
    order = list(range(len(lengths)))
    rng.shuffle(order)
    pool = 64 * max(1, max_tokens // max(max(lengths, default=1), 1))
    batches: list[list[int]] = []
    for start in range(0, len(order), pool):
        chunk = sorted(order[start : start + pool], key=lambda i: lengths[i])
        batch: list[int] = []
        for i in chunk:  # ascending length: the newest member is the longest
            if batch and lengths[i] * (len(batch) + 1) > max_tokens:
                batches.append(batch)
                batch = []
            batch.append(i)
        if batch:
            batches.append(batch)
    rng.shuffle(batches)
    return batches


def collate(examples: Sequence[Example], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad to the longest: tokens (B, 1+nc, L) with `<|pad|>` and zero codes, targets (B, L) False."""
    length = max(e.tokens.shape[1] for e in examples)
    rows = examples[0].tokens.shape[0]
    tokens = torch.zeros(len(examples), rows, length, dtype=torch.int64)
    tokens[:, 0] = pad_id
    target = torch.zeros(len(examples), length, dtype=torch.bool)
    for b, e in enumerate(examples):
        tokens[b, :, : e.tokens.shape[1]] = e.tokens
        target[b, : e.target.shape[0]] = e.target
    return tokens, target

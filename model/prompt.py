"""DualAR prompt tensors: upstream's conversation encoding (spec §2.1) and `generate_long`'s history rotation (§2.5).

A prompt is an int32 tensor `(1+nc, T)`: row 0 token ids, rows 1..nc codebook codes (0 off-audio). User-supplied
text (segment text, reference transcripts) is encoded with `FishTokenizer.encode`, so `<|im_end|>` typed by a user
stays plain text (spec §8); only the fixed scaffolding recognises special-token strings. This module knows nothing
about the transformer, sampling or audio; it only lays out tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from model.text_split import clean_text
from model.tokenizer import N_SEMANTIC_TOKENS, FishTokenizer

# Upstream's fixed system instruction, sent only when a reference voice is used.
SYSTEM_TEXT = "Speak out the provided text."
# generate_long keeps this many positions of max_length free for generation when it sizes the history window.
RESERVED_GENERATION_TOKENS = 1024
PROMPT_DTYPE = torch.int32  # upstream builds prompts as torch.int; the fixtures store int32


class PromptBuilder:
    """Builds prompt parts for one tokenizer and codebook count, exactly as upstream's `Conversation` encodes them."""

    def __init__(self, tokenizer: FishTokenizer, num_codebooks: int) -> None:
        if num_codebooks < 1:
            raise ValueError(f"num_codebooks must be ≥ 1, got {num_codebooks}")
        self.tokenizer = tokenizer
        self.num_codebooks = num_codebooks
        self._scaffolds: dict[str, Tensor] = {}

    # ---- message parts -------------------------------------------------------------------------------------------
    def system(self) -> Tensor:
        """`<|im_start|>system\\nSpeak out the provided text.<|im_end|>`  → (1+nc, T)."""
        return self._cat([self._scaffold("<|im_start|>system\n"), self._scaffold(SYSTEM_TEXT), self._im_end()])

    def reference(self, text: str, codes: Tensor) -> Tensor:
        """User turn with the cleaned reference transcript, then assistant `<|voice|>` + reference codes + end.

        `codes`: (n_q, T_ref) or (1, n_q, T_ref) integer codes from the vocoder encoder; rows past nc are dropped.
        """
        return self._cat(
            [
                self._user_turn(text),
                self._scaffold("<|im_start|>assistant\n"),
                self._scaffold("<|voice|>"),
                self._vq(codes),
                self._im_end(),
            ]
        )

    def target(self, text: str) -> Tensor:
        """The segment to speak: cleaned user turn, then the open turn `<|im_start|>assistant\\n<|voice|>`."""
        return self._cat(
            [self._user_turn(text), self._scaffold("<|im_start|>assistant\n"), self._scaffold("<|voice|>")]
        )

    def prefix(self, references: Sequence[tuple[str, Tensor]]) -> Tensor | None:
        """System message + every reference (text, codes), or None without references (upstream sends no system)."""
        if not references:
            return None
        return self._cat([self.system(), *(self.reference(text, codes) for text, codes in references)])

    def single(self, text: str, references: Sequence[tuple[str, Tensor]] = ()) -> Tensor:
        """Prompt for a text spoken as one segment without history: prefix (if any) + target."""
        prefix = self.prefix(references)
        target = self.target(text)
        return target if prefix is None else self._cat([prefix, target])

    # ---- history (generate_long) ---------------------------------------------------------------------------------
    def history_budget(self, prefix: Tensor | None, max_length: int) -> int:
        """Token budget generate_long allows the history: max_length − 1024 − len(system + references).

        Upstream subtracts the system message length even when no reference is used (then the system message is not
        in the prompt); that quirk is kept so windows match upstream.
        """
        prefix_len = self.system().shape[1] if prefix is None else prefix.shape[1]
        return max_length - RESERVED_GENERATION_TOKENS - prefix_len

    def segment_prompt(self, prefix: Tensor | None, global_encoded: Sequence[Tensor], max_length: int) -> Tensor:
        """Exact prompt generate_long passes to `generate` for the last segment of `global_encoded`.

        `global_encoded` = [seg0, gen0, seg1, gen1, …, seg_k] where seg_i = `target(text_i)` and gen_i = every frame
        generated for segment i as `(1+nc, n_i)` (its first frame and the trailing `<|im_end|>` frame included).
        """
        budget = self.history_budget(prefix, max_length)
        keep = history_indices([part.shape[1] for part in global_encoded], budget)
        parts = [global_encoded[i] for i in keep]
        return self._cat(parts if prefix is None else [prefix, *parts])

    # ---- helpers -------------------------------------------------------------------------------------------------
    def _text_part(self, ids: list[int]) -> Tensor:
        part = torch.zeros((1 + self.num_codebooks, len(ids)), dtype=PROMPT_DTYPE)
        part[0] = torch.tensor(ids, dtype=PROMPT_DTYPE)
        return part

    def _scaffold(self, text: str) -> Tensor:
        """The fixed prompt pieces (role headers, the system text), tokenised once per builder; callers only read
        them (`_cat` copies)."""
        part = self._scaffolds.get(text)
        if part is None:
            part = self._scaffolds[text] = self._text_part(self.tokenizer.encode_with_specials(text))
        return part

    def _im_end(self) -> Tensor:
        return self._text_part([self.tokenizer.im_end_id])

    def _user_turn(self, text: str) -> Tensor:
        user_ids = self.tokenizer.encode(clean_text(text))
        return self._cat([self._scaffold("<|im_start|>user\n"), self._text_part(user_ids), self._im_end()])

    def _vq(self, codes: Tensor) -> Tensor:
        if codes.dim() == 3 and codes.shape[0] == 1:
            codes = codes[0]
        if codes.dim() != 2:
            raise ValueError(f"reference codes must be (n_q, T) or (1, n_q, T), got shape {tuple(codes.shape)}")
        if codes.dtype.is_floating_point or codes.dtype == torch.bool:
            raise ValueError(f"reference codes must be an integer tensor, got {codes.dtype}")
        if codes.shape[0] < self.num_codebooks:
            raise ValueError(
                f"reference codes have {codes.shape[0]} rows but the model needs {self.num_codebooks}; "
                "encode the reference with the vocoder that matches this model"
            )
        codes = codes[: self.num_codebooks].to(device="cpu", dtype=PROMPT_DTYPE)
        if codes.numel():
            low, high = int(codes.min()), int(codes.max())
            if low < 0 or high >= N_SEMANTIC_TOKENS:
                raise ValueError(f"reference codes must lie in [0, {N_SEMANTIC_TOKENS}), got values in [{low}, {high}]")
        part = torch.empty((1 + self.num_codebooks, codes.shape[1]), dtype=PROMPT_DTYPE)
        part[0] = codes[0] + self.tokenizer.semantic_begin_id
        part[1:] = codes
        return part

    def _cat(self, parts: Sequence[Tensor]) -> Tensor:
        return torch.cat(list(parts), dim=1)


def history_indices(lengths: Sequence[int], budget_tokens: int) -> list[int]:
    """Indices of `global_encoded` that generate_long keeps for the last segment (spec §2.5), in prompt order.

    Walks back from the newest item summing lengths and stops at the first i with `count + len > budget` (the newest
    length is counted twice, as upstream). An even i > 0 is lowered by one so the window starts on a segment. If the
    window is shorter than the list minus the first (segment, generation) pair, the context is that pair plus the last
    i items; otherwise the whole list. Upstream quirk kept: i == 0 (the newest segment alone is over budget) gives
    `list[:2] + list[-0:]`, i.e. the first pair followed by the *whole* list.
    """
    if not lengths:
        raise ValueError("global_encoded is empty: it must end with the segment to generate")
    count = 0
    stop = len(lengths) - 1
    for i, length in enumerate(reversed(lengths)):
        count += length
        if count + length > budget_tokens:
            stop = i
            break
    if stop != 0 and stop % 2 == 0:
        stop -= 1
    everything = list(range(len(lengths)))
    if stop < len(lengths) - 2:
        return everything[:2] + everything[len(lengths) - stop if stop else 0 :]
    return everything


def history_is_append(lengths: Sequence[int], budget_tokens: int) -> bool:
    """True when segment k's context is segment k−1's context + [gen_{k−1}, seg_k] (no rotation in between).

    `lengths` are those of [seg0, gen0, …, seg_k]. When this holds, segment k's prompt is the previous prompt, the
    previous generation and the new segment, so an engine may extend its KV cache instead of prefilling again.
    False for the first segment (there is no previous prompt).
    """
    n = len(lengths)
    if n % 2 != 1:
        raise ValueError(f"lengths must be [seg0, gen0, …, seg_k] (odd count), got {n} items")
    if n < 3:
        return False
    previous = history_indices(lengths[: n - 2], budget_tokens)
    return history_indices(lengths, budget_tokens) == [*previous, n - 2, n - 1]


def upstream_yielded_codes(y: Tensor, prompt_len: int) -> Tensor:
    """Codes upstream v1.5.1's generate_long yields for a segment: `y[1:, T+1:]` (parity tooling only).

    Quirk (spec §2.4): it drops the first generated frame and keeps the trailing `<|im_end|>` frame (whose codes are
    junk). fishgate does not vocode this; it uses `frames_for_audio`.
    """
    return y[1:, prompt_len + 1 :]


def frames_for_audio(y: Tensor, prompt_len: int, *, im_end_id: int) -> Tensor:
    """Codes fishgate vocodes for a segment: every generated frame except a trailing `<|im_end|>` frame → (nc, n).

    `y` is `(1+nc, T+N)` = prompt followed by the generated frames. Unlike upstream (`upstream_yielded_codes`) the
    first generated frame is kept and the end frame is never vocoded (spec §8).
    """
    end = y.shape[1]
    if end > prompt_len and int(y[0, end - 1]) == im_end_id:
        end -= 1
    return y[1:, prompt_len:end]

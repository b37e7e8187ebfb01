"""Fish Speech 1.5 tokenizer: tiktoken ranks from `tokenizer.tiktoken` plus the 1036 derived special tokens (spec §3).

Owns the id layout (specials at `len(ranks) + index`, always 1024 semantic tokens), the FISH pre-tokenizer pattern,
and two encoders: `encode` for user text (special-token strings stay plain text, fishgate's rule, spec §8) and
`encode_with_specials` for the fixed prompt scaffolding (upstream behaviour). It knows nothing about conversations,
prompts or tensors; `model.prompt` builds those.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Iterable, Mapping
from pathlib import Path

import tiktoken

# Upstream's pre-tokenizer, alternative by alternative. `\s+(\?!\S)` is upstream's typo for `\s+(?!\S)`: the `?` is
# escaped, so it only matches whitespace followed by a literal "?!" and one non-space; kept verbatim because ids change.
FISH_PATTERN = "|".join(
    [
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)",
        r"\p{P}",
        r"[^\r\n\p{L}\p{N}]?\p{L}+",
        r"\p{N}",
        r" ?[^\s\p{L}\p{N}]+[\r\n]*",
        r"\s*[\r\n]+",
        r"\s+(\?!\S)",
        r"\s+",
    ]
)
# Upstream encodes text in slices of this many characters; the slice boundaries can change ids, so we slice the same.
ENCODE_CHUNK_CHARS = 400_000
# The semantic token count is fixed by the tokenizer, independent of the model's codebook_size.
N_SEMANTIC_TOKENS = 1024
# Fixed order of the special tokens; their ids are len(ranks) + position in this tuple.
SPECIAL_TOKENS: tuple[str, ...] = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|pad|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|placeholder:0|>",
    "<|placeholder:1|>",
    "<|placeholder:2|>",
    "<|placeholder:3|>",
    "<|text|>",
    "<|voice|>",
    "<|interleave|>",
    *(f"<|semantic:{i}|>" for i in range(N_SEMANTIC_TOKENS)),
)


def load_ranks(path: str | Path) -> dict[bytes, int]:
    """Read a tiktoken rank file: one `<base64 token bytes> <rank>` per line, blank lines skipped."""
    ranks: dict[bytes, int] = {}
    text = Path(path).read_text(encoding="utf-8")
    for line_no, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        fields = line.split()
        if len(fields) != 2:
            raise ValueError(
                f"{path}:{line_no}: expected '<base64> <rank>', got {line[:80]!r}; is this a .tiktoken file?"
            )
        try:
            token = base64.b64decode(fields[0], validate=True)
            rank = int(fields[1])
        except (binascii.Error, ValueError) as exc:
            raise ValueError(f"{path}:{line_no}: bad base64 token or rank in {line[:80]!r}") from exc
        ranks[token] = rank
    return ranks


class FishTokenizer:
    """Byte-pair tokenizer with Fish Speech's special tokens. Build with `FishTokenizer.from_file(path)`."""

    def __init__(self, mergeable_ranks: Mapping[bytes, int], name: str = "fish") -> None:
        if not mergeable_ranks:
            raise ValueError("empty rank table: pass the model's tokenizer.tiktoken")
        values = sorted(mergeable_ranks.values())
        if values != list(range(len(values))):
            raise ValueError(
                "token ranks must be exactly 0..len(ranks)-1 (specials are numbered after them); "
                "the rank file has gaps, duplicates or negative ranks"
            )
        self._n_ranks = len(values)
        self._special_ids: dict[str, int] = {tok: self._n_ranks + i for i, tok in enumerate(SPECIAL_TOKENS)}
        self._enc = tiktoken.Encoding(
            name=name,
            pat_str=FISH_PATTERN,
            mergeable_ranks=dict(mergeable_ranks),
            special_tokens=self._special_ids,
        )

    @classmethod
    def from_file(cls, path: str | Path) -> FishTokenizer:
        """Load `tokenizer.tiktoken` (the special tokens are derived, `special_tokens.json` is not read)."""
        return cls(load_ranks(path), name=Path(path).stem)

    def __repr__(self) -> str:
        return f"FishTokenizer(n_ranks={self._n_ranks}, vocab_size={self.vocab_size})"

    # ---- id layout -------------------------------------------------------------------------------------------------
    @property
    def n_ranks(self) -> int:
        """Number of ordinary (byte-pair) tokens; also the id of `<|begin_of_text|>`."""
        return self._n_ranks

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer can produce: ranks + 1036 specials (a model's embedding may have more rows)."""
        return self._n_ranks + len(SPECIAL_TOKENS)

    @property
    def special_ids(self) -> Mapping[str, int]:
        return dict(self._special_ids)

    def token_id(self, special: str) -> int:
        """Id of a special token string such as `"<|im_end|>"`."""
        try:
            return self._special_ids[special]
        except KeyError:
            raise KeyError(f"{special!r} is not a Fish special token; see model.tokenizer.SPECIAL_TOKENS") from None

    @property
    def bos_id(self) -> int:
        return self._special_ids["<|begin_of_text|>"]

    @property
    def eos_id(self) -> int:
        return self._special_ids["<|end_of_text|>"]

    @property
    def pad_id(self) -> int:
        return self._special_ids["<|pad|>"]

    @property
    def im_start_id(self) -> int:
        return self._special_ids["<|im_start|>"]

    @property
    def im_end_id(self) -> int:
        return self._special_ids["<|im_end|>"]

    @property
    def text_id(self) -> int:
        return self._special_ids["<|text|>"]

    @property
    def voice_id(self) -> int:
        return self._special_ids["<|voice|>"]

    @property
    def interleave_id(self) -> int:
        return self._special_ids["<|interleave|>"]

    @property
    def semantic_begin_id(self) -> int:
        return self._special_ids["<|semantic:0|>"]

    @property
    def semantic_end_id(self) -> int:
        """Id of `<|semantic:1023|>` (inclusive end)."""
        return self._special_ids[f"<|semantic:{N_SEMANTIC_TOKENS - 1}|>"]

    def semantic_id(self, code: int) -> int:
        """Token id of semantic code `code` (0 ≤ code < 1024)."""
        if not 0 <= code < N_SEMANTIC_TOKENS:
            raise ValueError(f"semantic code {code} out of range [0, {N_SEMANTIC_TOKENS})")
        return self.semantic_begin_id + code

    def code_of(self, token: int) -> int:
        """Semantic code of a semantic token id; raises for text/control ids (use `is_semantic` to test first)."""
        if not self.is_semantic(token):
            raise ValueError(
                f"token {token} is not a semantic token (ids {self.semantic_begin_id}..{self.semantic_end_id})"
            )
        return token - self.semantic_begin_id

    def is_semantic(self, token: int) -> bool:
        return self.semantic_begin_id <= token <= self.semantic_end_id

    # ---- encode / decode -------------------------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """Encode user text. Special-token strings (`<|im_end|>`, `<|semantic:5|>`, …) are plain characters here."""
        return [i for chunk in _chunks(text) for i in self._enc.encode_ordinary(chunk)]

    def encode_with_specials(self, text: str) -> list[int]:
        """Upstream `FishTokenizer.encode`: every special-token string becomes its control id. Scaffolding only."""
        ids: list[int] = []
        for chunk in _chunks(text):
            ids.extend(self._enc.encode(chunk, allowed_special="all", disallowed_special=()))
        return ids

    def decode(self, ids: Iterable[int]) -> str:
        """Decode ids to text (invalid UTF-8 becomes U+FFFD; specials decode to their `<|…|>` strings)."""
        id_list = [int(i) for i in ids]
        bad = [i for i in id_list if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(
                f"token ids {bad[:5]} out of range [0, {self.vocab_size}); model rows past the tokenizer's "
                "vocabulary are padding and cannot be decoded"
            )
        return self._enc.decode(id_list)


def _chunks(text: str) -> list[str]:
    if not isinstance(text, str):
        raise TypeError(f"text must be str, got {type(text).__name__}")
    return [text[i : i + ENCODE_CHUNK_CHARS] for i in range(0, len(text), ENCODE_CHUNK_CHARS)]

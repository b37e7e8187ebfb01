"""FishTokenizer: derived special ids vs upstream's files, the two encoding modes, the pre-tokenizer pattern, limits."""

from __future__ import annotations

import base64
import json

import pytest

from model.tokenizer import ENCODE_CHUNK_CHARS, N_SEMANTIC_TOKENS, SPECIAL_TOKENS, FishTokenizer, load_ranks
from tests.model.fixture_sets import dual_ar_sets, params

BYTE_RANKS = {bytes([b]): b for b in range(256)}


def _with_merges(*tokens: bytes) -> FishTokenizer:
    """Byte-level ranks plus a few multi-byte tokens (ranks 256, 257, …) to make pre-token boundaries visible."""
    ranks = dict(BYTE_RANKS)
    for tok in tokens:
        ranks[tok] = len(ranks)
    return FishTokenizer(ranks)


@pytest.fixture(scope="module")
def byte_tok() -> FishTokenizer:
    return FishTokenizer(BYTE_RANKS)


# ---- fixtures: ids as upstream derived and saved them ---------------------------------------------------------------
@pytest.mark.parametrize("fs", params(dual_ar_sets()))
def test_special_ids_match_upstream_files(fs):
    tok = FishTokenizer.from_file(fs.path / "tokenizer.tiktoken")
    saved = json.loads((fs.path / "special_tokens.json").read_text())  # written by upstream save_pretrained
    assert dict(tok.special_ids) == saved
    ids = fs.meta["tokenizer"]
    assert tok.n_ranks == ids["mergeable_ranks"] == ids["special_begin"] == tok.bos_id
    assert tok.semantic_begin_id == ids["semantic_begin_id"]
    assert tok.semantic_end_id == ids["semantic_end_id"]
    assert (tok.im_start_id, tok.im_end_id, tok.voice_id) == (ids["im_start_id"], ids["im_end_id"], ids["voice_id"])
    assert tok.vocab_size <= fs.config["vocab_size"]


@pytest.mark.parametrize("fs", params(dual_ar_sets()))
def test_decode_of_upstream_prompt(fs):
    tok = FishTokenizer.from_file(fs.path / "tokenizer.tiktoken")
    row0 = fs.tensors()["prompt/full"][0].tolist()
    assert tok.decode([i for i in row0 if not tok.is_semantic(i)]) == fs.meta["prompt_full_decoded_row0"]


def test_id_layout_rule(byte_tok):
    tok = byte_tok
    assert len(SPECIAL_TOKENS) == 12 + N_SEMANTIC_TOKENS
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.im_start_id, tok.im_end_id) == (256, 257, 258, 259, 260)
    assert (tok.text_id, tok.voice_id, tok.interleave_id) == (265, 266, 267)
    assert tok.token_id("<|placeholder:3|>") == 264
    assert (tok.semantic_begin_id, tok.semantic_end_id, tok.vocab_size) == (268, 1291, 1292)
    assert tok.semantic_id(0) == 268 and tok.semantic_id(1023) == 1291
    assert tok.code_of(268 + 517) == 517
    assert tok.is_semantic(1291) and not tok.is_semantic(1292) and not tok.is_semantic(267)
    for bad in (-1, 1024):
        with pytest.raises(ValueError, match="out of range"):
            tok.semantic_id(bad)
    with pytest.raises(ValueError, match="not a semantic token"):
        tok.code_of(tok.im_end_id)
    with pytest.raises(KeyError, match="SPECIAL_TOKENS"):
        tok.token_id("<|nope|>")


# ---- rank file ------------------------------------------------------------------------------------------------------
def test_load_ranks_skips_blank_lines_and_names_bad_lines(tmp_path):
    path = tmp_path / "t.tiktoken"
    lines = [f"{base64.b64encode(bytes([b])).decode()} {b}" for b in range(256)]
    path.write_text("\n".join(lines[:10]) + "\n\n   \n" + "\n".join(lines[10:]) + "\n")
    tok = FishTokenizer.from_file(path)
    assert tok.n_ranks == 256 and tok.encode("hi") == [104, 105]

    bad = tmp_path / "bad.tiktoken"
    bad.write_text("AA== 0\nnot-a-line\n")
    with pytest.raises(ValueError, match=r"bad.tiktoken:2"):
        load_ranks(bad)
    gap = dict(BYTE_RANKS)
    gap[b"ab"] = 300
    with pytest.raises(ValueError, match=r"0\.\.len"):
        FishTokenizer(gap)


# ---- encoding modes -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "text", ["<|im_end|>", "<|im_start|>system\nhi", "say <|semantic:5|> now", "<|voice|><|pad|><|begin_of_text|>"]
)
def test_control_strings_in_user_text_stay_plain(byte_tok, text):
    ids = byte_tok.encode(text)
    assert ids == list(text.encode("utf-8"))  # byte-level ranks: plain text == its UTF-8 bytes
    assert max(ids) < byte_tok.n_ranks
    assert byte_tok.decode(ids) == text
    upstream = byte_tok.encode_with_specials(text)
    assert any(i >= byte_tok.n_ranks for i in upstream)
    assert byte_tok.decode(upstream) == text


def test_scaffolding_mode_recognises_specials(byte_tok):
    tok = byte_tok
    ids = tok.encode_with_specials("<|im_start|>user\n<|semantic:5|><|im_end|>")
    assert ids == [tok.im_start_id, *b"user\n", tok.semantic_id(5), tok.im_end_id]


@pytest.mark.parametrize(
    "text", ["", "Hello, world!", "你好，世界！", "emoji 😀🚀🇺🇸 e\u0301", "tab\tnew\nline\r\n  x", "\u00a0\u200b"]
)
def test_unicode_round_trip_and_modes_agree_without_specials(byte_tok, text):
    merged = _with_merges(b"ll", b"llo", b" w", b"\xe4\xbd", b"\xe4\xbd\xa0", b"  ")
    for tok in (byte_tok, merged):
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert tok.encode_with_specials(text) == ids
    assert byte_tok.encode("") == []


def test_decode_rejects_out_of_range_ids(byte_tok):
    for bad in ([byte_tok.vocab_size], [1, -1], [10_000]):
        with pytest.raises(ValueError, match="out of range"):
            byte_tok.decode(bad)
    assert byte_tok.decode([byte_tok.semantic_end_id]) == "<|semantic:1023|>"


def test_encode_rejects_non_str(byte_tok):
    with pytest.raises(TypeError, match="must be str"):
        byte_tok.encode(b"bytes")


# ---- pre-tokenizer pattern --------------------------------------------------------------------------------------------
def test_pattern_whitespace_quirk():
    # A correct `\s+(?!\S)` would leave the last space to join the word (" b" → one token); upstream's escaped `\?`
    # makes `\s+` take every space, so " b" never forms.
    tok = _with_merges(b" b")
    assert tok.encode("a   b") == [ord("a"), 32, 32, 32, ord("b")]
    assert tok.encode("a b") == [ord("a"), 256]  # `[^\r\n\p{L}\p{N}]?\p{L}+` still attaches a single space


def test_pattern_punctuation_is_single_char_and_contractions_first():
    tok = _with_merges(b"!!", b"'s", b"12")
    assert tok.encode("Hi!!") == [ord("H"), ord("i"), ord("!"), ord("!")]  # \p{P} matches one char at a time
    assert tok.encode("it's") == [ord("i"), ord("t"), 257]  # (?i:'s|…) wins over \p{P}
    assert tok.encode("IT'S") == [ord("I"), ord("T"), ord("'"), ord("S")]  # case-insensitive split, no 'S rank
    assert tok.encode("12") == [ord("1"), ord("2")]  # \p{N} is one digit per pre-token
    assert tok.encode("$$$") == [ord("$")] * 3


# ---- large inputs ---------------------------------------------------------------------------------------------------
def test_large_input_is_chunked_like_upstream():
    tok = _with_merges(b"ab")
    text = "x" * (ENCODE_CHUNK_CHARS - 1) + "ab"  # "a" ends chunk 1, "b" starts chunk 2: the merge cannot happen
    ids = tok.encode(text)
    assert len(ids) == ENCODE_CHUNK_CHARS + 1 and ids[-2:] == [ord("a"), ord("b")]
    assert tok.encode_with_specials(text) == ids
    assert tok.encode("ab") == [256]


def test_very_large_input(byte_tok):
    text = ("long text with spaces " * 60_000) + " " * 300_000  # ~1.6 M chars incl. one huge whitespace run
    ids = byte_tok.encode(text)
    assert len(ids) == len(text.encode("utf-8"))

"""The multi-slot KV cache path equals the teacher-forced forward, and slots are independent of each other."""

from __future__ import annotations

import pytest
import torch

from model.config import DualARConfig
from model.dual_ar import DualARTransformer

SEMANTIC_BEGIN = 268  # tiny byte-level tokenizer layout (spec §3)
CONFIGS = {
    "gqa_fast_project": dict(
        vocab_size=1296, n_layer=2, n_head=4, n_local_heads=2, dim=64, intermediate_size=160, rope_base=10000.0,
        norm_eps=1e-6, max_seq_len=256, tie_word_embeddings=False, codebook_size=32, num_codebooks=4,
        n_fast_layer=1, fast_dim=48, fast_n_head=4, fast_n_local_heads=1, fast_intermediate_size=96,
    ),
    "tied_qkv_bias_mha": dict(
        vocab_size=1300, n_layer=3, n_head=4, n_local_heads=4, dim=32, intermediate_size=64, rope_base=1e6,
        norm_eps=1e-5, max_seq_len=256, tie_word_embeddings=True, attention_qkv_bias=True, codebook_size=16,
        num_codebooks=3, n_fast_layer=2,
    ),
}  # fmt: skip


def make_model(name: str) -> DualARTransformer:
    torch.manual_seed(0)
    model = DualARTransformer(DualARConfig.from_dict({"model_type": "dual_ar", **CONFIGS[name]}), SEMANTIC_BEGIN)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3 if p.dim() > 1 else 1.0)
    return model.eval()


def assert_scaled_close(actual: torch.Tensor, expected: torch.Tensor, rel: float = 1e-5) -> None:
    """max |a − e| ≤ rel · max |e| (fp32 summation-order noise scales with the values' magnitude)."""
    diff = (actual - expected).abs().max().item()
    scale = expected.abs().max().item()
    assert diff <= rel * scale, f"max abs diff {diff:.3g} > {rel} × {scale:.3g}"


def random_sequence(model: DualARTransformer, length: int, seed: int) -> torch.Tensor:
    """(1+nc, T): text tokens with a run of semantic frames (codes in range) in the middle."""
    c = model.config
    gen = torch.Generator().manual_seed(seed)
    seq = torch.zeros(1 + c.num_codebooks, length, dtype=torch.long)
    seq[0] = torch.randint(0, 256, (length,), generator=gen)
    audio = slice(length // 3, length // 3 + length // 2)
    n = audio.stop - audio.start
    seq[1:, audio] = torch.randint(0, c.codebook_size, (c.num_codebooks, n), generator=gen)
    seq[0, audio] = SEMANTIC_BEGIN + seq[1, audio]
    return seq


@pytest.mark.parametrize("name", list(CONFIGS))
@torch.no_grad()
def test_cached_decode_equals_teacher_forced_forward(name: str) -> None:
    model = make_model(name)
    seq = random_sequence(model, 40, seed=1)
    full_logits, _, full_hidden = model(seq.unsqueeze(0))
    cache = model.make_cache(n_slots=3)
    prefix = 17
    logits, _ = model.prefill(seq[:, :prefix], cache, slot=2)
    assert_scaled_close(logits, full_logits[0, prefix - 1])
    # decode the rest one frame at a time in slot 2 through a one-row view of it
    for pos in range(prefix, seq.shape[1]):
        view = cache.rows(2)
        step_logits, step_hidden = model.decode_slow(seq[:, pos].unsqueeze(0), view, torch.tensor([pos]), pos + 1)
        assert_scaled_close(step_logits[0], full_logits[0, pos])
        assert_scaled_close(step_hidden[0], model.fast_project_in(full_hidden[0, pos]))


@pytest.mark.parametrize("name", list(CONFIGS))
@torch.no_grad()
def test_chunked_prefill_equals_one_prefill(name: str) -> None:
    model = make_model(name)
    seq = random_sequence(model, 50, seed=2)
    one, chunked = model.make_cache(1), model.make_cache(1)
    logits_one, hidden_one = model.prefill(seq, one, 0)
    for start in range(0, 50, 16):
        logits_chunked, hidden_chunked = model.prefill(seq[:, start : start + 16], chunked, 0, start_pos=start)
    assert_scaled_close(logits_chunked, logits_one)
    assert_scaled_close(hidden_chunked, hidden_one)
    assert_scaled_close(chunked.k[:, :, :, :50], one.k[:, :, :, :50])


@pytest.mark.parametrize("name", list(CONFIGS))
@torch.no_grad()
def test_slots_at_different_positions_equal_single_slot_runs(name: str) -> None:
    """In batch-invariant mode (fixed attention length) a row's result is bitwise independent of its batch."""
    model = make_model(name)
    model.set_batch_invariant(True)
    seqs = [random_sequence(model, n, seed=10 + n) for n in (9, 30, 21)]
    batch = model.make_cache(n_slots=4)
    for slot, s in enumerate(seqs):
        model.prefill(s[:, :-1], batch, slot)
    frames = torch.stack([s[:, -1] for s in seqs])  # (3, 1+nc)
    pos = torch.tensor([s.shape[1] - 1 for s in seqs])
    logits, hidden = model.decode_slow(frames, batch, pos)  # whole-cache attention length
    for i, s in enumerate(seqs):
        alone = model.make_cache(1)
        model.prefill(s[:, :-1], alone, 0)
        solo_logits, solo_hidden = model.decode_slow(s[:, -1:].T, alone, pos[i : i + 1])
        assert torch.equal(logits[i], solo_logits[0])
        assert torch.equal(hidden[i], solo_hidden[0])


@torch.no_grad()
def test_move_slot_keeps_a_stream_intact() -> None:
    model = make_model("gqa_fast_project")
    seq = random_sequence(model, 20, seed=3)
    cache = model.make_cache(n_slots=3)
    model.prefill(seq[:, :-1], cache, slot=2)
    cache.move_slot(2, 0, length=19)
    moved, _ = model.decode_slow(seq[:, -1:].T, cache, torch.tensor([19]), 20)
    reference = model.make_cache(1)
    model.prefill(seq[:, :-1], reference, 0)
    expected, _ = model.decode_slow(seq[:, -1:].T, reference, torch.tensor([19]), 20)
    assert torch.equal(moved, expected)


@torch.no_grad()
def test_fast_step_batched_equals_single() -> None:
    model = make_model("gqa_fast_project")
    model.set_batch_invariant(True)
    c = model.config
    x = torch.randn(3, c.fast_dim)
    batched, single = model.make_fast_cache(3), model.make_fast_cache(1)
    out_b = model.fast_step(x, batched, 0)
    for i in range(3):
        out_s = model.fast_step(x[i : i + 1], single, 0)
        assert torch.equal(out_b[i], out_s[0])


def test_prefill_past_the_context_is_refused() -> None:
    model = make_model("gqa_fast_project")
    cache = model.make_cache(1)
    with pytest.raises(ValueError, match="exceeds the context"):
        model.prefill(random_sequence(model, 20, seed=4), cache, 0, start_pos=250)


@torch.no_grad()
def test_batch_invariant_mode_computes_the_same_function() -> None:
    model = make_model("gqa_fast_project")
    seq = random_sequence(model, 30, seed=5).unsqueeze(0)
    fast = model(seq)
    model.set_batch_invariant(True)
    slow = model(seq)
    for a, b in zip(fast, slow, strict=True):
        assert_scaled_close(b, a)


@torch.no_grad()
def test_attention_length_bucket_only_changes_rounding() -> None:
    """Decoding with a longer (masked) attention length than needed computes the same function."""
    model = make_model("gqa_fast_project")
    seq = random_sequence(model, 21, seed=6)
    cache = model.make_cache(1)
    model.prefill(seq[:, :-1], cache, 0)
    tight, _ = model.decode_slow(seq[:, -1:].T, cache, torch.tensor([20]), 21)
    loose, _ = model.decode_slow(seq[:, -1:].T, cache, torch.tensor([20]), 64)
    assert_scaled_close(loose, tight)


@pytest.mark.parametrize("name", list(CONFIGS))
@torch.no_grad()
def test_batched_prefill_equals_row_by_row_prefill(name: str) -> None:
    """prefill_many over rows with different lengths and start positions (one appends to what its row holds)
    writes the same KV and returns the same last-position outputs as one prefill per row; other rows untouched."""
    model = make_model(name)
    seqs = {1: random_sequence(model, 23, seed=31), 4: random_sequence(model, 9, seed=32),
            2: random_sequence(model, 40, seed=33)}  # fmt: skip
    held = random_sequence(model, 12, seed=34)  # row 2 already holds 12 positions; its prompt appends after them
    starts = {1: 0, 4: 0, 2: 12}
    single, batched = model.make_cache(6), model.make_cache(6)
    for cache in (single, batched):
        model.prefill(held, cache, 2)
        model.prefill(random_sequence(model, 30, seed=35), cache, 3)  # a bystander row
    untouched = batched.k[:, 3].clone(), batched.v[:, 0].clone()
    expected = {r: model.prefill(s, single, r, starts[r]) for r, s in seqs.items()}
    rows = list(seqs)
    logits, hidden = model.prefill_many([seqs[r] for r in rows], batched, rows, [starts[r] for r in rows])
    for b, r in enumerate(rows):
        assert_scaled_close(logits[b], expected[r][0])
        assert_scaled_close(hidden[b], expected[r][1])
        end = starts[r] + seqs[r].shape[1]
        assert_scaled_close(batched.k[:, r, :, :end], single.k[:, r, :, :end])
        assert_scaled_close(batched.v[:, r, :, :end], single.v[:, r, :, :end])
    assert torch.equal(batched.k[:, 3], untouched[0]) and torch.equal(batched.v[:, 0], untouched[1])


def test_batched_prefill_refuses_a_prompt_past_the_context() -> None:
    model = make_model("gqa_fast_project")
    cache = model.make_cache(2, 64)
    with pytest.raises(ValueError, match="context"):
        model.prefill_many([random_sequence(model, 10, 1), random_sequence(model, 64, 2)], cache, [0, 1], [0, 0])


@pytest.mark.parametrize(("k", "n"), [(32, 1300), (64, 192), (32, 96)])
def test_invariant_linear_gives_a_row_the_same_bits_alone_as_in_any_batch(k: int, n: int) -> None:
    """CPU torch runs a bmm of batch 1 through another kernel than larger batches (different last bits with 2+ threads
    on an Intel Xeon at K 32, N 1,300); a single row therefore runs as two."""
    from model.layers import invariant_linear

    torch.manual_seed(1)
    x, weight, bias = torch.randn(8, k), torch.randn(n, k), torch.randn(n)
    for rows in (1, 2, 3, 8):
        batch = invariant_linear(x[:rows], weight, bias)
        for i in range(rows):
            assert torch.equal(batch[i], invariant_linear(x[i : i + 1], weight, bias)[0]), (rows, i)

"""DualAR parity with upstream fixtures: RoPE tables, teacher-forced logits, KV-cached generation, sampling steps.

Every DualAR fixture set found under FISH15_FIXTURES runs; parameters come from each set's fixtures_meta.json.
"""

from __future__ import annotations

from functools import cache

import pytest
import torch

from model.checkpoint import LoadedDualAR, load_dual_ar
from model.frame import SamplingTensors
from model.generate import generate, ones_noise
from model.sampling import logits_to_probs, sample_index
from tests.model.fixture_sets import FixtureSet, dual_ar_sets, params

LOGITS_ATOL = 1e-4  # fixtures README: suggested fp32 tolerance (observed ≤ 4e-6 for an independent port)
PROBS_ATOL = 1e-6

SETS = params(dual_ar_sets())


@cache
def loaded(fs: FixtureSet) -> LoadedDualAR:
    return load_dual_ar(fs.path, dtype=torch.float32)


def close(a: torch.Tensor, b: torch.Tensor, atol: float) -> float:
    diff = (a.float() - b.float()).abs().max().item()
    assert diff <= atol, f"max abs diff {diff:.3g} > {atol}"
    return diff


@pytest.mark.parametrize("fs", SETS)
def test_rope_tables_are_bf16_rounded_like_upstream(fs: FixtureSet) -> None:
    model = loaded(fs).model
    fx = fs.tensors()
    assert torch.equal(model.freqs_cis, fx["rope/freqs_cis_bf16_as_f32"])
    assert torch.equal(model.fast_freqs_cis, fx["rope/fast_freqs_cis_bf16_as_f32"])


@pytest.mark.parametrize("fs", SETS)
def test_teacher_forced_forward(fs: FixtureSet) -> None:
    model = loaded(fs).model
    fx = fs.tensors()
    with torch.no_grad():
        token_logits, codebook_logits, hidden = model(fx["forward/inp"].long())
    close(token_logits, fx["forward/token_logits"], LOGITS_ATOL)
    close(codebook_logits, fx["forward/codebook_logits"], LOGITS_ATOL)
    close(hidden, fx["forward/slow_hidden_prenorm"], LOGITS_ATOL)
    # rows that upstream skips are exact zeros, and so are ours
    skipped = fx["forward/codebook_logits"].abs().sum(dim=(-1, -2)) == 0
    assert skipped.any() and (codebook_logits[skipped] == 0).all()


@pytest.mark.parametrize("run", ["greedy", "greedy_rep"])
@pytest.mark.parametrize("fs", SETS)
def test_cached_generation_matches_upstream(fs: FixtureSet, run: str) -> None:
    if f"{run}/y" not in fs.tensors():
        pytest.skip(f"{fs.name} has no {run} run")
    lm = loaded(fs)
    fx, meta = fs.tensors(), fs.meta[run]["params"]
    prompt = fx["prompt/full"].long()
    sampling = SamplingTensors.fill(1, meta["temperature"], meta["top_p"], meta["repetition_penalty"])
    out = generate(
        lm.model, prompt, meta["max_new_tokens"], sampling, ones_noise(1, "cpu"), lm.tokenizer.im_end_id,
        record_trace=True,
    )  # fmt: skip
    expected = fx[f"{run}/y"].long()[:, prompt.shape[1] :]
    assert torch.equal(out.frames, expected), "generated frames differ from upstream"
    assert out.ended == bool(expected[0, -1] == lm.tokenizer.im_end_id)
    close(torch.cat([t.slow_logits for t in out.trace]), fx[f"{run}/slow_logits"], LOGITS_ATOL)
    close(torch.cat([t.fast_in_hidden for t in out.trace]), fx[f"{run}/fast_in_hidden"], LOGITS_ATOL)
    close(torch.cat([t.fast_logits for t in out.trace]), fx[f"{run}/fast_logits"], LOGITS_ATOL)


@pytest.mark.parametrize("fs", SETS)
def test_seeded_sampling_reproduces_torch_rng_order(fs: FixtureSet) -> None:
    """Optional upstream check: with torch's CPU RNG drawn in upstream's order, `sampled/y` is reproduced."""
    fx = fs.tensors()
    if "sampled/y" not in fx:
        pytest.skip("no sampled run")
    lm = loaded(fs)
    meta = fs.meta["sampled"]["params"]
    prompt = fx["prompt/full"].long()
    expected = fx["sampled/y"].long()[:, prompt.shape[1] :]

    def torch_rng(_frame: int):
        return lambda _stream, n: torch.empty(1, n).exponential_(1)

    torch.manual_seed(meta["torch_manual_seed"])
    sampling = SamplingTensors.fill(1, meta["temperature"], meta["top_p"], meta["repetition_penalty"])
    out = generate(lm.model, prompt, meta["max_new_tokens"], sampling, torch_rng, lm.tokenizer.im_end_id)
    assert torch.equal(out.frames, expected)


@pytest.mark.parametrize("kind", ["sample_step_slow", "sample_step_fast"])
@pytest.mark.parametrize("fs", SETS)
def test_single_sampling_step(fs: FixtureSet, kind: str) -> None:
    fx, meta = fs.tensors(), fs.meta[kind]
    logits = fx[f"{kind}/logits"].unsqueeze(0)
    before = logits.clone()
    probs = logits_to_probs(
        logits,
        fx[f"{kind}/previous_tokens"].long().unsqueeze(0),
        torch.tensor([meta["temperature"]]),
        torch.tensor([meta["top_p"]]),
        torch.tensor([meta["repetition_penalty"]]),
    )
    assert torch.equal(logits, before), "sampling must not modify its input logits"
    close(probs[0], fx[f"{kind}/probs"], PROBS_ATOL)
    assert int((probs[0] > 0).sum()) == int((fx[f"{kind}/probs"] > 0).sum())
    assert sample_index(probs, fx[f"{kind}/exp_noise_q"].unsqueeze(0)).item() == fx[f"{kind}/sampled_index"].item()


def test_per_row_sampling_parameters_are_independent() -> None:
    """A batch with different parameters per row equals each row sampled alone."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 300, generator=gen) * 3
    window = torch.randint(0, 300, (4, 16), generator=gen)
    q = torch.empty(4, 300).exponential_(1, generator=gen)
    t = torch.tensor([0.0, 0.3, 0.7, 1.5])
    p = torch.tensor([1.0, 0.5, 0.7, 0.1])
    rp = torch.tensor([1.0, 1.2, 1.5, 0.9])
    batched = logits_to_probs(logits, window, t, p, rp)
    for i in range(4):
        alone = logits_to_probs(logits[i : i + 1], window[i : i + 1], t[i : i + 1], p[i : i + 1], rp[i : i + 1])
        assert torch.equal(batched[i], alone[0])
    assert torch.equal(
        sample_index(batched, q), torch.stack([sample_index(batched[i : i + 1], q[i : i + 1])[0] for i in range(4)])
    )


def test_top_p_keeps_tied_tokens_up_to_the_cut_and_drops_the_rest() -> None:
    """Top-p drops a token only when the cumulative probability *through* it exceeds top_p (spec §2.3: `>`), and
    tokens of equal probability are taken in the sort's order (the lower index first for a short row).

    Four tokens share probability 1/4 exactly (the two at -50 are below float32's resolution of the sum). Sorted,
    the cumulative sums are 0.25, 0.5, 0.75, 1: at top_p 0.5 the first two tied tokens (ids 1 and 3) stay, since
    0.5 is not > 0.5, and ids 4 and 5 go; at top_p 0.49 only id 1 stays.
    """
    logits = torch.tensor([[-50.0, 0.0, -50.0, 0.0, 0.0, 0.0]])
    one = torch.tensor([1.0])
    at_half = logits_to_probs(logits, None, one, torch.tensor([0.5]), one)
    assert torch.equal(at_half, torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0, 0.0]]))
    below_half = logits_to_probs(logits, None, one, torch.tensor([0.49]), one)
    assert torch.equal(below_half, torch.tensor([[0.0, 1.0, 0.0, 0.0, 0.0, 0.0]]))


def upstream_top_p_kept(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Upstream's top-p mask on one 1-D logits vector, line for line (spec §2.3): which ids survive."""
    sorted_logits, sorted_indices = torch.sort(logits, descending=True)
    cum_probs = torch.cumsum(torch.nn.functional.softmax(sorted_logits, dim=-1), dim=-1)
    sorted_indices_to_remove = cum_probs > top_p
    sorted_indices_to_remove[0] = False
    remove = sorted_indices_to_remove.scatter(dim=0, index=sorted_indices, src=sorted_indices_to_remove)
    return ~remove


@pytest.mark.parametrize("vocab", [32, 1024, 4096])
def test_top_p_cuts_through_a_tie_exactly_where_upstream_does(vocab: int) -> None:
    """When the cut falls inside a run of equal logits, the tied ids kept are the ones upstream keeps: the order of
    torch.sort(descending=True) on the 1-D row, which is not index order for rows this long. Every row of a batch
    (the engine's and the stepper's batched sampler) keeps the same ids as that row alone in upstream's code."""
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randint(0, 3, (3, vocab), generator=gen).float() * 0.5  # three levels: long runs of ties
    top_mass = torch.softmax(logits, dim=-1).mul(logits == logits.max(dim=-1, keepdim=True).values).sum(-1)
    top_p = top_mass * torch.tensor([0.3, 0.5, 0.7])  # each cut lands inside the top run
    probs = logits_to_probs(logits, None, torch.ones(3), top_p, torch.ones(3))
    for row in range(3):
        kept = upstream_top_p_kept(logits[row], float(top_p[row]))
        top = logits[row] == logits[row].max()
        assert 1 < int(kept.sum()) < int(top.sum())  # the cut really splits the tie
        assert not torch.equal(kept, top & (top.cumsum(0) <= int(kept.sum()))), (
            "this torch keeps ties in index order: the test no longer tells a stable sort apart"
        )
        assert torch.equal(probs[row] > 0, kept)

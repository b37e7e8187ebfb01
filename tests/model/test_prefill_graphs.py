"""Prefill through padded static buffers (model.prefill_graphs: the GPU replays one CUDA graph per bucket; here the
same padded passes run eagerly) against the plain DualARTransformer.prefill_many: outputs, the KV rows written, and
no other row touched but the scratch row that padding rows use."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from model.config import DualARConfig
from model.dual_ar import DualARTransformer
from model.prefill_graphs import PREFILL_CHUNK_BUCKETS, StaticPrefill
from model.stepper import DecodeStepper
from tests.model.test_kv_cache import CONFIGS, SEMANTIC_BEGIN, assert_scaled_close, make_model, random_sequence

SCRATCH = 7  # the last of 8 rows: what padding rows gather and scatter


def stepper_pair(model: DualARTransformer, max_seq_len: int = 256) -> tuple[DecodeStepper, DecodeStepper]:
    """(plain, static) steppers over equal caches of random values (stale KV that passes read and must keep)."""
    kwargs = {"max_seq_len": max_seq_len, "length_buckets": [64, 128]}
    plain = DecodeStepper(model, 8, **kwargs)
    static = DecodeStepper(model, 8, prefill_scratch_row=SCRATCH, **kwargs)
    gen = torch.Generator().manual_seed(3)
    for cache in (plain.cache, static.cache):
        gen.manual_seed(3)
        cache.k.copy_(torch.randn(cache.k.shape, generator=gen))
        cache.v.copy_(torch.randn(cache.v.shape, generator=gen))
    return plain, static


def prefill_both(
    model: DualARTransformer, rows: list[int], lengths: list[int], starts: list[int]
) -> tuple[DecodeStepper, DecodeStepper, torch.Tensor, tuple, tuple]:
    plain, static = stepper_pair(model)
    before = torch.stack([static.cache.k, static.cache.v]).clone()
    prompts = [random_sequence(model, n, seed=70 + n) for n in lengths]
    expected = plain.prefill_many(rows, prompts, starts)
    got = static.prefill_many(rows, prompts, starts)
    return plain, static, before, expected, got


def check_cache(
    plain: DecodeStepper,
    static: DecodeStepper,
    before: torch.Tensor,
    rows: list[int],
    ends: list[int],
    close: Callable[[torch.Tensor, torch.Tensor], None],
    scratch_written: bool,
) -> None:
    """Written rows: positions [0, end) as the plain pass (`close`), none past `end` changed (position `end` holds
    padding in either pass, overwritten by the row's next write). Every other row is unchanged, bitwise, but the
    scratch row where padding rows ran."""
    after_plain = torch.stack([plain.cache.k, plain.cache.v])
    after = torch.stack([static.cache.k, static.cache.v])
    for row, end in zip(rows, ends, strict=True):
        close(after[:, :, row, :, :end], after_plain[:, :, row, :, :end])
        assert torch.equal(after[:, :, row, :, end + 1 :], before[:, :, row, :, end + 1 :]), row
    untouched = [r for r in range(8) if r not in rows and not (scratch_written and r == SCRATCH)]
    assert torch.equal(after[:, :, untouched], before[:, :, untouched])
    if scratch_written:
        assert not torch.equal(after[:, :, SCRATCH], before[:, :, SCRATCH]), "the padding rows should have run"


def bitwise(a: torch.Tensor, b: torch.Tensor) -> None:
    assert torch.equal(a, b)


@torch.no_grad()
def test_a_bucket_equal_to_the_batchs_own_shapes_is_bitwise_the_plain_pass() -> None:
    """Longest prompt 64 tokens, longest end 127: the plain pass runs (3 rows, 64 tokens, 128 positions), the static
    one the bucket (4, 64, 128): the same arithmetic plus a padding row on the scratch row, which batch-invariant
    layers keep from touching the others. Everything is bitwise equal, even the padding position past each end."""
    model = make_model("gqa_fast_project")
    model.set_batch_invariant(True)
    rows, lengths, starts = [2, 0, 5], [64, 30, 7], [0, 20, 120]
    plain, static, before, expected, got = prefill_both(model, rows, lengths, starts)
    assert static.static_prefill is not None
    assert static.static_prefill.bucket_for(lengths, [64, 50, 127]) == (4, 64, 128)
    assert torch.equal(expected[0], got[0]) and torch.equal(expected[1], got[1])
    check_cache(plain, static, before, rows, [64, 50, 127], bitwise, scratch_written=True)
    padding = [(r, e) for r, e in zip(rows, [64, 50, 127], strict=True) if e < 128]
    for row, end in padding:
        assert torch.equal(static.cache.k[:, row, :, end], plain.cache.k[:, row, :, end])


# (rows, prompt lengths, start positions): one row; three rows padded to 4 (a padding row on the scratch row); six
# rows in passes of 4 and 2; two full-chunk prompts, one ending at the last position of its attention bucket
CASES = [
    ([3], [40], [0]),
    ([2, 0, 5], [30, 64, 7], [10, 0, 100]),
    ([0, 1, 2, 3, 4, 5], [5, 10, 20, 30, 40, 64], [0, 3, 0, 9, 0, 1]),
    ([1, 6], [64, 250], [63, 5]),
    ([4], [1], [200]),
]


@pytest.mark.parametrize("invariant", [True, False], ids=["batch_invariant", "batched_matmuls"])
@pytest.mark.parametrize(("rows", "lengths", "starts"), CASES)
@torch.no_grad()
def test_static_prefill_equals_the_plain_pass(invariant: bool, rows: list[int], lengths: list[int], starts: list[int]):
    """Outputs and KV within fp32 rounding: the buckets pad the token count and the attention length, and MKL's
    GEMM sums in an order that depends on the matrix sizes (q·kᵀ changes in the last bits with the number of keys
    even when the extra keys are masked, ~1e-6 relative), so only where the padded shapes equal the plain pass's is
    the result bitwise (the test above). Rows other than those written stay bitwise untouched."""
    model = make_model("gqa_fast_project")
    model.set_batch_invariant(invariant)
    plain, static, before, expected, got = prefill_both(model, rows, lengths, starts)
    assert_scaled_close(got[0], expected[0])
    assert_scaled_close(got[1], expected[1])
    ends = [s + n for s, n in zip(starts, lengths, strict=True)]
    padding_rows = any(len(rows[i : i + 4]) not in (1, 2, 4) for i in range(0, len(rows), 4))
    check_cache(plain, static, before, rows, ends, assert_scaled_close, scratch_written=padding_rows)


def long_context_model() -> DualARTransformer:
    """gqa_fast_project with a 512-position context: room for a prompt longer than the largest chunk bucket."""
    torch.manual_seed(0)
    config = DualARConfig.from_dict({"model_type": "dual_ar", **CONFIGS["gqa_fast_project"], "max_seq_len": 512})
    model = DualARTransformer(config, SEMANTIC_BEGIN)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3 if p.dim() > 1 else 1.0)
    return model.eval()


@torch.no_grad()
def test_prompts_that_fit_no_bucket_run_the_plain_pass() -> None:
    """A prompt longer than the largest chunk (in any pass of the call) sends the whole call to the eager
    prefill_many, before anything is written; an end at the context's last position fails as the plain pass does."""
    model = long_context_model()
    too_long = PREFILL_CHUNK_BUCKETS[-1] + 44
    rows, lengths, starts = [0, 1, 2, 3, 4], [10, 20, 30, 40, too_long], [0, 0, 0, 0, 5]
    plain, static = stepper_pair(model, max_seq_len=512)
    assert static.static_prefill is not None
    passes: list[tuple[int, int, int]] = []
    run = static.static_prefill._run
    static.static_prefill._run = lambda bucket: (passes.append(bucket), run(bucket))[-1]  # type: ignore[method-assign]
    prompts = [random_sequence(model, n, seed=n) for n in lengths]
    assert static.static_prefill.prefill_many(rows, prompts, starts) is None
    assert torch.equal(static.cache.k, plain.cache.k) and torch.equal(static.cache.v, plain.cache.v)
    expected, got = plain.prefill_many(rows, prompts, starts), static.prefill_many(rows, prompts, starts)
    assert torch.equal(expected[0], got[0]) and torch.equal(expected[1], got[1])
    assert torch.equal(static.cache.k, plain.cache.k) and torch.equal(static.cache.v, plain.cache.v)
    one = random_sequence(model, too_long, seed=1)
    assert all(torch.equal(a, b) for a, b in zip(plain.prefill(6, one, 0), static.prefill(6, one, 0), strict=True))
    assert passes == []
    assert (static.eager_prefills, plain.eager_prefills) == (2, 0)  # counted for /metrics and the slow-turn log
    with pytest.raises(ValueError, match="exceeds the context"):
        static.prefill_many([0], [random_sequence(model, 12, seed=2)], [500])  # its padding would write at 512


@torch.no_grad()
def test_a_rows_bucket_of_eight_takes_seven_prompts_in_one_pass() -> None:
    """`prefill_row_buckets` up to 8 (`--prefill-max-rows 8`): seven prompts are one padded pass of 8 rows instead
    of two of 4, with the plain pass's outputs and KV (the batch's own shapes plus a padding row on the scratch row:
    bitwise, as above); the default buckets stop at 4 rows a pass."""
    model = make_model("gqa_fast_project")
    model.set_batch_invariant(True)
    kwargs = {"max_seq_len": 256, "length_buckets": [64, 128]}
    plain = DecodeStepper(model, 9, **kwargs)
    static = DecodeStepper(model, 9, prefill_scratch_row=8, prefill_row_buckets=(1, 2, 4, 8), **kwargs)
    assert static.static_prefill is not None and plain.static_prefill is None
    rows, lengths, starts = [6, 0, 3, 1, 5, 2, 4], [64, 30, 7, 12, 50, 3, 9], [0, 20, 120, 5, 63, 0, 100]
    ends = [s + n for s, n in zip(starts, lengths, strict=True)]
    assert static.static_prefill.bucket_for(lengths, ends) == (8, 64, 128)
    default = DecodeStepper(model, 9, prefill_scratch_row=8, **kwargs).static_prefill
    assert default is not None and default.bucket_for(lengths, ends) is None  # 7 rows: passes of 4 and 3
    prompts = [random_sequence(model, n, seed=90 + i) for i, n in enumerate(lengths)]
    expected = plain.prefill_many(rows, prompts, starts)
    got = static.prefill_many(rows, prompts, starts)
    assert torch.equal(expected[0], got[0]) and torch.equal(expected[1], got[1])
    for row, end in zip(rows, ends, strict=True):
        assert torch.equal(plain.cache.k[:, row, :, :end], static.cache.k[:, row, :, :end])
        assert torch.equal(plain.cache.v[:, row, :, :end], static.cache.v[:, row, :, :end])
    assert static.eager_prefills == 0  # through the static pass, not the plain fallback


def test_bucket_choice() -> None:
    """Smallest rows, chunk and attention buckets that hold the pass; the attention bucket must exceed every end
    (where padding writes), which must stay inside the context."""
    model = make_model("gqa_fast_project")  # a 256-position context
    static = StaticPrefill(model, model.make_cache(8, 256), SCRATCH, [64, 128, 256])
    assert static.bucket_for([40], [40]) == (1, 64, 64)
    assert static.bucket_for([64], [64]) == (1, 64, 128)  # position 64 takes padding when the chunk is longer
    assert static.bucket_for([65, 3, 3], [65, 100, 3]) == (4, 128, 128)
    assert static.bucket_for([256], [256]) is None  # the end (no padding here, still checked) is the context's size
    assert static.bucket_for([1, 1, 1, 1, 1], [1, 1, 1, 1, 1]) is None  # more rows than a pass holds
    assert static.bucket_for([257], [257]) is None
    assert static.bucket_for([10], [255]) == (1, 64, 256)
    assert static.bucket_for([10], [256]) is None
    short = StaticPrefill(model, model.make_cache(8, 256), SCRATCH, [64, 128])
    assert short.bucket_for([10], [127]) == (1, 64, 128) and short.bucket_for([10], [128]) is None


class ReplayedByHand:
    """A stand-in for a CUDA graph on CPU: `replay` runs the recorded pass again eagerly."""

    def __init__(self, run: Callable[[], None]) -> None:
        self.replay = run


@torch.no_grad()
def test_graphs_are_captured_lazily_and_capture_touches_only_the_scratch_row() -> None:
    """With a recorder (the stepper's `_record` on a GPU; here one that runs the pass as `_record` does and keeps it
    for replay), a bucket is captured on its first use, before that call's inputs are in the buffers, so its warm-up
    and capture runs write the scratch row only; idle capture takes the likeliest missing bucket; replays give the
    eager passes' results."""
    model = make_model("gqa_fast_project")
    recorded: list[Callable[[], None]] = []

    def record(run: Callable[[], None]) -> ReplayedByHand:
        before = torch.stack([graphed.cache.k, graphed.cache.v]).clone()
        for _ in range(3):  # two warm-up runs and the captured one
            run()
        after = torch.stack([graphed.cache.k, graphed.cache.v])
        assert torch.equal(after[:, :, :SCRATCH], before[:, :, :SCRATCH]), "a capture run wrote a stream's row"
        recorded.append(run)
        return ReplayedByHand(run)

    _, eager = stepper_pair(model)
    graphed = DecodeStepper(model, 8, max_seq_len=256, length_buckets=[64, 128])
    graphed.cache.k.copy_(eager.cache.k)
    graphed.cache.v.copy_(eager.cache.v)
    static = StaticPrefill(model, graphed.cache, SCRATCH, graphed.length_buckets, record=record)  # type: ignore[arg-type]
    assert static.missing_graphs()[:4] == [(1, 64, 64), (1, 128, 64), (1, 256, 64), (1, 64, 128)]
    assert len(static.missing_graphs()) == 3 * 3 * 3 and not static.graphs
    assert static.capture_next() and list(static.graphs) == [(1, 64, 64)]
    for rows, lengths, starts in [*CASES[:3], ([0, 5, 1], [12, 50, 33], [64, 70, 0])]:
        prompts = [random_sequence(model, n, seed=n) for n in lengths]
        expected = eager.prefill_many(rows, prompts, starts)
        got = static.prefill_many(rows, prompts, starts)
        assert got is not None
        assert torch.equal(expected[0], got[0]) and torch.equal(expected[1], got[1])
        assert torch.equal(eager.cache.k[:, :SCRATCH], graphed.cache.k[:, :SCRATCH])
        assert torch.equal(eager.cache.v[:, :SCRATCH], graphed.cache.v[:, :SCRATCH])
    # (1,64,64) by idle capture; then (1,64,64) again, (4,64,128), (4,64,64) + (2,64,128), and (4,64,128) replayed
    assert list(static.graphs) == [(1, 64, 64), (4, 64, 128), (4, 64, 64), (2, 64, 128)]
    assert len(recorded) == 4


def test_prefill_graph_bookkeeping_without_cuda_is_empty() -> None:
    """On CPU there are no graphs: nothing is missing and idle capture has nothing to do."""
    model = make_model("gqa_fast_project")
    stepper = DecodeStepper(model, 8, max_seq_len=64, use_cuda_graphs=True, prefill_scratch_row=7)  # ignored off CUDA
    assert stepper.static_prefill is not None
    assert stepper.static_prefill.missing_graphs() == [] and stepper.capture_next([0] * 8) is False

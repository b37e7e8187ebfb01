"""Backend.prefill_many: one batched pass, split into several when the scratch KV would be too large."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import streaming.backend as backend_module
from streaming.backend import Backend
from streaming.config import BackendConfig


def prompts(b: Backend) -> list[torch.Tensor]:
    return [b.segment_tokens(b.model_text(t)) for t in ("Short.", "A somewhat longer prompt here.", "Middle one.")]


def test_large_batches_are_split_and_give_the_same_result(monkeypatch) -> None:
    results = []
    for cap in (backend_module.PREFILL_SCRATCH_POSITIONS, 60):  # 60: no two of these prompts fit one pass
        monkeypatch.setattr(backend_module, "PREFILL_SCRATCH_POSITIONS", cap)
        b = Backend(BackendConfig(max_sessions=4, batch_invariant=False))
        calls: list[int] = []
        one_pass = b.stepper.prefill_many

        def counted(rows, tokens, starts, _one_pass=one_pass, _calls=calls):
            _calls.append(len(rows))
            return _one_pass(rows, tokens, starts)

        b.stepper.prefill_many = counted  # type: ignore[method-assign]
        tokens = prompts(b)
        logits, hidden = b.prefill_many([2, 0, 1], tokens, [0, 0, 0])
        # the rows' valid positions (past them a pass may leave padding, which the first decode step overwrites)
        kv = [b.stepper.cache.k[:, row, :, : t.shape[1]].clone() for row, t in zip([2, 0, 1], tokens, strict=True)]
        results.append((calls, logits, hidden, *kv))
    (calls_big, *big), (calls_small, *small) = results
    assert calls_big == [3] and calls_small == [1, 1, 1]
    for x, y in zip(big, small, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)


def test_graph_prefill_left_unset_is_off_on_cpu() -> None:
    """The default (None) means on for a GPU with CUDA graphs, off here: on a CPU the padded passes only cost."""
    backend = Backend(BackendConfig(max_sessions=2))
    assert backend.graph_prefill is False and backend.stepper.static_prefill is None


def prefill_six_both_ways(
    plain: Backend, static: Backend
) -> tuple[list[int], list[torch.Tensor], list[tuple[int, int, int]]]:
    """Six prompts into rows 5, 0, 3, 1, 4, 2 of both backends; `static`'s results must equal `plain`'s within CPU
    rounding. Returns the rows, the prompts and the (rows, chunk, length) bucket of each static pass that ran."""
    assert static.stepper.static_prefill is not None
    passes: list[tuple[int, int, int]] = []
    run = static.stepper.static_prefill._run
    static.stepper.static_prefill._run = lambda bucket, _run=run: (passes.append(bucket), _run(bucket))[-1]  # type: ignore[method-assign]
    tokens = prompts(plain) * 2
    rows = [5, 0, 3, 1, 4, 2]
    expected, got = (b.prefill_many(rows, tokens, [0] * 6) for b in (plain, static))
    for x, y in zip(expected, got, strict=True):
        torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-5)
    return rows, tokens, passes


def test_graph_prefill_gives_the_plain_prefill_within_rounding() -> None:
    """graph_prefill: the backend's calls run through the stepper's padded static passes (batched engines: passes of
    up to 4 rows; batch-invariant ones: one row at a time), equal to the plain prefill but for the last bits that the
    padded shapes change on CPU (tests/model/test_prefill_graphs.py)."""
    for invariant in (False, True):
        plain, static = (
            Backend(BackendConfig(max_sessions=6, batch_invariant=invariant, graph_prefill=on)) for on in (False, True)
        )
        assert plain.stepper.static_prefill is None
        rows, tokens, passes = prefill_six_both_ways(plain, static)
        assert len(passes) == (6 if invariant else 2)
        for row, t in zip(rows, tokens, strict=True):
            n = t.shape[1]
            torch.testing.assert_close(static.stepper.cache.k[:, row, :, :n], plain.stepper.cache.k[:, row, :, :n])


def test_the_workers_prefill_chunk_fits_the_largest_graph_chunk() -> None:
    """A chunk over the largest bucket would send every long prompt's passes to the eager prefill."""
    from model.prefill_graphs import PREFILL_CHUNK_BUCKETS
    from streaming.config import WorkerLimits

    assert WorkerLimits().prefill_chunk_tokens == PREFILL_CHUNK_BUCKETS[-1]


def test_voice_prefix_tokens_are_built_once_per_voice_and_bounded(monkeypatch) -> None:
    """A voice's prompt prefix is tokenised once and shared (the worker builds one per new session); a different
    transcript or different codes is another entry; codes the model cannot read raise every time and are not kept;
    the cache holds PREFIX_TOKENS_CACHE voices, least recently used out first."""
    monkeypatch.setattr(backend_module, "PREFIX_TOKENS_CACHE", 2)
    b = Backend(BackendConfig(max_sessions=2))
    rng = np.random.default_rng(0)
    codes = rng.integers(0, 1000, (b.info.num_codebooks, 30)).astype(np.int64)
    built: list[int] = []
    real_prefix = b.builder.prefix
    monkeypatch.setattr(b.builder, "prefix", lambda refs: built.append(1) or real_prefix(refs))
    first = b.prefix_tokens([("Hello there.", codes)])
    assert first is not None and b.prefix_tokens([("Hello there.", codes.copy())]) is first and len(built) == 1
    torch.testing.assert_close(first, real_prefix([(b.model_text("Hello there."), torch.from_numpy(codes))]))
    other_codes = codes.copy()
    other_codes[0, 0] += 1
    assert b.prefix_tokens([("Hello there.", other_codes)]) is not first
    assert b.prefix_tokens([("Hello, there.", codes)]) is not first and len(built) == 3
    assert b.prefix_tokens([("Hello there.", codes)]) is not first and len(built) == 4  # evicted (2 kept)
    bad = np.full_like(codes, 5000)
    for _ in range(2):
        with pytest.raises(ValueError, match="must lie in"):
            b.prefix_tokens([("Hello there.", bad)])
    assert len(built) == 6 and b.prefix_tokens([]) is None


@pytest.mark.parametrize("up_front", [0, 1, 2])
def test_start_up_captures_the_prefill_graphs_of_few_rows(up_front: int) -> None:
    """--prefill-graphs-up-front N: start-up captures every prefill bucket of at most N prompts (each frozen out of
    later collections like the decode graphs), so a first request's prompt replays graphs instead of capturing them
    in its turns; the larger buckets stay for idle time. On CPU a stand-in recorder runs each capture once."""
    import types

    b = Backend(
        BackendConfig(max_sessions=4, batch_invariant=False, graph_prefill=True, prefill_graphs_up_front=up_front)
    )
    static = b.stepper.static_prefill
    assert static is not None
    recorded: list[object] = []

    def record(run):
        run()
        recorded.append(run)
        return types.SimpleNamespace(replay=run)

    static._record = record  # what a GPU stepper passes it (its _record); None on CPU
    grid = [(r, c, n) for r in static.row_buckets for n in static.length_buckets for c in (64, 128, 256)]
    assert static.missing_graphs() == grid and len(grid) == 3 * 3 * len(static.length_buckets)
    b.capture_graphs()
    assert sorted(static.graphs) == sorted(bucket for bucket in grid if bucket[0] <= up_front)
    assert len(recorded) == len(static.graphs)
    assert ("capture_prefill" in b.timings_s) == (up_front > 0)
    # a one-row prompt now replays (no capture), and its result is the eager pass's
    tokens = prompts(b)[1]
    eager = Backend(BackendConfig(max_sessions=4, batch_invariant=False, graph_prefill=False))
    expected = eager.prefill_many([0], [tokens], [0])
    before = len(recorded)
    got = b.prefill_many([0], [tokens], [0])
    assert len(recorded) - before == (up_front == 0), "a one-row prompt captured at first use despite up-front graphs"
    torch.testing.assert_close(got[0], expected[0], rtol=1e-5, atol=1e-5)

"""Backend.prefill_many: one batched pass, split into several when the scratch KV would be too large."""

from __future__ import annotations

import torch

import streaming.backend as backend_module
from streaming.backend import Backend, BackendConfig


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

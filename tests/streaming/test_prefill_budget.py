"""The per-turn prefill time budget (WorkerLimits.prefill_step_share): while streams decode, a turn writes only the
prompt tokens that fit in about one decode step's time at the measured seconds per token (at least one prompt chunk),
so a burst of new prompts no longer stalls the running streams for several steps' worth at once."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence

import numpy as np
import pytest
import torch

from streaming.config import WorkerLimits
from streaming.engine import Engine
from streaming.scheduler import prefill_token_budget
from streaming.session import AudioChunk, SynthesisSettings, Voice
from tests.streaming.engine_helpers import RANDOM_TINY_MODEL, NeverEnding, collect, running_engine, speak

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


def test_the_budget_is_the_tokens_that_fit_the_time() -> None:
    assert prefill_token_budget(1024, 0.010, None) == 1024  # nothing measured yet
    assert prefill_token_budget(1024, 0.010, 1e-4) == 100
    assert prefill_token_budget(1024, 1.0, 1e-4) == 1024  # never above the token budget
    assert prefill_token_budget(1024, 0.0, 1e-4) == 1  # the caller still writes one prompt chunk
    with pytest.raises(ValueError, match="prefill_step_share"):
        WorkerLimits(prefill_step_share=0)


class RecordingPrefill(NeverEnding):
    """The real backend, recording the rows of each prefill call (frames never end: fixed lengths)."""

    calls: list[int]

    def prefill_many(
        self, rows: Sequence[int], prompts: Sequence[torch.Tensor], start_positions: Sequence[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.calls.append(len(rows))
        return super().prefill_many(rows, prompts, start_positions)


def burst_while_decoding(share: float | None) -> tuple[list[np.ndarray], list[int]]:
    """Stream A decodes; five seeded prompts arrive in one turn. Their codes, and the rows of each prefill call made
    after A started."""

    async def main(engine: Engine, backend: RecordingPrefill):
        a = engine.open_session(Voice(), SynthesisSettings(seed=1, max_new_tokens=80))
        a.speak("A long running stream that keeps decoding while the others arrive.")
        a.end_utterance()
        while not isinstance(await a.next_event(), AudioChunk):  # A is decoding
            pass
        backend.calls.clear()
        gate = threading.Event()
        held = asyncio.ensure_future(engine.run_job(lambda worker: gate.wait(10)))
        await asyncio.sleep(0.05)
        sessions = [engine.open_session(Voice(), SynthesisSettings(seed=10 + i, max_new_tokens=6)) for i in range(5)]
        pending = [asyncio.ensure_future(speak(s, f"Prompt number {i}.")) for i, s in enumerate(sessions)]
        await asyncio.sleep(0.05)
        gate.set()
        await held
        utts = await asyncio.gather(*pending)
        await collect(a)
        return [u.codes for u in utts], list(backend.calls)

    backend: list[RecordingPrefill] = []

    def factory(config):
        b = RecordingPrefill(config)
        b.calls = []
        backend.append(b)
        return b

    with running_engine(
        RANDOM_TINY_MODEL, max_sessions=6, backend_factory=factory, warm_up=False, prefill_step_share=share
    ) as engine:
        return asyncio.run(main(engine, backend[0]))


def test_a_burst_is_written_a_prompt_a_turn_when_prefill_is_slower_than_a_step() -> None:
    """With the token budget alone the five short prompts go in one call; with a time budget far under a step's
    (share 1e-6) every call writes one prompt; the seeded codes are the same either way."""
    codes_free, calls_free = burst_while_decoding(None)
    codes_timed, calls_timed = burst_while_decoding(1e-6)
    assert max(calls_free) > 1
    assert calls_timed == [1] * 5
    for a, b in zip(codes_free, codes_timed, strict=True):
        assert np.array_equal(a, b)

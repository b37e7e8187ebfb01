"""Pacing (`WorkerLimits.pace_lead_s`): while another stream needs audio soon, a stream far ahead of its client's
playback sits out turns; alone, nothing is paced. Its codes and audio are unchanged, only when they are made.

The engine runs the real tiny random-weight model and vocoder (tests/assets) on a virtual clock
(engine_helpers.virtual_clock): each decode step advances the worker's clock by 10 ms and nothing else moves it, so a
turn takes ~4.6x less than a frame's 46 ms whatever the machine's speed or load. Its frames never carry the end token
(every utterance has its full length).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence

import numpy as np
import pytest

from streaming.config import PACE_NEEDY_S, BackendConfig, WorkerLimits
from streaming.engine import Engine
from streaming.session import AudioChunk, SynthesisSettings, Voice
from tests.streaming.engine_helpers import (
    EVENT_TIMEOUT_S,
    RANDOM_TINY_MODEL,
    NeverEnding,
    VirtualClock,
    collect,
    running_engine,
    virtual_clock,
)
from tests.streaming.test_engine import offline_decode

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")

SR = 44100
LEAD_S = 1.0
TEXT_A = "The first speaker has a long story to tell, and it goes on for quite a while before it ends."
TEXT_B = "A newcomer joins."
STEP_S = 0.01  # virtual seconds per decode step
# The step that waits until the test has had its 3 s of A's audio (88 frames: chunks 4, 4, 8, 8, 16, 24, 24) and
# queued B's text: A is still decoding when B arrives, however slowly the test's thread runs.
HOLD_AT_STEP = 100


class SteadyNeverEnding(NeverEnding):
    """Steps of STEP_S on the worker's virtual clock; records each step's rows and how many of them advanced. Step
    HOLD_AT_STEP waits for `go`."""

    def __init__(self, config: BackendConfig, clock: VirtualClock) -> None:
        super().__init__(config)
        self.clock = clock
        self.go = threading.Event()
        self.steps: list[tuple[int, int]] = []  # (rows, rows that advanced)

    def step(self, rows: int, commit: Sequence[bool], max_pos: int, while_running=None) -> np.ndarray:
        if len(self.steps) == HOLD_AT_STEP:
            self.go.wait(EVENT_TIMEOUT_S)
        self.clock.advance(STEP_S)
        self.steps.append((rows, sum(commit)))
        return super().step(rows, commit, max_pos, while_running)


async def a_then_newcomer(engine: Engine, frames_a: int, newcomer: bool):
    """A (seeded) speaks; once its client is well ahead (3 s of audio received), B (seeded) arrives (its text queued
    before A's decoding goes past HOLD_AT_STEP)."""
    a = engine.open_session(Voice(), SynthesisSettings(seed=3, max_new_tokens=frames_a))
    a.speak(TEXT_A)
    a.end_utterance()
    pcm, received_s = [], 0.0
    b_task = None
    while received_s < 3.0:
        ev = await asyncio.wait_for(a.next_event(), 60)
        assert isinstance(ev, AudioChunk), ev
        pcm.append(ev.pcm)
        received_s += len(ev.pcm) / SR
    if newcomer:
        b = engine.open_session(Voice(), SynthesisSettings(seed=5, max_new_tokens=40))
        b.speak(TEXT_B)
        b.end_utterance()
        b_task = asyncio.ensure_future(collect(b))
    assert engine._worker is not None
    engine._worker.b.go.set()  # type: ignore[attr-defined]
    rest = await collect(a)
    utt_a = rest
    utt_a.pcm = np.concatenate([*pcm, rest.pcm])
    utt_b = await b_task if b_task is not None else None
    return utt_a, utt_b


def run(pace_lead_s: float | None, newcomer: bool, frames_a: int = 200):
    with (
        virtual_clock() as clock,
        running_engine(
            RANDOM_TINY_MODEL, max_sessions=2, backend_factory=lambda config: SteadyNeverEnding(config, clock),
            warm_up=False, pace_lead_s=pace_lead_s,
        ) as engine,
    ):  # fmt: skip
        utt_a, utt_b = asyncio.run(a_then_newcomer(engine, frames_a, newcomer))
        worker = engine._worker
        return utt_a, utt_b, worker.stats, list(worker.b.steps)


def test_a_stream_far_ahead_sits_out_while_a_newcomer_starts_and_nothing_else_changes() -> None:
    """A is ~4.6x faster than real time, so 3 s of audio in it is > 1 s ahead of playback: while B's prompt is written
    and B has under PACE_NEEDY_S of audio, A's row computes and discards. Without pacing every row advances every
    step. A's and B's codes are the same either way (seeded; CPU rows are batch-invariant) and their audio is the
    offline decode of their codes."""
    paced_a, paced_b, paced, paced_steps = run(LEAD_S, newcomer=True)
    plain_a, plain_b, plain, plain_steps = run(None, newcomer=True)
    assert paced.paced_rows > 0 and paced.paced_turns > 0
    assert any(rows == 2 and advanced == 1 for rows, advanced in paced_steps), paced_steps
    assert plain.paced_rows == 0 and all(rows == advanced for rows, advanced in plain_steps)
    for paced_utt, plain_utt in ((paced_a, plain_a), (paced_b, plain_b)):
        assert paced_utt is not None and plain_utt is not None
        assert paced_utt.done is not None and paced_utt.done.reason == "stop" and not paced_utt.errors
        assert np.array_equal(paced_utt.codes, plain_utt.codes)
        assert np.abs(paced_utt.pcm - offline_decode(RANDOM_TINY_MODEL, paced_utt.codes)).max() <= 1e-4
    assert paced_a.codes.shape[1] >= 100 and paced_b is not None and paced_b.codes.shape[1] >= 20


def test_a_lone_stream_is_never_paced() -> None:
    """Nobody needs audio sooner: A runs ahead at full speed (a batch request alone is not slowed)."""
    utt_a, _, stats, steps = run(LEAD_S, newcomer=False, frames_a=120)
    assert utt_a.done is not None and utt_a.codes.shape[1] == 120
    assert stats.paced_rows == 0 and all(rows == advanced for rows, advanced in steps)


def test_a_lead_inside_the_needy_band_is_refused() -> None:
    with pytest.raises(ValueError, match="pace_lead_s must be above"):
        WorkerLimits(pace_lead_s=PACE_NEEDY_S)

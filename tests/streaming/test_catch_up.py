"""Catch-up (`WorkerLimits.catch_up_steps`): a stream with under PACE_NEEDY_S of audio ahead of its client takes extra
decode steps in the turn, in the small batch of the first `catch_up_rows` rows, where it is swapped first. A newcomer's
first chunk is then decoded in the turn its prompt is written. Codes and audio are unchanged, only when frames are made.

The engine runs the real tiny random-weight model and vocoder (tests/assets); its steps sleep 3 ms a row so that the
streams already running are far ahead of their clients when the newcomer arrives, and never emit the end token.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import numpy as np
import pytest

from streaming.engine import Engine
from streaming.rows import RowTable
from streaming.session import AudioChunk, SynthesisSettings, Voice
from streaming.worker import WorkerLimits, catch_up_steps_for
from tests.streaming.engine_helpers import RANDOM_TINY_MODEL, NeverEnding, collect, running_engine, speak
from tests.streaming.test_engine import offline_decode

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")

SR = 44100
TEXT_OLD = "The first speakers have long stories to tell, and they go on for quite a while before they end."
TEXT_NEW = "A newcomer joins."


class RecordedSteps(NeverEnding):
    """Records every step: (the worker's turn, rows, sessions of the rows that advanced)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.worker = None  # set by the test once the engine runs
        self.steps: list[tuple[int, int, list[int]]] = []

    def step(self, rows: int, commit: Sequence[bool], max_pos: int, while_running=None) -> np.ndarray:
        time.sleep(0.003 * rows)
        w = self.worker
        if w is not None:
            owners = w.rows.owner[:rows]
            self.steps.append((w.stats.turns, rows, [owners[r] for r in range(rows) if commit[r]]))
        return super().step(rows, commit, max_pos, while_running)


async def two_running_then_newcomer(engine: Engine):
    """Two seeded streams run until each client holds 3 s of audio (well ahead of playback), then a seeded newcomer
    arrives; returns the three utterances and the newcomer's session id."""
    old = [engine.open_session(Voice(), SynthesisSettings(seed=s, max_new_tokens=160)) for s in (3, 4)]
    for s in old:
        s.speak(TEXT_OLD)
        s.end_utterance()
    heads: list[list[np.ndarray]] = [[], []]
    for i, s in enumerate(old):
        while sum(len(p) for p in heads[i]) < 3 * SR:
            ev = await asyncio.wait_for(s.next_event(), 60)
            assert isinstance(ev, AudioChunk), ev
            heads[i].append(ev.pcm)
    new = engine.open_session(Voice(), SynthesisSettings(seed=5, max_new_tokens=40))
    heard_new = await speak(new, TEXT_NEW)
    utts = []
    for i, s in enumerate(old):
        rest = await collect(s)
        rest.pcm = np.concatenate([*heads[i], rest.pcm])
        utts.append(rest)
    return [*utts, heard_new], new.id


def run(catch_up_steps: int):
    with running_engine(
        RANDOM_TINY_MODEL, max_sessions=3, backend_factory=RecordedSteps, warm_up=False,
        catch_up_steps=catch_up_steps, catch_up_rows=1, pace_lead_s=None,
    ) as engine:  # fmt: skip
        engine._worker.b.worker = engine._worker
        utts, new_id = asyncio.run(two_running_then_newcomer(engine))
        return utts, new_id, engine._worker.stats, list(engine._worker.b.steps)


def test_a_newcomers_first_chunk_is_decoded_in_the_turn_its_prompt_is_written() -> None:
    """The newcomer opens at the third row, outside the one catch-up row: it is swapped into row 0 (the old stream
    there is far ahead, not needy) and its frames 2-4 (the first comes with the prompt) are all made in one turn,
    by the full step and two one-row catch-up steps. Without catch-up they take three turns. Every stream's codes are
    the same either way (seeded; CPU rows are batch-invariant) and its audio is the offline decode of its codes."""
    fast, new_id, fast_stats, fast_steps = run(catch_up_steps=2)
    plain, plain_new_id, plain_stats, plain_steps = run(catch_up_steps=0)

    def turns_of_first_frames(steps, sid) -> list[int]:
        return [turn for turn, _, advanced in steps if sid in advanced][:3]

    fast_turns = turns_of_first_frames(fast_steps, new_id)
    assert len(fast_turns) == 3 and len(set(fast_turns)) == 1, fast_turns
    assert len(set(turns_of_first_frames(plain_steps, plain_new_id))) == 3
    catch_up = [(rows, advanced) for _, rows, advanced in fast_steps if rows == 1 and advanced == [new_id]]
    assert len(catch_up) >= 2, "the newcomer was not stepped alone in the one catch-up row"
    assert fast_stats.catch_up_moves >= 1 and fast_stats.catch_up_steps >= 2 and fast_stats.catch_up_frames >= 2
    assert plain_stats.catch_up_steps == plain_stats.catch_up_moves == 0
    for a, b in zip(fast, plain, strict=True):
        assert a.done is not None and a.done.reason == "stop" and not a.errors
        assert np.array_equal(a.codes, b.codes)
        assert np.abs(a.pcm - offline_decode(RANDOM_TINY_MODEL, a.codes)).max() <= 1e-4
    assert min(u.codes.shape[1] for u in fast) >= 20  # well past the first chunk (4 frames)


def test_only_a_batch_invariant_gpu_engine_never_catches_up() -> None:
    """A batch-invariant GPU engine runs one fixed batch for every step: a catch-up step would cost a full one. On
    CPU (batch-invariant by default) steps run exactly their rows, so it catches up (the test above)."""
    limits = WorkerLimits(catch_up_steps=3)
    assert catch_up_steps_for(limits, batch_invariant=True, device_type="cuda") == 0
    assert catch_up_steps_for(limits, batch_invariant=False, device_type="cuda") == 3
    assert catch_up_steps_for(limits, batch_invariant=True, device_type="cpu") == 3


def test_only_decoding_rows_trade_places_and_the_limits_are_checked() -> None:
    rows = RowTable(5)
    for sid in (10, 11, 12):
        rows.open(sid)
    rows.activate(10)
    rows.activate(11)
    assert rows.exchange(0, 1) == [(0, 1)] and rows.row[10] == 1 and rows.row[11] == 0
    rows.check()
    with pytest.raises(ValueError, match="must both be decoding"):
        rows.exchange(0, 2)
    for bad in ({"catch_up_steps": -1}, {"catch_up_steps": 9}, {"catch_up_rows": 0}):
        with pytest.raises(ValueError, match="catch_up_steps must be"):
            WorkerLimits(**bad)

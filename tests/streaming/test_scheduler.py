"""The scheduler on its own: pure Python (no torch), and its policies decided from stream state alone."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from streaming.chunking import ChunkSchedule, Latency, refill_size
from streaming.config import WorkerLimits
from streaming.scheduler import Scheduler
from streaming.session import Session, SynthesisSettings, Voice
from streaming.stream_state import Phase, Stream

RATE = 44_100
FRAME_S = 2048 / RATE


def test_importing_the_scheduler_imports_no_torch() -> None:
    code = "import sys, streaming.scheduler; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


@pytest.fixture
def loop():
    loop = asyncio.new_event_loop()
    loop.close()  # sessions' loops are never run here
    return loop


def decoding(loop, buffered_s: float, *, now: float, latency: Latency = Latency.NORMAL, seed=None) -> Stream:
    session = Session(Voice(), SynthesisSettings(latency=latency, seed=seed), lambda _: None, loop)
    st = Stream(session, slot=0, seed=1, schedule=ChunkSchedule((4, 8, 16)), prefix=None, phase=Phase.DECODE)
    st.utterance_samples, st.utterance_started_s = int(buffered_s * RATE), now
    return st


def scheduler(**limits) -> Scheduler:
    return Scheduler(WorkerLimits(**limits), frame_s=FRAME_S, rate_hz=RATE, batch_invariant=False)


def test_pacing_holds_back_streams_far_ahead_only_while_another_needs_audio(loop) -> None:
    s = scheduler(pace_lead_s=1.5)
    ahead, needy, middle = (decoding(loop, b, now=10.0) for b in (3.0, 0.2, 1.0))
    plan = s.plan_step([ahead, needy, middle], prompts_queued=False, now=10.0)
    assert plan.commit == [False, True, True] and plan.paced == 1
    plan = s.plan_step([ahead, middle], prompts_queued=False, now=10.0)  # nobody needy: nobody paced
    assert plan.commit == [True, True] and plan.paced == 0
    plan = s.plan_step([ahead, middle], prompts_queued=True, now=10.0)  # a prompt waiting is needy
    assert plan.commit == [False, True]
    assert scheduler(pace_lead_s=None).plan_step([ahead, needy], False, 10.0).commit == [True, True]


def test_back_pressure_stalls_then_times_out_a_client_that_reads_nothing(loop) -> None:
    s = scheduler(max_undelivered_s=1.0, stall_timeout_s=5.0, pace_lead_s=None)
    st = decoding(loop, 0.5, now=0.0)
    st.session.posted_samples = 2 * RATE  # 2 s posted and unread, over the 1 s limit
    plan = s.plan_step([st], prompts_queued=False, now=1.0)
    assert plan.commit == [False] and plan.nap and not plan.timed_out
    plan = s.plan_step([st], prompts_queued=False, now=6.5)
    assert [(t, round(sec, 1)) for t, sec in plan.timed_out] == [(st, 5.5)]
    st.session.consumed_samples = 2 * RATE  # it read: it steps again, and its stall clock is reset
    assert s.plan_step([st], prompts_queued=False, now=7.0).commit == [True] and st.stalled_since is None


def test_chunks_follow_the_schedule_and_refills_go_to_the_driest_clients_first(loop) -> None:
    s = scheduler(refill_below_s=0.15, max_refills_per_turn=1)
    full = decoding(loop, 1.0, now=5.0)
    full.vocoder_queue = [object()] * 4  # its first scheduled chunk (4 frames) is queued
    dry, drier = decoding(loop, 0.1, now=5.0), decoding(loop, 0.05, now=5.0)
    for st in (dry, drier):
        st.chunk_index = 2  # scheduled 16, only 5 queued
        st.vocoder_queue = [object()] * 5
    plan = s.plan_vocode([full, dry, drier], now=5.0)
    assert [(st, size, advance) for st, size, advance in plan.chunks] == [
        (full, 4, True),
        (drier, refill_size(5), False),
    ]
    assert plan.refills == 1
    seeded = decoding(loop, 0.05, now=5.0, seed=7)  # seeded streams never get refills (their audio is fixed)
    seeded.chunk_index, seeded.vocoder_queue = 2, [object()] * 5
    assert scheduler(refill_below_s=0.15).plan_vocode([seeded], now=5.0).chunks == []


def test_prompt_budget_takes_whole_chunks_in_queue_order(loop) -> None:
    import torch

    from streaming.stream_state import PrefillJob

    s = scheduler(prefill_chunk_tokens=64, prefill_tokens_per_turn=128, prefill_hold_below_s=None)
    queued = []
    for n in (100, 30, 64):
        st = decoding(loop, 0.0, now=0.0)
        st.phase, st.prefill = Phase.PREFILL, PrefillJob(torch.zeros((5, n), dtype=torch.int32), 0)
        queued.append(st)
    plan = s.plan_prefill(queued, queued, active_rows=0, now=0.0)
    assert [take for _, take in plan.batch] == [64, 30]  # 64 + 30 fit 128; the third chunk would not
    assert not plan.held


def test_tails_beyond_the_cap_wait_and_the_driest_go_first(loop) -> None:
    s = scheduler(max_tails_per_turn=2)
    streams = [decoding(loop, b, now=1.0) for b in (0.9, 0.1, 0.5)]
    assert s.plan_tails(streams, now=1.0) == [streams[1], streams[2]]
    assert scheduler(max_tails_per_turn=None).plan_tails(streams, now=1.0) == streams

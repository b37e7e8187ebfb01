"""A pool of engines without engines: the pure routing choices (streaming.engine_link.routing), engine addresses and
tokens, and EnginePool's admission and state over stand-in links. The pool over real engine processes:
tests/server/test_engine_pool.py."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
from pathlib import Path
from typing import Any

import pytest

from streaming.engine_api import EngineState, ModelInfo
from streaming.engine_link.address import TcpAddress, UnixAddress, is_loopback, parse_address, parse_addresses
from streaming.engine_link.auth import token_matches
from streaming.engine_link.pool import EnginePool
from streaming.engine_link.routing import Candidate, pool_state, rank, same_model, total_stats
from streaming.engine_link.sockets import CannotListen, listen
from streaming.errors import AdmissionDeferred, EngineUnavailable, Overloaded, UnknownVoice
from streaming.session import SynthesisSettings, Voice

MODEL = ModelInfo("m", False, None, 44_100, 2048, 8, 1024, "cuda:0", "bfloat16")


# ---- routing ---------------------------------------------------------------------------------------------------------
def test_rank_prefers_headroom_then_fewer_of_this_gateways_sessions_then_chance() -> None:
    rng = random.Random(0)
    got = rank([Candidate("a", 1, 0), Candidate("b", 5, 9), Candidate("c", 5, 2), Candidate("d", 0, 0)], rng)
    assert got == ["c", "b", "a", "d"]
    firsts = {rank([Candidate("a", 3, 1), Candidate("b", 3, 1)], rng)[0] for _ in range(50)}
    assert firsts == {"a", "b"}  # a tie is broken by chance, not by name
    assert rank([], rng) == []


@pytest.mark.parametrize(
    ("states", "expected"),
    [
        ([EngineState.UNAVAILABLE, EngineState.READY, EngineState.STARTING], EngineState.READY),
        ([EngineState.UNAVAILABLE, EngineState.STARTING, EngineState.DRAINING], EngineState.STARTING),
        ([EngineState.UNAVAILABLE, EngineState.DRAINING], EngineState.DRAINING),
        ([EngineState.UNAVAILABLE, EngineState.STOPPED], EngineState.UNAVAILABLE),
        ([], EngineState.UNAVAILABLE),
    ],
)
def test_the_pools_state_is_its_most_telling_engines(states, expected) -> None:
    assert pool_state(states) is expected


def test_the_same_model_on_another_device_is_the_same_model() -> None:
    assert same_model(MODEL, dataclasses.replace(MODEL, device="cuda:1"))
    assert not same_model(MODEL, dataclasses.replace(MODEL, name="other"))
    assert not same_model(MODEL, dataclasses.replace(MODEL, max_seq_len=4096))


def test_totals_sum_counters_and_keep_the_largest_average_or_maximum() -> None:
    totals = total_stats({
        "a": {"state": "ready", "sessions": 2, "first_audio_wait_seconds": 0.5, "turn_avg_seconds": 0.01,
              "startup_total_seconds": 3.0, "behind_real_time": 0},
        "b": {"state": "ready", "sessions": 3, "first_audio_wait_seconds": 0.25, "turn_avg_seconds": 0.03,
              "startup_total_seconds": 2.0, "behind_real_time": 1},
    })  # fmt: skip
    assert totals == {"sessions": 5, "first_audio_wait_seconds": 0.75, "turn_avg_seconds": 0.03,
                      "startup_total_seconds": 3.0, "behind_real_time": 1}  # fmt: skip


# ---- addresses and tokens --------------------------------------------------------------------------------------------
def test_addresses_parse_and_print_back() -> None:
    for text, address in [
        ("unix:/run/fishgate/engine.sock", UnixAddress(Path("/run/fishgate/engine.sock"))),
        ("tcp:10.0.0.7:7000", TcpAddress("10.0.0.7", 7000)),
        ("tcp:gpu-3.internal:0", TcpAddress("gpu-3.internal", 0)),
        ("tcp:[::1]:7000", TcpAddress("::1", 7000)),
    ]:
        assert parse_address(text) == address and str(address) == text
    for bad in ("", "unix:", "/run/engine.sock", "tcp:host", "tcp::7000", "tcp:::1:7000", "tcp:h:70000", "tcp:h:x"):
        with pytest.raises(ValueError, match=r"unix:PATH .* or tcp:HOST:PORT"):
            parse_address(bad)
    assert parse_addresses("tcp:a:1, tcp:b:2") == [TcpAddress("a", 1), TcpAddress("b", 2)]


def test_loopback_addresses_and_tokens() -> None:
    assert is_loopback(TcpAddress("127.0.0.1", 1)) and is_loopback(TcpAddress("::1", 1))
    assert is_loopback(TcpAddress("localhost", 1)) and is_loopback(UnixAddress(Path("/x")))
    assert not is_loopback(TcpAddress("0.0.0.0", 1)) and not is_loopback(TcpAddress("10.1.2.3", 1))
    assert token_matches(None, None) and token_matches(None, "anything")
    assert token_matches("s3cret", "s3cret")
    assert not token_matches("s3cret", "s3cre") and not token_matches("s3cret", None) and not token_matches("s", 7)


def test_listening_beyond_loopback_needs_a_token_and_a_taken_port_is_refused() -> None:
    with pytest.raises(CannotListen, match="needs a token: set FISHGATE_ENGINE_TOKEN"):
        listen(TcpAddress("0.0.0.0", 0))
    first = listen(TcpAddress("127.0.0.1", 0))
    try:
        port = first.getsockname()[1]
        with pytest.raises(CannotListen, match=f"tcp:127.0.0.1:{port} is in use"):
            listen(TcpAddress("127.0.0.1", port), token="t")
    finally:
        first.close()
    listen(TcpAddress("0.0.0.0", 0), token="t").close()


# ---- EnginePool over stand-in links ----------------------------------------------------------------------------------
@dataclasses.dataclass
class StandIn:
    """What EnginePool reads of a RemoteEngine; `answer` is what its admit does."""

    address: str
    headroom: int = 4
    open_sessions: int = 0
    info: ModelInfo | None = MODEL
    state: EngineState = EngineState.READY
    capacity: int = 8
    answer: BaseException | None = None
    asked: list[float | None] = dataclasses.field(default_factory=list)

    @property
    def ready(self) -> bool:
        return self.state is EngineState.READY

    async def admit(self, voice: Voice, settings: SynthesisSettings, wait_s: float | None = None) -> Any:
        self.asked.append(wait_s)
        if self.answer is not None:
            raise self.answer
        self.open_sessions += 1
        return self.address

    def stats(self) -> dict[str, Any]:
        return {"state": self.state.value, "sessions": self.open_sessions, "headroom": self.headroom}

    def gpu_memory_bytes(self) -> int:
        return 1


def pool_of(*stand_ins: StandIn) -> EnginePool:
    pool = EnginePool()
    pool._engines = {s.address: s for s in stand_ins}  # type: ignore[assignment]
    return pool


def admit(pool: EnginePool, wait_s: float | None = None) -> Any:
    return asyncio.run(pool.admit(Voice(), SynthesisSettings(), wait_s))


def test_a_session_goes_to_the_most_headroom_and_a_refusal_passes_it_on() -> None:
    a, b, c = StandIn("a", headroom=1), StandIn("b", headroom=6), StandIn("c", headroom=3)
    pool = pool_of(a, b, c)
    assert admit(pool) == "b" and b.asked == [0.0]
    b.answer = Overloaded("all 8 sessions are in use")
    assert admit(pool) == "c" and c.asked == [0.0]
    c.answer = EngineUnavailable("gone")
    assert admit(pool) == "a"


def test_the_pool_refuses_only_when_every_engine_has_and_says_overloaded() -> None:
    a, b = StandIn("a", answer=Overloaded("a is full")), StandIn("b", headroom=9, answer=EngineUnavailable("gone"))
    with pytest.raises(Overloaded, match="a is full") as refused:
        admit(pool_of(a, b))
    assert refused.value.code == "overloaded" and a.asked == b.asked == [0.0]


def test_when_engines_only_deferred_it_waits_on_the_best_of_them() -> None:
    a = StandIn("a", headroom=1, answer=AdmissionDeferred("behind real time"))
    b = StandIn("b", headroom=0, answer=Overloaded("full"))
    with pytest.raises(AdmissionDeferred):
        admit(pool_of(a, b), wait_s=2.0)
    assert a.asked == [0.0, 2.0] and b.asked == [0.0]
    a.asked.clear()
    with pytest.raises(AdmissionDeferred):
        admit(pool_of(a, b), wait_s=0)
    assert a.asked == [0.0]  # no wait asked: no second try


def test_a_request_error_is_not_tried_elsewhere() -> None:
    a, b = StandIn("a", headroom=5, answer=UnknownVoice("no such voice")), StandIn("b")
    with pytest.raises(UnknownVoice):
        admit(pool_of(a, b))
    assert b.asked == []


def test_a_lone_ready_engine_gets_the_callers_wait_and_an_empty_pool_is_unavailable() -> None:
    a, b = StandIn("a"), StandIn("b", state=EngineState.UNAVAILABLE)
    assert admit(pool_of(a, b), wait_s=3.0) == "a" and a.asked == [3.0]
    with pytest.raises(EngineUnavailable):
        admit(EnginePool())


def test_an_engine_serving_another_model_is_logged_once_and_never_routed(caplog) -> None:
    a, b = StandIn("a", headroom=1), StandIn("b", headroom=8, info=dataclasses.replace(MODEL, name="other"))
    pool = pool_of(a, b)
    with caplog.at_level(logging.ERROR, logger="streaming.engine_link.pool"):
        assert [admit(pool) for _ in range(3)] == ["a", "a", "a"]
        assert pool.engines_ready == 1 and pool.info == MODEL and pool.stats()["engines"]["b"]["model_refused"] == 1
    assert len([r for r in caplog.records if "serves another model" in r.getMessage()]) == 1


def test_the_pools_state_stats_and_readiness() -> None:
    a, b = StandIn("a", open_sessions=2), StandIn("b", state=EngineState.STARTING, headroom=0)
    pool = pool_of(a, b)
    assert pool.state is EngineState.READY and pool.ready and pool.capacity == 8 and pool.open_sessions == 2
    stats = pool.stats()
    assert stats["sessions"] == 2 and stats["engines_ready"] == 1 and stats["engines_total"] == 2
    assert stats["engines"]["a"]["ready"] == 1 and stats["engines"]["b"] == {
        "state": "starting", "sessions": 0, "headroom": 0, "ready": 0, "model_refused": 0}  # fmt: skip
    a.state = EngineState.UNAVAILABLE
    assert pool.state is EngineState.STARTING and not pool.ready
    pool._draining = True
    b.state = EngineState.READY
    assert pool.state is EngineState.DRAINING

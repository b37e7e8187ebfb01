"""server/engine_replicas.py without a cluster: the directory's table (heartbeats, expiry, its bound, the wanted count)
and what a gateway reports of its pool's engines (/engines, fishgate_engine_replica_info)."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest

from server import engine_replicas
from server.engine_replicas import DirectoryTable, EngineEntry, ReplicaInfo, summary


def entry(rank: int, port: int | None = None, world_size: int = 2) -> EngineEntry:
    port = port or 9000 + rank
    return EngineEntry(f"tcp:10.0.0.1:{port}", f"r{port}", rank, world_size, "10.0.0.1", 100 + port)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_entries_expire_without_a_heartbeat_and_come_back_with_one() -> None:
    clock = Clock()
    table = DirectoryTable(ttl_s=3.5, clock=clock)
    table.register(entry(0))
    table.register(entry(1))
    assert [e.rank for e in table.entries()] == [0, 1] and table.expected == 2
    clock.now = 3.0
    table.register(entry(1))  # its heartbeat; rank 0 was killed
    clock.now = 4.0
    assert [e.rank for e in table.entries()] == [1]
    assert table.expected == 2  # the deployment still wants two
    table.register(entry(0, port=9100))  # the replacement: the freed rank, a new address
    assert [(e.rank, e.address) for e in table.entries()] == [(0, "tcp:10.0.0.1:9100"), (1, "tcp:10.0.0.1:9001")]
    table.withdraw("tcp:10.0.0.1:9100")  # drained and gone
    assert [e.rank for e in table.entries()] == [1]


def test_the_table_is_bounded_and_drops_the_longest_silent(monkeypatch) -> None:
    monkeypatch.setattr(engine_replicas, "MAX_ENTRIES", 3)
    table = DirectoryTable(clock=Clock())
    for port in (1, 2, 3):
        table.register(entry(0, port=port))
    table.register(entry(0, port=1))  # heard again: now the newest
    table.register(entry(0, port=4))
    assert sorted(e.address for e in table.entries()) == ["tcp:10.0.0.1:1", "tcp:10.0.0.1:3", "tcp:10.0.0.1:4"]


def test_an_entry_round_trips_through_its_fields_and_ignores_unknown_ones() -> None:
    e = entry(1)
    assert EngineEntry.of({**asdict(e), "added_later": True}) == e


class Remote:
    def __init__(self, capacity: int, headroom: int) -> None:
        self.capacity, self.headroom = capacity, headroom


class Pool:
    def __init__(self, per_engine: dict[str, dict[str, Any]]) -> None:
        self.per_engine = per_engine
        self.engines = {a: Remote(8, 8 - s.get("sessions", 0)) for a, s in per_engine.items()}

    def stats(self) -> dict[str, Any]:
        return {"sessions": 3, "engines": self.per_engine}


FIRST_AUDIO = {"first_audio_utterances": 4, "first_audio_wait_seconds": 0.1, "first_audio_prefill_seconds": 0.2,
               "first_audio_decode_seconds": 0.1}  # fmt: skip


def test_the_summary_joins_the_directory_with_each_engine_figures() -> None:
    a, b = entry(0), entry(1)
    pool = Pool({
        a.address: {"state": "ready", "ready": 1, "sessions": 3, "gateway_sessions": 2, **FIRST_AUDIO},
        b.address: {"state": "engine_unavailable", "ready": 0},
        "tcp:10.0.0.9:1": {"state": "ready", "ready": 1},  # linked, no longer listed
    })  # fmt: skip
    doc = summary([b, a], pool, expected=2)
    assert doc["expected"] == 3 and doc["ready"] == 2
    first, second, unlisted = doc["engines"]
    assert (first["rank"], first["streams"], first["gateway_streams"], first["headroom"]) == (0, 3, 2, 5)
    assert first["first_audio_mean_ms"] == 100.0 and first["pid"] == a.pid
    assert (second["rank"], second["ready"], second["first_audio_mean_ms"]) == (1, False, None)
    assert unlisted == {**unlisted, "address": "tcp:10.0.0.9:1", "ready": True} and "rank" not in unlisted


def test_the_info_series_names_each_listed_engine_by_its_address() -> None:
    a, b = entry(0), entry(1)
    registry = CollectorRegistry()
    registry.register(ReplicaInfo(lambda: [a, b]))
    text = generate_latest(registry).decode()
    for e in (a, b):  # labels come out sorted
        labels = f'engine="{e.address}",node="10.0.0.1",pid="{e.pid}",rank="{e.rank}",replica="{e.replica_id}"'
        assert f"fishgate_engine_replica_info{{{labels}}} 1.0" in text

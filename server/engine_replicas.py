"""Engine replicas as fishgate's Ray Serve deployment sees them (server.ray_serve), in plain Python: the directory's
table of their link addresses (each registered by a heartbeat, expired ENTRY_TTL_S after its last), and what a
gateway reports of them: the `/engines` summary and `fishgate_engine_replica_info`, which names each engine's
replica, rank, node and pid for the per-engine figures every pool gateway has (fishgate_engine_replica, server.gateway).

Imports no Ray (the deployments do): tested without a cluster. A gateway's per-replica figures come from its pool's
links (streaming.engine_link.pool): each engine's counters as of its last STATS, at most a second old.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from prometheus_client.core import GaugeMetricFamily, Metric

# An engine replica registers every HEARTBEAT_S; the directory forgets it after this long without one (three missed
# heartbeats): a replica killed without a goodbye leaves the gateways' pools within it (its sessions ended already,
# when its link dropped).
HEARTBEAT_S = 1.0
ENTRY_TTL_S = 3.5
# The directory keeps at most this many engines (a runaway of registrations cannot grow it); the oldest go first.
MAX_ENTRIES = 1024
FIRST_AUDIO_PARTS = ("first_audio_wait_seconds", "first_audio_prefill_seconds", "first_audio_decode_seconds")


@dataclass(frozen=True, slots=True)
class EngineEntry:
    """One engine replica as it registers itself: where its link listens and who it is."""

    address: str  # tcp:HOST:PORT of its engine link
    replica_id: str  # Ray Serve's replica id: unique, a restarted replica gets a new one
    rank: int  # Serve's rank of the replica among the deployment's (0 … world_size-1 once settled)
    world_size: int  # how many engine replicas the deployment wants
    node_ip: str
    pid: int
    draining: bool = False  # finishing its running utterances before it stops (a rolling upgrade, a scale-down)

    @staticmethod
    def of(fields: Mapping[str, Any]) -> EngineEntry:
        return EngineEntry(**{k: fields[k] for k in EngineEntry.__dataclass_fields__ if k in fields})


class DirectoryTable:
    """The directory's state: address → (entry, when it last registered). Not thread-safe: one event loop owns it."""

    def __init__(self, ttl_s: float = ENTRY_TTL_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self.clock = clock
        self._entries: dict[str, tuple[EngineEntry, float]] = {}
        self._world_size = 0

    def register(self, entry: EngineEntry) -> None:
        self._entries.pop(entry.address, None)  # re-inserted: the dict's order is the order of last registration
        self._entries[entry.address] = (entry, self.clock())
        self._world_size = entry.world_size
        while len(self._entries) > MAX_ENTRIES:
            del self._entries[next(iter(self._entries))]

    def withdraw(self, address: str) -> None:
        self._entries.pop(address, None)

    def entries(self) -> list[EngineEntry]:
        """The live entries (registered within the TTL), by rank; expired ones are dropped here."""
        now = self.clock()
        for address in [a for a, (_, seen) in self._entries.items() if now - seen > self.ttl_s]:
            del self._entries[address]
        return sorted((entry for entry, _ in self._entries.values()), key=lambda e: (e.rank, e.replica_id))

    @property
    def expected(self) -> int:
        """Engine replicas the deployment wants, as the last one to register said (0 before any has)."""
        return self._world_size


class _Pool(Protocol):
    """What the figures read of a gateway's pool (streaming.engine_link.pool.EnginePool)."""

    @property
    def engines(self) -> Mapping[str, Any]: ...  # address → RemoteEngine (its `capacity` and `headroom`)

    def stats(self) -> dict[str, Any]: ...  # with "engines": address → that engine's counters, "ready" among them


def first_audio(stats: Mapping[str, Any]) -> tuple[int, float]:
    """(utterances, seconds summed) of the engine's way to first audio (waiting, prompt, first chunk), since it
    started: its worker's share of a client's first audio."""
    return int(stats.get("first_audio_utterances", 0)), sum(float(stats.get(k, 0.0)) for k in FIRST_AUDIO_PARTS)


def summary(entries: Sequence[EngineEntry], pool: _Pool, expected: int) -> dict[str, Any]:
    """The `/engines` document: one row per engine replica in this gateway's pool, the directory's facts with the
    engine's figures (streams, headroom, first audio on the worker)."""
    by_address = {e.address: e for e in entries}
    per_engine: Mapping[str, Mapping[str, Any]] = pool.stats().get("engines", {})
    rows = []
    for address, remote in pool.engines.items():
        stats = per_engine.get(address, {})
        utterances, first_s = first_audio(stats)
        entry = by_address.get(address)
        rows.append({
            **(asdict(entry) if entry is not None else {"address": address}),
            "state": stats.get("state"),
            "ready": bool(stats.get("ready", 0)),
            "streams": int(stats.get("sessions", 0)),  # every gateway's sessions on it
            "gateway_streams": int(stats.get("gateway_sessions", 0)),  # this gateway's
            "capacity": remote.capacity,
            "headroom": remote.headroom,
            "first_audio_utterances": utterances,
            "first_audio_mean_ms": round(1000 * first_s / utterances, 1) if utterances else None,
        })  # fmt: skip
    rows.sort(key=lambda r: (r.get("rank", 1 << 30), r["address"]))
    return {"expected": max(expected, len(rows)), "ready": sum(r["ready"] for r in rows), "engines": rows}


class ReplicaInfo:
    """`fishgate_engine_replica_info{engine, replica, rank, node, pid} 1` for each engine replica the directory lists:
    Ray's names for the engine that fishgate_engine_replica labels by its address alone. `replica` is Serve's id (a
    restarted replica gets a new one), `rank` Serve's 0 … N-1 once settled (a dashboard's line per rank outlives
    restarts). Join on `engine`: `fishgate_engine_replica{what="sessions"} * on(engine) group_left(rank, node)
    fishgate_engine_replica_info`. A gauge, not prometheus_client's Info, whose family would be named
    fishgate_engine_replica as the per-engine gauge is."""

    def __init__(self, entries: Callable[[], Sequence[EngineEntry]]) -> None:
        self._entries = entries

    def collect(self) -> Iterator[Metric]:
        info = GaugeMetricFamily(
            "fishgate_engine_replica_info", "each engine replica's Serve id, rank, node and pid, by its address",
            labels=["engine", "replica", "rank", "node", "pid"],
        )  # fmt: skip
        for e in self._entries():
            info.add_metric([e.address, e.replica_id, str(e.rank), e.node_ip, str(e.pid)], 1.0)
        yield info

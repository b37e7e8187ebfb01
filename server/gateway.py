"""Per-process gateway state shared by every endpoint: settings, engine, voices, metrics, auth and rate limits.

Owns API-key checking (Bearer header, or `?api_key=` for browsers), the WebSocket origin allowlist, a per-key
token-bucket rate limit, the draining flag (SIGTERM) and Prometheus metrics. Endpoints receive it from
`request.app.state.gateway`. Knows nothing about protocols.
"""

from __future__ import annotations

import asyncio
import hmac
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector
from starlette.requests import HTTPConnection

from streaming.engine_api import EngineHandle
from streaming.errors import FishgateError
from streaming.sampling_defaults import FISH_SAMPLING, SamplingDefaults

from .settings import Settings, connections_for
from .voices import VoiceStore

# TTFA buckets, seconds: fine below 200 ms where a streaming gateway should live
FIRST_AUDIO_BUCKETS_S = (0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0)
LOCAL_HOSTS = ("localhost", "127.0.0.1", "[::1]", "::1")
# Set (by `serve --workers N`) to a folder shared by the gateway processes: each writes its metrics there and a scrape
# of any one of them reports every gateway's (prometheus_client's multiprocess mode, chosen when it is imported)
MULTIPROCESS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"
# Each engine's figures of a pool that /metrics shows by address (fishgate_engine_replica): whether it takes sessions,
# its sessions and headroom, its real-time admission, its utterances' way to first audio (sums: ÷ utterances)
REPLICA_SERIES = (
    "ready", "link_up", "model_refused", "sessions", "gateway_sessions", "headroom", "decoding",
    "admission_capacity", "admission_waiting", "behind_real_time", "turn_avg_seconds", "first_audio_utterances",
    "first_audio_wait_seconds", "first_audio_prefill_seconds", "first_audio_decode_seconds",
)  # fmt: skip


def _client_ip(conn: HTTPConnection) -> str:
    return conn.client.host if conn.client else "anonymous"


def is_loopback(host: str) -> bool:
    """A loopback address or name (127.0.0.0/8, ::1, localhost)."""
    return host in LOCAL_HOSTS or host.startswith("127.")


class Unauthorized(FishgateError):
    code = "unauthorized"


class Forbidden(FishgateError):
    code = "forbidden_origin"


class ForbiddenHost(FishgateError):
    code = "forbidden_host"


class RateLimited(FishgateError):
    code = "rate_limited"


@dataclass
class Metrics:
    """The gateway's Prometheus metrics. Under `serve --workers N` a scrape reaches one gateway process but reports
    them all: counters and histograms summed over every gateway that ever ran, the live gauges over the living ones,
    the engine's figures (the same engine for all) as the latest any gateway saw."""

    registry: CollectorRegistry = field(default_factory=CollectorRegistry)
    # what only the process that answers a scrape reports (its pid), kept apart from what is summed
    own: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        r = self.registry
        self.first_audio = Histogram(
            "fishgate_first_audio_seconds", "time from first text to first audio sample sent",
            buckets=FIRST_AUDIO_BUCKETS_S, registry=r,
        )  # fmt: skip
        self.live_sessions = Gauge(
            "fishgate_live_sessions", "/v1/tts/live turns in progress (each holds an engine session)", registry=r,
            multiprocess_mode="livesum",
        )  # fmt: skip
        self.live_connections = Gauge(
            "fishgate_live_connections", "open /v1/tts/live connections, idle ones between turns included",
            registry=r, multiprocess_mode="livesum",
        )  # fmt: skip
        self.connections = Gauge(
            "fishgate_connections", "HTTP requests and WebSockets served now (open) and the cap on them (cap), summed "
            "over the port's gateway processes", ["what"], registry=r, multiprocess_mode="livesum",
        )  # fmt: skip
        self.http_requests = Counter("fishgate_http_synthesis_total", "HTTP synthesis requests", ["api"], registry=r)
        self.errors = Counter("fishgate_errors_total", "errors sent to clients, by code", ["code"], registry=r)
        self.engine = Gauge(
            "fishgate_engine", "engine counters (steps, frames, queues, sessions)", ["what"], registry=r,
            multiprocess_mode="mostrecent",
        )  # fmt: skip
        self.gpu_memory = Gauge(
            "fishgate_gpu_memory_bytes", "GPU memory allocated by the engine", registry=r,
            multiprocess_mode="mostrecent",
        )  # fmt: skip
        # with a pool of engines (serve --engine A,B,…, a Ray gateway) each one's, by address; fishgate_engine has the
        # pool's totals; a Ray gateway adds fishgate_engine_replica_info (server.engine_replicas): who each address is
        self.engine_replica = Gauge(
            "fishgate_engine_replica", "each engine of a pool: its state and counters", ["engine", "what"],
            registry=r, multiprocess_mode="mostrecent",
        )  # fmt: skip
        self.replica_series: set[tuple[str, str]] = set()  # the labels set last time: a departed engine's are removed
        self.gateways = Gauge("fishgate_gateway_processes", "gateway processes serving this port", registry=r,
                              multiprocess_mode="livesum")  # fmt: skip
        self.gateways.set(1)
        # with `serve --workers N` a scrape reaches one gateway process: its pid says which one answered
        self.process = Info("fishgate_gateway", "the gateway process that answered this scrape", registry=self.own)
        self.process.info({"pid": str(os.getpid())})

    def exposition(self) -> bytes:
        """The text a scrape gets: every gateway process's metrics where they share a folder, else this one's."""
        registry = self.registry
        if os.environ.get(MULTIPROCESS_DIR_ENV):
            registry = CollectorRegistry()
            MultiProcessCollector(registry)
        return generate_latest(registry) + generate_latest(self.own)


class TokenBucket:
    def __init__(self, per_minute: int) -> None:
        self.rate = per_minute / 60.0
        self.capacity = float(per_minute)
        self.buckets: dict[str, tuple[float, float]] = {}

    def take(self, key: str) -> bool:
        now = time.monotonic()
        tokens, last = self.buckets.get(key, (self.capacity, now))
        tokens = min(self.capacity, tokens + (now - last) * self.rate)
        if tokens < 1.0:
            self.buckets[key] = (tokens, now)
            return False
        self.buckets[key] = (tokens - 1.0, now)
        if len(self.buckets) > 100_000:  # bounded: forget the oldest keys
            for k in list(self.buckets)[:50_000]:
                del self.buckets[k]
        return True


class Gateway:
    def __init__(self, settings: Settings, engine: EngineHandle, voices: VoiceStore) -> None:
        self.settings = settings
        self.engine = engine
        self.voices = voices
        self.metrics = Metrics()
        self.limiter = TokenBucket(settings.rate_limit_per_min)
        self.draining = asyncio.Event()
        self.version = "0.1.0"
        self.on_fault: Callable[[], None] | None = None  # set by the CLI: stop the process on an engine fault
        # the connection cap (server.connection_cap): where it follows the engine (Settings.connections_follow_engine),
        # how many gateways share the engine's sessions, asked at each connection; None: the cap is fixed up front
        self.gateways_sharing_engine: Callable[[], int] | None = (
            (lambda: settings.workers) if settings.connections_follow_engine else None
        )
        self.connections_open = 0  # HTTP requests and WebSockets being served; one event loop: a plain counter
        self._fixed_connection_cap = settings.resolved_max_connections

    # ---- identity -------------------------------------------------------------------------------------------------
    @property
    def model_name(self) -> str:
        return self.engine.info.name if self.engine.info else "loading"

    def sampling_defaults(self) -> SamplingDefaults:
        """What requests naming no sampling value get: the served model's (fishgate.json), else Fish's."""
        return self.engine.info.sampling if self.engine.info else FISH_SAMPLING

    def served_model_name(self, conn: HTTPConnection) -> str:
        """Clients may name any model (Fish's `model` header, OpenAI's `model`); we report what actually serves."""
        return self.model_name

    @property
    def connection_cap(self) -> int:
        """HTTP requests and WebSockets this gateway serves at once: --max-connections; else, attached to engines,
        room for its share of their sessions once they have said them; else room for its own --max-sessions."""
        sharing = self.gateways_sharing_engine
        capacity = self.engine.capacity if sharing is not None else 0
        if sharing is None or capacity <= 0:
            return self._fixed_connection_cap
        return connections_for(math.ceil(capacity / max(1, sharing())))

    # ---- auth -----------------------------------------------------------------------------------------------------
    def api_key_of(self, conn: HTTPConnection) -> str | None:
        header = conn.headers.get("authorization", "")
        if header.lower().startswith("bearer "):
            return header[7:].strip()
        return conn.query_params.get("api_key")

    def check_auth(self, conn: HTTPConnection) -> None:
        keys = self.settings.api_key
        if not keys:
            return
        given = self.api_key_of(conn)
        if given is not None and any(hmac.compare_digest(given.encode(), k.encode()) for k in keys):
            return
        # failed attempts spend the caller's address's rate budget: key guessing is as slow as the rate limit
        if not self.limiter.take(f"unauthorized {_client_ip(conn)}"):
            raise RateLimited(f"more than {self.settings.rate_limit_per_min} refused requests per minute; slow down")
        if given is None:
            raise Unauthorized("this server needs an API key: send 'Authorization: Bearer <key>' (or ?api_key=)")
        raise Unauthorized("the API key is not valid for this server; check FISHGATE_API_KEY / --api-key")

    def check_host(self, conn: HTTPConnection) -> None:
        """A server bound to loopback answers only requests addressed to a loopback name: a web page that points its
        own domain at 127.0.0.1 (DNS rebinding) would otherwise be same-origin with it."""
        allowed = self.settings.allowed_hosts
        if not is_loopback(self.settings.host) or "*" in allowed:
            return
        host = urlsplit(f"//{conn.headers.get('host', '')}").hostname or ""
        if not is_loopback(host) and host not in allowed:
            raise ForbiddenHost(
                f"this server listens on {self.settings.host} and answers only requests addressed to localhost; "
                "add the name to --allowed-hosts"
            )

    def check_origin(self, conn: HTTPConnection) -> None:
        """Browsers send Origin on WebSocket upgrades and on cross-site requests; allow same-origin, localhost pages
        and the allowlist. `null` (sandboxed frames, file pages) only when listed."""
        origin = conn.headers.get("origin")
        if origin is None:
            return  # not a browser (SDKs, curl): the API key is the guard
        allowed = self.settings.allowed_origins
        if "*" in allowed or origin in allowed:
            return
        host = conn.headers.get("host", "")
        parts = urlsplit(origin)
        if origin != "null" and (parts.netloc == host or parts.hostname in LOCAL_HOSTS):
            return
        raise Forbidden(f"origin {origin} may not use this server; add it to --allowed-origins")

    def check_caller(self, conn: HTTPConnection) -> None:
        """What every /v1 request and WebSocket passes first: the host it was sent to, its origin, its API key."""
        self.check_host(conn)
        self.check_origin(conn)
        self.check_auth(conn)

    def check_rate(self, conn: HTTPConnection) -> None:
        # by key only when keys are configured (check_auth has verified it); else an unchecked key would buy a
        # fresh budget per request, so by address
        key = self.api_key_of(conn) if self.settings.api_key else None
        if not self.limiter.take(key or _client_ip(conn)):
            raise RateLimited(
                f"more than {self.settings.rate_limit_per_min} requests per minute from this key; slow down"
            )

    # ---- metrics --------------------------------------------------------------------------------------------------
    def refresh_metrics(self) -> None:
        stats = self.engine.stats()
        for what, value in stats.items():
            if isinstance(value, int | float) and not isinstance(value, bool):
                self.metrics.engine.labels(what=what).set(value)
        self.metrics.gpu_memory.set(self.engine.gpu_memory_bytes())
        self.metrics.connections.labels(what="open").set(self.connections_open)
        self.metrics.connections.labels(what="cap").set(self.connection_cap)
        engines = stats.get("engines")
        if isinstance(engines, dict):
            self._refresh_replicas(engines)

    def _refresh_replicas(self, engines: dict[str, dict[str, object]]) -> None:
        """fishgate_engine_replica{engine=ADDRESS, what=…}: REPLICA_SERIES of each engine of a pool."""
        m = self.metrics
        now: set[tuple[str, str]] = set()
        for address, stats in engines.items():
            for what in REPLICA_SERIES:
                value = stats.get(what)
                if isinstance(value, int | float) and not isinstance(value, bool):
                    m.engine_replica.labels(engine=address, what=what).set(value)
                    now.add((address, what))
        for engine, what in m.replica_series - now:
            m.engine_replica.remove(engine, what)
        m.replica_series = now

"""Per-process gateway state shared by every endpoint: settings, engine, voices, metrics, auth and rate limits.

Owns API-key checking (Bearer header, or `?api_key=` for browsers), the WebSocket origin allowlist, a per-key
token-bucket rate limit, the draining flag (SIGTERM) and Prometheus metrics. Endpoints receive it from
`request.app.state.gateway`. Knows nothing about protocols.
"""

from __future__ import annotations

import asyncio
import hmac
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from starlette.requests import HTTPConnection

from streaming.engine import Engine
from streaming.errors import FishgateError
from streaming.sampling_defaults import FISH_SAMPLING, SamplingDefaults

from .settings import Settings
from .voices import VoiceStore

# TTFA buckets, seconds: fine below 200 ms where a streaming gateway should live
FIRST_AUDIO_BUCKETS_S = (0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0)
LOCAL_HOSTS = ("localhost", "127.0.0.1", "[::1]", "::1")


class Unauthorized(FishgateError):
    code = "unauthorized"


class Forbidden(FishgateError):
    code = "forbidden_origin"


class RateLimited(FishgateError):
    code = "rate_limited"


@dataclass
class Metrics:
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        r = self.registry
        self.first_audio = Histogram(
            "fishgate_first_audio_seconds", "time from first text to first audio sample sent",
            buckets=FIRST_AUDIO_BUCKETS_S, registry=r,
        )  # fmt: skip
        self.live_sessions = Gauge("fishgate_live_sessions", "open /v1/tts/live sessions", registry=r)
        self.http_requests = Counter("fishgate_http_synthesis_total", "HTTP synthesis requests", ["api"], registry=r)
        self.errors = Counter("fishgate_errors_total", "errors sent to clients, by code", ["code"], registry=r)
        self.engine = Gauge(
            "fishgate_engine", "engine counters (steps, frames, queues, sessions)", ["what"], registry=r
        )
        self.gpu_memory = Gauge("fishgate_gpu_memory_bytes", "GPU memory allocated by the engine", registry=r)


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
    def __init__(self, settings: Settings, engine: Engine, voices: VoiceStore) -> None:
        self.settings = settings
        self.engine = engine
        self.voices = voices
        self.metrics = Metrics()
        self.limiter = TokenBucket(settings.rate_limit_per_min)
        self.draining = asyncio.Event()
        self.version = "0.1.0"
        self.on_fault: Callable[[], None] | None = None  # set by the CLI: stop the process on an engine fault

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
        if given is None:
            raise Unauthorized("this server needs an API key: send 'Authorization: Bearer <key>' (or ?api_key=)")
        if not any(hmac.compare_digest(given.encode(), k.encode()) for k in keys):
            raise Unauthorized("the API key is not valid for this server; check FISHGATE_API_KEY / --api-key")

    def check_origin(self, conn: HTTPConnection) -> None:
        """Browsers send Origin on WebSocket upgrades; allow same-origin, localhost and the allowlist."""
        origin = conn.headers.get("origin")
        if origin is None or (origin == "null" and not self.settings.allowed_origins):
            return  # not a browser (SDKs, curl): the API key is the guard
        allowed = self.settings.allowed_origins
        if "*" in allowed or origin in allowed:
            return
        host = conn.headers.get("host", "")
        parts = urlsplit(origin)
        if parts.netloc == host or parts.hostname in LOCAL_HOSTS:
            return
        raise Forbidden(f"origin {origin} may not open sessions here; add it to --allowed-origins")

    def check_rate(self, conn: HTTPConnection) -> None:
        key = self.api_key_of(conn) or (conn.client.host if conn.client else "anonymous")
        if not self.limiter.take(key):
            raise RateLimited(
                f"more than {self.settings.rate_limit_per_min} requests per minute from this key; slow down"
            )

    # ---- metrics --------------------------------------------------------------------------------------------------
    def refresh_metrics(self) -> None:
        for what, value in self.engine.stats().items():
            if isinstance(value, int | float) and not isinstance(value, bool):
                self.metrics.engine.labels(what=what).set(value)
        self.metrics.gpu_memory.set(self.engine.gpu_memory_bytes())

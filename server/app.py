"""The Starlette application: routes, middleware, and the engine's lifespan.

`/v1/*` needs the API key when one is configured; `/`, static files, `/healthz`, `/readyz` and `/metrics` are
open. The engine starts with the app (loading, graph capture and warm-up run on its worker thread, so the
server answers `/readyz` = not ready meanwhile) and stops with it; with `--engine ADDRESS` the gateway attaches to
a resident engine process instead (streaming.engine_link), or to a pool of them (`--engine A,B,…`), and reports
`engine_unavailable` while it reaches none.
Endpoint modules contribute `routes()`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import re
from collections.abc import AsyncIterator
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Mount, Route, WebSocketRoute
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from starlette.websockets import WebSocket

from streaming.engine_api import EngineHandle, EngineState
from streaming.engine_link.pool import EnginePool

from . import http_api
from . import live_protocol as proto
from .connection_cap import ConnectionCap
from .gateway import Gateway
from .live import LiveConnection
from .params import REFERENCE_SECONDS
from .settings import Settings
from .voices import ReferenceLimits, VoiceStore
from .wire import CLOSE_POLICY, to_wire

if TYPE_CHECKING:
    from streaming.engine import Engine

log = logging.getLogger(__name__)

# how long a refused WebSocket client gets to send its first frame (which tells us JSON or msgpack) before the error
FIRST_FRAME_WAIT_S = 2.0


def web_demo_dir() -> Path:
    return Path(str(resources.files("web_demo")))


class _RedactApiKeys(logging.Filter):
    """uvicorn logs each request's path with its query: a browser's `?api_key=` must not land in the access log."""

    PATTERN = re.compile(r"(api_key=)[^&\s\"]*", re.IGNORECASE)

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(self.PATTERN.sub(r"\1***", a) if isinstance(a, str) else a for a in record.args)
        return True


REDACT_API_KEYS = _RedactApiKeys()


class _CORS(CORSMiddleware):
    """Starlette's CORS, with a refused preflight answered like every other refusal: JSON that names the fix."""

    def preflight_response(self, request_headers: Headers) -> Response:
        response = super().preflight_response(request_headers)
        if response.status_code != 400:
            return response
        what = bytes(response.body).decode().removeprefix("Disallowed CORS ")
        message = f"this cross-origin request is not allowed ({what}); add the page's origin to --allowed-origins"
        headers = {k: v for k, v in response.headers.items() if k.lower().startswith("access-control-")}
        return JSONResponse({"error": {"code": "forbidden_origin", "message": message}}, 403, headers=headers)


# The demo page loads only its own files (module scripts, the AudioWorklet, one stylesheet, an SVG icon), talks
# only to its own origin (fetch and the WebSocket; CSP3's 'self' covers ws:/wss: of the same host) and offers the
# WAV download as a blob: URL. Anything injected from elsewhere (an inline script, a foreign host) is refused.
CONTENT_SECURITY_POLICY = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; media-src 'self' blob:; "
    "connect-src 'self'; worker-src 'self'; object-src 'none'; base-uri 'none'; form-action 'self'; "
    "frame-ancestors 'none'"
)


class SecurityHeaders:
    """Every HTTP response says: no MIME sniffing, no framing by other sites (clickjacking the demo page), no
    referrer (a page's URL may carry ?api_key=), and the demo page's content security policy."""

    HEADERS = (
        (b"x-content-type-options", b"nosniff"),
        (b"x-frame-options", b"DENY"),
        (b"referrer-policy", b"no-referrer"),
        (b"content-security-policy", CONTENT_SECURITY_POLICY.encode()),
    )

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *self.HEADERS]}
            await send(message)

        await self.app(scope, receive, send_with_headers)


def build_gateway(settings: Settings, engine: EngineHandle | None = None) -> Gateway:
    engine = engine or build_engine(settings)

    def reference_limits() -> ReferenceLimits:
        # the longest reference also depends on the model's context, known once the engine has loaded it
        info = engine.info
        context = info.max_seq_len if info is not None else 8192
        return ReferenceLimits.for_context(context, settings.max_reference_bytes, *REFERENCE_SECONDS)

    voices = VoiceStore(settings.resolved_references_dir, engine.encode_reference, reference_limits)
    return Gateway(settings, engine, voices)


def build_engine(settings: Settings) -> EngineHandle:
    """The engine the settings describe: the resident engine process at --engine, else one in this process (only
    then is torch imported: a gateway attached to a resident engine starts in well under a second)."""
    if settings.engine is not None:
        addresses = [a.strip() for a in settings.engine.split(",") if a.strip()]
        if len(addresses) == 1:
            from streaming.engine_link.client import RemoteEngine

            return RemoteEngine(addresses[0], token=settings.engine_token)
        return EnginePool(addresses, token=settings.engine_token)  # several engines: each session to one of them
    return build_local_engine(settings)


def build_local_engine(settings: Settings) -> Engine:
    """An engine in this process, configured by the settings (`fishgate serve`, `fishgate engine`)."""
    from streaming.engine import Engine, EngineConfig

    return Engine(
        EngineConfig(
            settings.backend_config(),  # the profile, then the engine flags given (server.settings)
            settings.worker_limits(),
            max_queued_chars=settings.max_queued_chars,
            admission_wait_s=settings.admission_wait_s,
        )
    )


async def live_endpoint(websocket: WebSocket) -> None:
    gw: Gateway = websocket.app.state.gateway
    conn = LiveConnection(websocket, gw)
    await websocket.accept()
    try:
        gw.check_caller(websocket)
    except Exception as e:
        w = to_wire(e)
        gw.metrics.errors.labels(code=w.code).inc()
        # answer in the client's encoding, which its first frame picks (browsers speak JSON)
        with contextlib.suppress(Exception):
            first = await asyncio.wait_for(websocket.receive(), FIRST_FRAME_WAIT_S)
            if first.get("type") == "websocket.receive":
                conn.encoding = proto.encoding_of_first_frame(first)
        await conn._fail(w.code, w.message, CLOSE_POLICY)
        return
    await conn.run()


async def healthz(request: Request) -> JSONResponse:
    gw: Gateway = request.app.state.gateway
    info = gw.engine.info
    body: dict[str, object] = {
        "status": "ok" if gw.engine.state is not EngineState.FAULTED else "faulted",
        "engine": gw.engine.state.value,
        "model": gw.model_name,
        "untrained_default_model": bool(info and info.untrained),
        "version": gw.version,
    }
    if info is not None:
        body.update(
            device=info.device,
            dtype=info.dtype,
            sample_rate=info.sample_rate_hz,
            max_sessions=gw.engine.capacity,
            sampling=dataclasses.asdict(info.sampling),  # what a request naming no sampling value gets
        )
    if info is not None and info.untrained:
        body["warning"] = "the embedded default model has random weights: its output is noise; use --checkpoint"
    return JSONResponse(body)


async def readyz(request: Request) -> JSONResponse:
    gw: Gateway = request.app.state.gateway
    ready = gw.engine.ready and not gw.draining.is_set()
    reason = "draining" if gw.draining.is_set() else gw.engine.state.value
    body: dict[str, object] = {"ready": ready, "state": reason}
    if isinstance(gw.engine, EnginePool):  # ready while one of its engines is
        body["engines"] = {"ready": gw.engine.engines_ready, "total": len(gw.engine.engines)}
    return JSONResponse(body, status_code=200 if ready else 503)


async def metrics(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    gw.refresh_metrics()
    return Response(gw.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)


def create_app(settings: Settings, gateway: Gateway | None = None) -> Starlette:
    gw = gateway or build_gateway(settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        app.state.gateway = gw
        gw.engine.start()  # a no-op for an engine started already
        watchdog = asyncio.create_task(_watch_engine(gw))
        try:
            yield
        finally:
            watchdog.cancel()
            await asyncio.to_thread(gw.engine.stop)

    routes = [
        WebSocketRoute("/v1/tts/live", live_endpoint),
        Route("/healthz", healthz),
        Route("/readyz", readyz),
        Route("/metrics", metrics),
        *http_api.routes(),
        Mount("/", StaticFiles(directory=web_demo_dir(), html=True), name="web_demo"),
    ]
    cors = Middleware(
        _CORS,
        allow_origins=list(settings.allowed_origins),
        allow_methods=["GET", "POST", "DELETE"],
        allow_headers=["authorization", "content-type", "model"],
    )
    for name in ("uvicorn.access", "uvicorn.error"):  # the WebSocket handshake lines go to uvicorn.error
        logging.getLogger(name).addFilter(REDACT_API_KEYS)  # once: addFilter skips a filter already there
    middleware = [cors, Middleware(SecurityHeaders), Middleware(ConnectionCap, gateway=gw)]
    app = Starlette(routes=routes, middleware=middleware, lifespan=lifespan)
    app.state.gateway = gw
    return app


async def _watch_engine(gw: Gateway) -> None:
    """A faulted engine (e.g. a poisoned CUDA context) makes readiness false; the CLI then exits non-zero."""
    while True:
        await asyncio.sleep(0.5)
        if gw.engine.state is EngineState.FAULTED:
            log.critical("engine faulted (%s): readiness is false; the process will exit", gw.engine.fault)
            gw.draining.set()
            if gw.on_fault is not None:
                gw.on_fault()
            return

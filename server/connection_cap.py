"""The connection cap (`--max-connections`): HTTP requests and WebSockets the server serves at once.

Idle WebSockets cost a socket, a task and buffers each and close only after `--idle-timeout-s`, so without a cap a
client could hold thousands. Beyond the cap an HTTP request gets 503 `overloaded` (JSON, `Retry-After`) and a
WebSocket handshake the same 503 response instead of the 101 (ASGI's denial response; a server without that
extension closes the handshake with 1013), before any route runs. uvicorn's own `limit_concurrency`, set a little
higher, stays as a backstop for idle keep-alive HTTP connections, which hold no request and so are not counted here.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from starlette.types import ASGIApp, Receive, Scope, Send

if TYPE_CHECKING:
    from .gateway import Gateway

UVICORN_BACKSTOP_EXTRA = 64  # uvicorn's connection limit = the cap + this (idle keep-alive connections)


class ConnectionCap:
    def __init__(self, app: ASGIApp, gateway: Gateway) -> None:
        self.app = app
        self.gateway = gateway
        self.cap = gateway.settings.resolved_max_connections
        self.open = 0  # the event loop is single-threaded: a plain counter

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        if self.open >= self.cap:
            await self._refuse(scope, receive, send)
            return
        self.open += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.open -= 1

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.gateway.metrics.errors.labels(code="overloaded").inc()
        message = (
            f"the server is holding its limit of {self.cap} connections; retry in a moment "
            "(operators: raise --max-connections)"
        )
        body = json.dumps({"error": {"code": "overloaded", "message": message}}).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"retry-after", b"1")]  # fmt: skip
        if scope["type"] == "http":
            await send({"type": "http.response.start", "status": 503, "headers": headers})
            await send({"type": "http.response.body", "body": body})
        elif "websocket.http.response" in scope.get("extensions", {}):
            await send({"type": "websocket.http.response.start", "status": 503, "headers": headers})
            await send({"type": "websocket.http.response.body", "body": body})
        else:
            await receive()  # websocket.connect
            await send({"type": "websocket.close", "code": 1013})  # try again later

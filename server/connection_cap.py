"""The connection cap (`--max-connections`): HTTP requests and WebSockets the server serves at once.

Idle WebSockets cost a socket, a task and buffers each and close only after `--idle-timeout-s`, so without a cap a
client could hold thousands. Beyond the cap an HTTP request gets 503 `overloaded` (JSON, `Retry-After`) and a
WebSocket handshake the same 503 response instead of the 101 (ASGI's denial response; a server without that
extension closes the handshake with 1013), before any route runs. uvicorn's own `limit_concurrency`, set a little
higher, stays as a backstop for idle keep-alive HTTP connections, which hold no request and so are not counted here;
it follows the cap (BackstoppedConfig), also where the cap follows the engine's sessions.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send
from starlette.websockets import WebSocketClose

from streaming.errors import Overloaded

from .http_common import error_response

if TYPE_CHECKING:
    from .gateway import Gateway

UVICORN_BACKSTOP_EXTRA = 64  # uvicorn's connection limit = the cap + this (idle keep-alive connections)


class ConnectionCap:
    """The cap itself is the gateway's policy (Gateway.connection_cap); this middleware counts and refuses."""

    def __init__(self, app: ASGIApp, gateway: Gateway) -> None:
        self.app = app
        self.gateway = gateway

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        gateway = self.gateway
        if gateway.connections_open >= gateway.connection_cap:
            await self._refuse(scope, receive, send)
            return
        gateway.connections_open += 1
        try:
            await self.app(scope, receive, send)
        finally:
            gateway.connections_open -= 1

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        message = (
            f"the server is holding its limit of {self.gateway.connection_cap} connections; retry in a moment "
            "(operators: raise --max-connections)"
        )
        response: ASGIApp = error_response(self.gateway, Overloaded(message))  # 503 JSON with Retry-After, counted
        if scope["type"] == "websocket" and "websocket.http.response" not in scope.get("extensions", {}):
            response = WebSocketClose(1013)  # no denial responses on this server: close the handshake, try later
        await response(scope, receive, send)  # on a WebSocket handshake: the 503 instead of the 101


class BackstoppedConfig(uvicorn.Config):
    """uvicorn's settings with its connection limit UVICORN_BACKSTOP_EXTRA above the gateway's cap as it is now:
    uvicorn's protocols copy `limit_concurrency` as each connection opens, so the backstop moves with a cap that
    follows the engine's sessions instead of being fixed from this process's own --max-sessions."""

    def __init__(self, app: ASGIApp, gateway: Gateway, **kwargs: Any) -> None:
        self.gateway = gateway
        super().__init__(app, **kwargs)

    @property
    def limit_concurrency(self) -> int:
        return self.gateway.connection_cap + UVICORN_BACKSTOP_EXTRA

    @limit_concurrency.setter
    def limit_concurrency(self, value: int | None) -> None:
        pass  # uvicorn.Config.__init__ assigns it; the cap decides

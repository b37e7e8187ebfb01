"""A raw Fish-live client for tests (the `websockets` library; msgpack or JSON frames)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass, field
from typing import Any

import msgpack
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

RECV_TIMEOUT_S = 60.0
CLOSE_AFTER_ERROR_WAIT_S = 1.0  # a server closes within this of a connection-ending finish(error)


@dataclass
class LiveResult:
    events: list[dict[str, Any]] = field(default_factory=list)
    audio: bytearray = field(default_factory=bytearray)
    close_code: int | None = None
    close_reason: str = ""
    server_closed: bool = False  # the server closed on its own (not the echo of the client's close)

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e.get("event") == kind]

    @property
    def error_codes(self) -> list[str]:
        return [e["code"] for e in self.of("error")]


class LiveClient:
    def __init__(self, ws: ClientConnection, json_mode: bool = False) -> None:
        self.ws = ws
        self.json_mode = json_mode

    async def send(self, event: dict[str, Any]) -> None:
        if self.json_mode:
            await self.ws.send(json.dumps(event))
        else:
            await self.ws.send(msgpack.packb(event, use_bin_type=True))

    async def start(self, **request: Any) -> None:
        await self.send({"event": "start", "request": {"text": "", "format": "pcm", **request}})

    async def read_until(self, result: LiveResult, kinds: tuple[str, ...] = ("finish",)) -> LiveResult:
        """Read frames into result until an event of `kinds` or the close."""
        try:
            while True:
                msg = await asyncio.wait_for(self.ws.recv(), RECV_TIMEOUT_S)
                if isinstance(msg, bytes) and self.json_mode:
                    result.audio.extend(msg)
                    continue
                event = json.loads(msg) if isinstance(msg, str) else msgpack.unpackb(msg)
                result.events.append(event)
                if event.get("event") == "audio":
                    result.audio.extend(event["audio"])
                if event.get("event") in kinds:
                    return result
        except ConnectionClosed as e:
            result.close_code = e.rcvd.code if e.rcvd is not None else None
            result.close_reason = e.rcvd.reason if e.rcvd is not None else ""
            result.server_closed = True
            return result

    async def wait_closed(self, result: LiveResult) -> LiveResult:
        """Read until the server closes, or until a turn's `finish`, then close as a one-utterance client does (the
        server keeps the socket open for another turn). `close_code` is the server's: the code of the close frame
        it sent, on its own or as the echo of ours; `server_closed` says which."""
        await self.read_until(result)
        if result.events and result.events[-1] == {"event": "finish", "reason": "error"} and not result.server_closed:
            # an error that ends the connection closes it right after its finish; one that ends only the turn
            # leaves it open: wait a moment to tell them apart
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.read_until(result, kinds=()), CLOSE_AFTER_ERROR_WAIT_S)
        if not result.server_closed:
            await self.ws.close()
            result.close_code = self.ws.close_code
            result.server_closed = bool(self.ws.protocol.close_rcvd_then_sent)
        return result


def open_live(url: str, **kwargs: Any):
    return connect(url, max_size=None, open_timeout=30, **kwargs)


async def speak(url: str, texts: list[str], json_mode: bool = False, **request: Any) -> LiveResult:
    """One whole turn as a one-utterance client speaks it: start, text events, stop, read until `finish`, then close.
    Returns events, audio and the server's close code if the server closed first (None: it kept the socket open)."""
    async with open_live(url) as ws:
        client = LiveClient(ws, json_mode)
        await client.start(**request)
        for t in texts:
            await client.send({"event": "text", "text": t})
        await client.send({"event": "stop"})
        return await client.wait_closed(LiveResult())

"""A raw Fish-live client for tests (the `websockets` library; msgpack or JSON frames)."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

import msgpack
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

RECV_TIMEOUT_S = 60.0


@dataclass
class LiveResult:
    events: list[dict[str, Any]] = field(default_factory=list)
    audio: bytearray = field(default_factory=bytearray)
    close_code: int | None = None

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
            return result

    async def wait_closed(self, result: LiveResult) -> LiveResult:
        await self.read_until(result, kinds=())
        return result


def open_live(url: str, **kwargs: Any):
    return connect(url, max_size=None, open_timeout=30, **kwargs)


async def speak(url: str, texts: list[str], json_mode: bool = False, **request: Any) -> LiveResult:
    """One whole utterance: start, text events, stop; returns events, audio and the close code."""
    async with open_live(url) as ws:
        client = LiveClient(ws, json_mode)
        await client.start(**request)
        for t in texts:
            await client.send({"event": "text", "text": t})
        await client.send({"event": "stop"})
        result = LiveResult()
        await client.wait_closed(result)
        return result

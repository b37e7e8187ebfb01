"""`/v1/tts/live` at its edges, with a real server and the raw `websockets` client: the idle and wall-time limits,
a draining server, the `started` and `timing` events, text after `stop`, frames that are not objects, text at exactly
the length limit, the segmenter's idle cut, a cancel that drops text still waiting for a sentence end, a JSON session
that sends a binary frame, deeply nested JSON, and a wrong API key on the WebSocket.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import msgpack
from websockets.exceptions import ConnectionClosed

from tests.server.conftest import API_KEY, ServerHandle, start_server, with_settings
from tests.server.live_client import LiveClient, LiveResult, open_live, speak
from tests.streaming.engine_helpers import RANDOM_TINY_MODEL

LONG = "A long closing answer that keeps the server busy for a while. " * 6


def run(coro):
    return asyncio.run(coro)


async def silent_until_closed(url: str, first: list, within_s: float) -> tuple[LiveResult, float]:
    """Send the `first` events, then nothing: read until the server closes (at most `within_s`). Returns the events
    and the seconds from the last event sent to the close."""
    async with open_live(url) as ws:
        c = LiveClient(ws)
        for event in first:
            await c.send(event)
        t0 = time.monotonic()
        r = LiveResult()
        await asyncio.wait_for(c.read_until(r, kinds=()), within_s)
        return r, time.monotonic() - t0


async def seconds_to_finish(url: str, events: list) -> tuple[LiveResult, float]:
    """Send `events`, read until `finish`: the events and the seconds from the last event sent to the finish."""
    async with open_live(url) as ws:
        c = LiveClient(ws)
        for event in events:
            await c.send(event)
        t0 = time.monotonic()
        r = await c.read_until(LiveResult())
        return r, time.monotonic() - t0


def test_a_silent_client_is_closed_by_the_idle_timeout_but_not_while_its_audio_still_streams(tmp_path) -> None:
    with start_server(tmp_path, checkpoint=RANDOM_TINY_MODEL, idle_timeout_s=1.0) as srv:
        start = {"event": "start", "request": {"text": "", "format": "pcm", "max_new_tokens": 2000}}
        idle, waited = run(silent_until_closed(srv.ws_url, [start], within_s=10))
        # a turn left open and silent: error + finish(error) (a client may be waiting for it), then a normal close
        assert idle.error_codes == ["idle_timeout"] and idle.events[-1] == {"event": "finish", "reason": "error"}
        assert idle.close_code == 1000 and 1.0 <= waited < 10  # never before the limit; the bound only stops a hang

        async def chatty() -> LiveResult:  # every message restarts the idle clock
            async with open_live(srv.ws_url) as ws:
                c = LiveClient(ws)
                await c.send(start)
                with contextlib.suppress(ConnectionClosed):  # (if the server wrongly closed, the events say why)
                    for _ in range(6):  # 1.5 s in all, never 1 s silent
                        await asyncio.sleep(0.25)
                        await c.send({"event": "flush"})
                    await c.send({"event": "stop"})
                return await c.read_until(LiveResult())

        talked = run(chatty())
        assert talked.error_codes == [] and talked.events[-1] == {"event": "finish", "reason": "stop"}

        # after `stop` the client has nothing more to say: its silence while the audio streams is not idleness. The
        # utterance is seeded (the same frames every time) and the idle limit is set to a quarter of the time this
        # very utterance took to finish a moment before, so it outlasts the limit by construction, however fast or
        # loaded the machine is
        seeded = {**start, "request": {**start["request"], "seed": 5}}
        utterance = [seeded, {"event": "text", "text": LONG}, {"event": "stop"}]
        srv.gateway.settings = with_settings(srv, idle_timeout_s=60.0)
        measured, took_s = run(seconds_to_finish(srv.ws_url, utterance))
        idle_s = took_s / 4
        srv.gateway.settings = with_settings(srv, idle_timeout_s=idle_s)
        busy, _ = run(silent_until_closed(srv.ws_url, utterance, within_s=60 + took_s))
        assert busy.audio == measured.audio and len(busy.audio) > 0  # the same utterance, heard whole
        assert busy.error_codes == [] and busy.of("finish") == [{"event": "finish", "reason": "stop"}]
        # then, between turns with nothing in flight, the idle limit closes the socket: 1000 and a reason, no error
        assert busy.events[-1] == {"event": "finish", "reason": "stop"} and busy.close_code == 1000
        assert busy.close_reason.startswith("idle_timeout")


def test_a_session_past_its_wall_time_cap_is_closed_1008(tmp_path) -> None:
    with start_server(tmp_path, checkpoint=RANDOM_TINY_MODEL, max_session_s=1.0) as srv:
        start = {"event": "start", "request": {"text": "", "format": "pcm"}}
        r, waited = run(silent_until_closed(srv.ws_url, [start], within_s=10))
        assert r.error_codes == ["session_too_long"] and r.events[-1] == {"event": "finish", "reason": "error"}
        assert r.close_code == 1008 and 1.0 <= waited < 10  # never before the cap; the bound only stops a hang


def test_a_draining_server_refuses_new_sessions_with_1012(tmp_path) -> None:
    with start_server(tmp_path, checkpoint=RANDOM_TINY_MODEL) as srv:
        srv.gateway.draining.set()  # what SIGTERM does
        r, _ = run(silent_until_closed(srv.ws_url, [], within_s=10))
        assert r.error_codes == ["shutting_down"] and r.events[-1] == {"event": "finish", "reason": "error"}
        assert r.close_code == 1012  # service restart: the client reconnects (to another replica)


def test_started_names_the_output_and_timing_comes_once_per_utterance(server: ServerHandle) -> None:
    r = run(speak(server.ws_url, ["First sentence here. ", "A second one follows. ", "And a third."], format="wav",
                  sample_rate=16000))  # fmt: skip
    started = r.events[0]
    assert started["event"] == "started" and (started["format"], started["sample_rate"]) == ("wav", 16000)
    assert started["session"] and started["model"]
    assert len(r.of("timing")) == 1 and r.events[-1] == {"event": "finish", "reason": "stop"}


def test_text_after_stop_gets_a_stopping_error_and_the_audio_still_finishes(server: ServerHandle) -> None:
    async def main():
        async with open_live(server.ws_url) as ws:
            c = LiveClient(ws)
            await c.start()
            await c.send({"event": "text", "text": "The last words."})
            await c.send({"event": "stop"})
            await c.send({"event": "text", "text": "Too late."})
            return await c.wait_closed(LiveResult())

    r = run(main())
    assert r.error_codes == ["stopping"] and "stop was received" in r.of("error")[0]["message"]
    assert r.events[-1] == {"event": "finish", "reason": "stop"} and r.close_code == 1000 and len(r.audio) > 0


def test_frames_that_are_not_objects_get_bad_event_and_the_session_goes_on(server: ServerHandle) -> None:
    async def main(json_mode: bool):
        async with open_live(server.ws_url) as ws:
            c = LiveClient(ws, json_mode)
            for not_an_object in ([1, 2], "start", 42, None):
                await ws.send(json.dumps(not_an_object) if json_mode else msgpack.packb(not_an_object))
            await c.start()
            await c.send({"event": "text", "text": "Still here."})
            await c.send({"event": "stop"})
            return await c.wait_closed(LiveResult())

    for json_mode in (False, True):
        r = run(main(json_mode))
        assert r.error_codes == ["bad_event"] * 4, (json_mode, r.events)
        assert r.events[-1] == {"event": "finish", "reason": "stop"} and r.close_code == 1000


def test_a_text_event_of_exactly_the_limit_is_accepted(tmp_path) -> None:
    with start_server(tmp_path, checkpoint=RANDOM_TINY_MODEL, max_text_chars=100, max_queued_chars=100) as srv:

        async def main():
            async with open_live(srv.ws_url) as ws:
                c = LiveClient(ws)
                await c.start()
                await c.send({"event": "text", "text": ("Exactly one hundred characters. " * 4)[:99] + "."})
                await c.send({"event": "stop"})
                return await c.wait_closed(LiveResult())

        r = run(main())
        assert r.error_codes == [] and r.events[-1] == {"event": "finish", "reason": "stop"} and len(r.audio) > 0


def test_a_sentence_the_text_stream_paused_after_is_spoken_without_flush(server: ServerHandle) -> None:
    """A "." at the end of the text so far might be "3.5" or "e.g." once more text comes; an LLM that pauses there
    still gets its sentence spoken, by the segmenter's idle cut (0.5 s in the balanced mode), with no flush."""

    async def main():
        async with open_live(server.ws_url) as ws:
            c = LiveClient(ws)
            await c.start(latency="balanced")
            await c.send({"event": "text", "text": "Let me think about the weather for a moment."})
            r = LiveResult()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(c.read_until(r, ("audio",)), 5)
            with contextlib.suppress(ConnectionClosed):
                await c.send({"event": "cancel"})
            return r

    assert run(main()).of("audio"), "no audio 5 s into the pause"


def test_cancel_drops_text_that_was_still_waiting_for_a_sentence_end(server: ServerHandle) -> None:
    async def session(texts_before_cancel: list[str]) -> bytes:
        async with open_live(server.ws_url) as ws:
            c = LiveClient(ws)
            await c.start(seed=7)
            for t in texts_before_cancel:
                await c.send({"event": "text", "text": t})
            if texts_before_cancel:
                await c.send({"event": "cancel"})
                await c.read_until(LiveResult(), ("cancelled",))
            await c.send({"event": "text", "text": "Short one."})
            await c.send({"event": "stop"})
            r = await c.wait_closed(LiveResult())
            assert r.events[-1] == {"event": "finish", "reason": "stop"}
            return bytes(r.audio)

    fresh = run(session([]))
    assert len(fresh) > 0 and run(session(["so the"])) == fresh  # "so the" was never spoken, nor kept


def test_a_json_session_that_sends_a_binary_frame_closes_1003(server: ServerHandle) -> None:
    async def main():
        async with open_live(server.ws_url) as ws:
            c = LiveClient(ws, json_mode=True)
            await c.start()
            await ws.send(msgpack.packb({"event": "stop"}))
            return await c.wait_closed(LiveResult())

    r = run(main())
    assert r.error_codes == ["wrong_frame_type"] and "JSON (text frames)" in r.of("error")[0]["message"]
    assert r.close_code == 1003


def test_deeply_nested_json_closes_1007(server: ServerHandle) -> None:
    async def main():
        async with open_live(server.ws_url) as ws:
            await ws.send("[" * 100_000 + "]" * 100_000)
            return await LiveClient(ws, json_mode=True).wait_closed(LiveResult())

    r = run(main())
    assert r.error_codes == ["invalid_payload"] and r.close_code == 1007  # a client error, not 1011 internal


def test_a_wrong_api_key_on_the_websocket_is_refused_1008(secured_server: ServerHandle) -> None:
    start = {"event": "start", "request": {"text": "", "format": "pcm"}}
    for key in ("wrong-key", API_KEY + "x", API_KEY[:-1]):
        r, _ = run(silent_until_closed(f"{secured_server.ws_url}?api_key={key}", [start], within_s=10))
        assert r.error_codes == ["unauthorized"] and "not valid" in r.of("error")[0]["message"], key
        assert r.close_code == 1008 and not r.of("started"), key

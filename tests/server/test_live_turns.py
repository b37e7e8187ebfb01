"""One live socket, many turns: what voice-agent clients do (LiveKit's plugin pools a socket and sends a new `start`
each turn; pipecat keeps one `start` for a whole conversation). A turn is `start` … `stop` … `finish`; between turns
the socket holds no engine session, failures end the turn in `error` + `finish(error)` at once, and the socket stays
usable. The real client libraries are exercised in test_voice_agent_clients.py; these tests speak the raw protocol.
"""

from __future__ import annotations

import asyncio
import logging
import time

from tests.server.conftest import ServerHandle, start_server
from tests.server.live_client import LiveClient, LiveResult, open_live
from tests.streaming.engine_helpers import RANDOM_TINY_MODEL


def run(coro):
    return asyncio.run(coro)


async def turn(c: LiveClient, texts: list[str], **request) -> LiveResult:
    await c.start(**request)
    for t in texts:
        await c.send({"event": "text", "text": t})
        await c.send({"event": "flush"})
    await c.send({"event": "stop"})
    return await c.read_until(LiveResult())


def engine_sessions(srv: ServerHandle) -> int:
    return srv.gateway.engine.open_sessions


def gauge(srv: ServerHandle, name: str) -> float:
    return srv.gateway.metrics.registry.get_sample_value(name) or 0.0


def test_one_socket_serves_turns_with_their_own_parameters_and_holds_nothing_between_them(server: ServerHandle) -> None:
    async def main():
        async with open_live(server.ws_url) as ws:
            c = LiveClient(ws)
            turns, between = [], []
            for fmt, rate in (("pcm", 24000), ("wav", 16000), ("pcm", 44100)):
                turns.append(await turn(c, ["Hello there. ", "How are you today?"], format=fmt, sample_rate=rate))
                await asyncio.sleep(0)  # the finish went out; the turn's session closed before it
                between.append((engine_sessions(server), gauge(server, "fishgate_live_sessions"),
                                gauge(server, "fishgate_live_connections")))  # fmt: skip
            return turns, between

    turns, between = run(main())
    for r, (fmt, rate), n in zip(turns, (("pcm", 24000), ("wav", 16000), ("pcm", 44100)), (1, 2, 3), strict=True):
        started = r.of("started")[0]
        assert (started["format"], started["sample_rate"], started["turn"]) == (fmt, rate, n)
        assert r.error_codes == [] and r.events[-1] == {"event": "finish", "reason": "stop"} and len(r.audio) > 0
        assert r.close_code is None  # the server kept the socket open
    assert turns[1].audio[:4] == b"RIFF" and turns[0].audio[:4] != b"RIFF"  # each turn's own format
    # between turns: no engine session, no turn counted against --max-sessions, one open connection
    assert between == [(0, 0.0, 1.0)] * 3


def test_an_idle_socket_between_turns_does_not_count_against_max_sessions(tmp_path) -> None:
    with start_server(tmp_path, checkpoint=RANDOM_TINY_MODEL, max_sessions=1) as srv:

        async def main():
            async with open_live(srv.ws_url) as a, open_live(srv.ws_url) as b:
                ca, cb = LiveClient(a), LiveClient(b)
                first = await turn(ca, ["One."])  # a is now idle between turns
                other = await turn(cb, ["Two."])  # b gets the one engine session
                again = await turn(ca, ["Three."])  # and a gets it back
                return first, other, again

        for r in run(main()):
            assert r.error_codes == [] and r.events[-1] == {"event": "finish", "reason": "stop"} and len(r.audio) > 0


def test_a_failed_start_ends_at_once_in_finish_error_and_the_socket_serves_the_next_turn(
    server: ServerHandle, caplog
) -> None:
    async def main():
        async with open_live(server.ws_url) as ws:
            c = LiveClient(ws)
            t0 = time.monotonic()
            await c.start(reference_id="a-cloud-voice-id-this-server-never-stored")
            failed = await c.read_until(LiveResult())
            failed_s = time.monotonic() - t0
            # the rest of the failed turn, as LiveKit's plugin sends it (pipecat sends text + flush per utterance)
            await c.send({"event": "text", "text": "Words for the failed turn."})
            await c.send({"event": "flush"})
            lost = await c.read_until(LiveResult())
            await c.send({"event": "stop"})  # ends the failed turn: dropped, nothing answers it
            good = await turn(c, ["The next turn speaks."])
            return failed, failed_s, lost, good

    unknown = {"code": "unknown_voice"}
    counted = server.gateway.metrics.registry.get_sample_value("fishgate_errors_total", unknown) or 0.0
    with caplog.at_level(logging.WARNING, logger="server.live"):
        failed, failed_s, lost, good = run(main())
    assert failed.error_codes == ["unknown_voice"] and "GET /v1/references" in failed.of("error")[0]["message"]
    assert failed.events[-1] == {"event": "finish", "reason": "error"} and not failed.of("started")
    assert failed_s < 2.0  # at once (a hang is the bug); the budget is 1 s, this bound only absorbs a slow CI
    # a flush of the failed turn answers once more, so a client that never restarts hears of each lost utterance
    assert lost.error_codes == ["not_started"] and lost.events[-1] == {"event": "finish", "reason": "error"}
    assert good.events[0]["event"] == "started" and good.error_codes == [] and len(good.audio) > 0
    assert good.events[-1] == {"event": "finish", "reason": "stop"}  # the stop of the failed turn was dropped
    assert server.gateway.metrics.registry.get_sample_value("fishgate_errors_total", unknown) == counted + 1
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "unknown_voice" in r.getMessage()]
    assert len(warnings) == 1  # logged once per connection


def test_cancel_works_within_a_turn_and_a_late_one_after_finish_is_harmless(server: ServerHandle) -> None:
    async def main():
        async with open_live(server.ws_url) as ws:
            c = LiveClient(ws)
            await c.start(max_new_tokens=2000)
            await c.send({"event": "text", "text": "A long answer that the listener will interrupt. " * 4})
            await c.send({"event": "stop"})
            barged = LiveResult()
            await c.read_until(barged, ("audio",))
            await c.send({"event": "cancel"})  # barge-in while the turn's audio streams
            await c.read_until(barged)
            await c.send({"event": "cancel"})  # crossed the finish: nothing is left to cancel
            after = await turn(c, ["After the interruption."])
            return barged, after

    barged, after = run(main())
    assert [e["event"] for e in barged.events[-2:]] == ["cancelled", "finish"] and barged.error_codes == []
    assert barged.events[-1] == {"event": "finish", "reason": "stop"}
    assert after.error_codes == [] and after.events[-1] == {"event": "finish", "reason": "stop"}
    assert len(after.audio) > 0


def test_an_overloaded_start_fails_the_turn_and_a_later_start_on_the_same_socket_is_served(tmp_path) -> None:
    with start_server(tmp_path, checkpoint=RANDOM_TINY_MODEL, max_sessions=1) as srv:

        async def main():
            async with open_live(srv.ws_url) as busy, open_live(srv.ws_url) as ws:
                holder = LiveClient(busy)
                await holder.start()
                await holder.read_until(LiveResult(), ("started",))  # holds the one engine session
                c = LiveClient(ws)
                await c.start()
                refused = await c.read_until(LiveResult())
                await holder.send({"event": "stop"})
                await holder.read_until(LiveResult())  # its turn ends: the session is free
                served = await turn(c, ["Now there is room."])
                return refused, served

        refused, served = run(main())
        assert refused.error_codes == ["overloaded"] and refused.events[-1] == {"event": "finish", "reason": "error"}
        assert served.error_codes == [] and served.events[-1] == {"event": "finish", "reason": "stop"}


def test_draining_lets_the_running_turn_finish_then_closes_1012_with_a_reason(tmp_path) -> None:
    with start_server(tmp_path, checkpoint=RANDOM_TINY_MODEL) as srv:

        async def main():
            async with open_live(srv.ws_url) as ws:
                c = LiveClient(ws)
                await c.start()
                await c.send({"event": "text", "text": "The last words before the restart."})
                r = await c.read_until(LiveResult(), ("started",))
                srv.gateway.draining.set()  # what SIGTERM does
                await c.send({"event": "stop"})
                await c.read_until(r)
                return await c.read_until(r, kinds=())

        r = run(main())
        assert r.of("finish") == [{"event": "finish", "reason": "stop"}] and len(r.audio) > 0
        assert r.close_code == 1012 and r.close_reason.startswith("shutting_down")


def test_the_live_socket_negotiates_no_compression_unless_turned_on(server: ServerHandle, tmp_path) -> None:
    """Browsers, the websockets client and pipecat offer permessage-deflate; audio barely compresses, and deflating
    every frame on the event loop cost a third of an H200's streams. Off unless --ws-compression on."""

    async def negotiated(url: str) -> list[str]:
        async with open_live(url) as ws:  # the websockets client's defaults: deflate offered
            return [type(e).__name__ for e in ws.protocol.extensions]

    assert run(negotiated(server.ws_url)) == []
    with start_server(tmp_path, checkpoint=RANDOM_TINY_MODEL, ws_compression="on") as srv:
        assert run(negotiated(srv.ws_url)) == ["PerMessageDeflate"]

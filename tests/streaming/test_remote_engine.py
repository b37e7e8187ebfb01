"""The engine link on CPU with the embedded default model: one real Engine served by an EngineHost on a Unix socket
and RemoteEngine clients in the same event loop. A remote session's events and PCM equal the in-process engine's
bitwise; back-pressure counts what the gateway has not read; cancel, errors, a vanished gateway, a vanished engine,
two gateways at once; an EngineService's drain and close. The engine process and gateways as separate processes:
tests/server/test_resident_engine.py."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import numpy as np
import pytest

from streaming.backend import Backend
from streaming.config import BackendConfig, WorkerLimits
from streaming.engine import Engine, EngineConfig
from streaming.engine_api import EngineState
from streaming.engine_link.address import TcpAddress
from streaming.engine_link.client import RemoteEngine
from streaming.engine_link.connection import RemoteSession
from streaming.engine_link.host import EngineHost
from streaming.engine_link.protocol import (
    MAX_FRAME_BYTES,
    PROTOCOL_VERSION,
    FrameDecoder,
    LinkBroken,
    Op,
    frame,
    pack_info,
    pack_settings,
    unpack_info,
    unpack_settings,
)
from streaming.engine_link.service import EngineService
from streaming.engine_link.sockets import CannotListen, claim_socket, listen
from streaming.errors import EngineUnavailable, Overloaded, UnsupportedLanguage
from streaming.realtime_admission import RealtimeAdmission
from streaming.session import (
    AudioChunk,
    Event,
    SegmentDone,
    Session,
    SessionError,
    SynthesisSettings,
    UtteranceDone,
    Voice,
)
from tests.streaming.engine_helpers import EVENT_TIMEOUT_S, collect, running_engine, speak

SETTINGS = SynthesisSettings(seed=1234, max_new_tokens=40)
TEXTS = ("Hello there, this is a test.", "A second sentence follows it.")
LONG = SynthesisSettings(seed=5, max_new_tokens=400)
LONG_TEXT = "This utterance is long enough that it will still be running when something happens to it. " * 3
WAIT_S = 10.0


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    with running_engine(max_sessions=4) as e:
        yield e


@pytest.fixture
def socket_path() -> Iterator[Path]:
    folder = Path(tempfile.mkdtemp(prefix="fg-link-"))  # short: a Unix socket's path has at most 107 bytes
    yield folder / "engine.sock"
    shutil.rmtree(folder, ignore_errors=True)


async def until(check, what: str, timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.01)


@contextlib.asynccontextmanager
async def hosted(engine: Engine, path: Path | None, token: str | None = None) -> AsyncIterator[EngineHost]:
    """`engine` served on `path` (None: a free TCP port on loopback) from this event loop, as `fishgate engine` serves
    it."""
    host = EngineHost(engine, token=token)
    server = await host.start_serving(claim_socket(path) if path else listen(TcpAddress("127.0.0.1", 0)))
    ticker = asyncio.get_running_loop().create_task(host.tick_forever())
    try:
        yield host
    finally:
        ticker.cancel()
        server.close()
        host.close_all()
        if path is not None:
            path.unlink(missing_ok=True)


@contextlib.asynccontextmanager
async def attached(path: Path | str, token: str | None = None) -> AsyncIterator[RemoteEngine]:
    remote = RemoteEngine(path if isinstance(path, str) else f"unix:{path}", token=token)
    remote.start()
    try:
        await until(lambda: remote.ready, "the remote engine never became ready")
        yield remote
    finally:
        remote.stop()


def wire(events: list[Event]) -> list[tuple]:
    """Events as comparable tuples (arrays as dtype, shape and bytes: bitwise)."""
    out: list[tuple] = []
    for ev in events:
        if isinstance(ev, AudioChunk):
            out.append(("audio", ev.utterance, ev.pcm.dtype.str, ev.pcm.tobytes()))
        elif isinstance(ev, SegmentDone):
            out.append(("segment", ev.utterance, ev.text, ev.frames, ev.ended_by, ev.codes.shape, ev.codes.tobytes()))
        else:
            out.append((type(ev).__name__, *dataclasses.astuple(ev)))
    return out


async def events_of_one_utterance(session: Session) -> list[Event]:
    for text in TEXTS:
        session.speak(text)
    session.end_utterance()
    events = []
    while not events or not isinstance(events[-1], UtteranceDone | SessionError):
        events.append(await asyncio.wait_for(session.next_event(), EVENT_TIMEOUT_S))
    return events


def test_remote_events_and_pcm_equal_the_in_process_engine_and_unread_audio_counts_on_the_engine(
    engine, socket_path
) -> None:
    async def main():
        local = await engine.admit(Voice(), SETTINGS)
        expected = await events_of_one_utterance(local)
        local.close()
        async with hosted(engine, socket_path), attached(socket_path) as remote:
            session = await remote.admit(Voice(), SETTINGS)
            assert isinstance(session, RemoteSession) and session.id in engine._sessions
            on_engine = engine._sessions[session.id]
            for text in TEXTS:
                session.speak(text)
            session.end_utterance()
            # nothing read yet: every sample posted is unread, here and (through the missing acks) on the engine
            await until(lambda: any(isinstance(e, UtteranceDone) for e in session._events), "no UtteranceDone")
            unread_here, unread_there = session.undelivered_samples, on_engine.undelivered_samples
            got = []
            while not got or not isinstance(got[-1], UtteranceDone):
                got.append(await session.next_event())
            await until(lambda: on_engine.undelivered_samples == 0, "the engine never heard the audio was read")
            open_during = (engine.open_sessions, remote.open_sessions)
            session.close()
            await until(lambda: engine.open_sessions == 0, "the engine kept the closed session")
            return expected, got, unread_here, unread_there, open_during

    expected, got, unread_here, unread_there, open_during = asyncio.run(main())
    assert wire(got) == wire(expected)  # bitwise: codes, PCM, chunk sizes, event order
    total = sum(len(e.pcm) for e in expected if isinstance(e, AudioChunk))
    assert total > 0 and unread_here == unread_there == total
    assert open_during == (1, 1)


def test_cancel_stops_the_remote_stream_and_the_session_goes_on(engine, socket_path) -> None:
    async def main():
        async with hosted(engine, socket_path), attached(socket_path) as remote:
            session = await remote.admit(Voice(), LONG)
            session.speak(LONG_TEXT)
            first = await asyncio.wait_for(session.next_event(), EVENT_TIMEOUT_S)
            session.cancel()
            cancelled = await collect(session)
            on_engine = engine._sessions[session.id]
            await until(lambda: engine.stats()["decoding"] == 0, "a row still decodes after the cancel")
            after = await speak(session, "And now something short.")
            await until(lambda: on_engine.undelivered_samples == 0, "dropped audio still counts as unread")
            session.close()
            return first, cancelled, after, session.undelivered_samples

    first, cancelled, after, unread = asyncio.run(main())
    assert isinstance(first, AudioChunk)
    assert cancelled.cancelled is not None and cancelled.done is None
    assert after.done is not None and after.done.reason == "stop" and len(after.pcm) == after.done.audio_samples > 0
    assert unread == 0


def test_engine_errors_cross_the_link_as_the_same_exceptions(engine, socket_path) -> None:
    async def main():
        async with hosted(engine, socket_path), attached(socket_path) as remote:
            with pytest.raises(UnsupportedLanguage) as remote_error:
                await remote.check_texts(["Hello.", "Привет, мир, как дела сегодня?"])
            with pytest.raises(UnsupportedLanguage) as local_error:
                await engine.check_texts(["Привет, мир, как дела сегодня?"])
            sessions = [await remote.admit(Voice(), SETTINGS) for _ in range(engine.capacity)]
            with pytest.raises(Overloaded):
                await remote.admit(Voice(), SETTINGS, wait_s=0)
            for s in sessions:
                s.close()
            rng = np.random.default_rng(0)
            audio = (0.1 * rng.standard_normal(44_100)).astype(np.float32)
            codes_remote = await remote.encode_reference(audio, 44_100)
            codes_local = await engine.encode_reference(audio, 44_100)
            return str(remote_error.value), str(local_error.value), codes_remote, codes_local

    remote_message, local_message, codes_remote, codes_local = asyncio.run(main())
    assert remote_message == local_message
    assert codes_remote.dtype == codes_local.dtype and np.array_equal(codes_remote, codes_local)


def test_a_vanished_gateway_has_all_its_sessions_closed_at_once(engine, socket_path) -> None:
    """The gateway's connection ends (a killed process: its socket reset): every session it held closes together,
    and the next turns decode none of them."""

    async def main():
        async with hosted(engine, socket_path) as host, attached(socket_path) as remote:
            sessions = [await remote.admit(Voice(), LONG) for _ in range(3)]
            for s in sessions:
                s.speak(LONG_TEXT)
            for s in sessions:
                await asyncio.wait_for(s.next_event(), EVENT_TIMEOUT_S)
            held = (engine.open_sessions, len(engine._worker.streams))
            link = remote._link
            assert link is not None
            link.writer.transport.abort()  # as the kernel does for a killed gateway
            cut = time.monotonic()
            await until(lambda: not engine._worker.streams, "the gateway's sessions still hold rows")
            freed_s = time.monotonic() - cut
            ended = [await collect(s) for s in sessions]  # the gateway side: its link lost, its sessions ended
            await until(lambda: remote.ready, "the gateway never reconnected")
            return held, freed_s, engine.open_sessions, ended, host.gateways, remote.reconnects

    held, freed_s, open_after, ended, gateways, reconnects = asyncio.run(main())
    assert held == (3, 3)
    assert open_after == 0 and freed_s < 1.0, freed_s
    for u in ended:
        assert u.errors and u.errors[-1].code == EngineUnavailable.code and u.errors[-1].fatal
    assert gateways == 1 and reconnects == 1


def test_a_vanished_engine_ends_every_session_fails_calls_at_once_and_is_found_again(engine, socket_path) -> None:
    async def main():
        async with attached_later(socket_path) as remote:
            async with hosted(engine, socket_path):
                await until(lambda: remote.ready, "never ready")
                session = await remote.admit(Voice(), LONG)
                session.speak(LONG_TEXT)
                await asyncio.wait_for(session.next_event(), EVENT_TIMEOUT_S)
            # the host is gone (its connections closed, as when the engine process dies)
            ended = await collect(session)
            state = remote.state
            t0 = time.monotonic()
            with pytest.raises(EngineUnavailable):
                await remote.admit(Voice(), SETTINGS)
            refused_s = time.monotonic() - t0
            await until(lambda: engine.open_sessions == 0, "the engine kept the session")
            async with hosted(engine, socket_path):
                await until(lambda: remote.ready, "the gateway never found the engine again", timeout_s=5)
                again = await speak(await remote.admit(Voice(), SETTINGS), *TEXTS)
            return ended, state, refused_s, again

    ended, state, refused_s, again = asyncio.run(main())
    assert ended.errors[-1].code == "engine_unavailable" and ended.errors[-1].fatal
    assert state is EngineState.UNAVAILABLE and refused_s < 0.1
    assert again.done is not None and len(again.pcm) > 0


def test_an_engine_service_drains_until_its_sessions_close_then_closes_the_link(socket_path) -> None:
    """EngineService, the life `fishgate engine` and the Ray engine replica share: a drain reaches the gateway while a
    running session goes on; it is done once that session closes; close ends the link and stops the engine."""

    async def main():
        with running_engine(max_sessions=2, warm_up=False) as engine:
            service = EngineService(engine)
            await service.start(claim_socket(socket_path))
            async with attached(socket_path) as remote:
                await until(lambda: remote.ready, "never ready")
                session = await remote.admit(Voice(), SETTINGS)
                service.drain(grace_s=60)
                await until(lambda: remote.state is EngineState.DRAINING, "the gateway never heard the drain")
                spoken = await speak(session, *TEXTS)
                done_while_open = service.done
                session.close()
                await asyncio.wait_for(service.until_done(), WAIT_S)
                await service.close()
                await until(lambda: remote.state is EngineState.UNAVAILABLE, "the link stayed up")
            return spoken, done_while_open, engine.state

    spoken, done_while_open, state = asyncio.run(main())
    assert spoken.done is not None and len(spoken.pcm) > 0
    assert not done_while_open and state is EngineState.STOPPED


def test_gateways_hear_an_engine_service_become_ready_at_once_not_at_the_next_status_tick(
    socket_path, monkeypatch
) -> None:
    """A gateway attached while the engine starts hears `ready` when the start ends: with the status tick an hour
    away, only the service's own announcement can tell it on the first link (a restart ends that much sooner; without
    it the gateway would give the silent link up after LINK_SILENCE_S and hear `ready` on a second one)."""
    monkeypatch.setattr("streaming.engine_link.host.STATUS_INTERVAL_S", 3600.0)
    loading = threading.Event()

    def gated_backend(config: BackendConfig) -> Backend:
        assert loading.wait(WAIT_S), "the test never let the engine load"
        return Backend(config)

    async def main():
        engine = Engine(EngineConfig(BackendConfig(max_sessions=2), WorkerLimits(), warm_up=False,
                                     backend_factory=gated_backend))  # fmt: skip
        service = EngineService(engine)
        try:
            await service.start(claim_socket(socket_path))
            remote = RemoteEngine(f"unix:{socket_path}")
            remote.start()
            try:
                await until(lambda: remote.state is EngineState.STARTING, "the gateway never attached")
                loading.set()
                await until(lambda: remote.ready, "the gateway never heard the engine become ready")
                return remote.info is not None, remote.reconnects
            finally:
                remote.stop()
        finally:
            loading.set()
            await service.close()

    has_info, reconnects = asyncio.run(main())
    assert has_info and reconnects == 0


@contextlib.asynccontextmanager
async def attached_later(path: Path) -> AsyncIterator[RemoteEngine]:
    """A gateway started before its engine (it retries until the engine listens)."""
    remote = RemoteEngine(f"unix:{path}")
    remote.start()
    try:
        yield remote
    finally:
        remote.stop()


def test_two_gateways_share_one_engine(engine, socket_path) -> None:
    async def main():
        async with hosted(engine, socket_path) as host, attached(socket_path) as a, attached(socket_path) as b:
            sa, sb = await a.admit(Voice(), SETTINGS), await b.admit(Voice(), SETTINGS)
            counts = (engine.open_sessions, a.open_sessions, b.open_sessions, host.gateways)
            ua, ub = await asyncio.gather(speak(sa, *TEXTS), speak(sb, *TEXTS))
            sa.close()
            sb.close()
            await until(lambda: a.stats().get("sessions") == 0, "the engine's counters never reached the gateway")
            return counts, ua, ub, a.stats(), b.gpu_memory_bytes()

    counts, ua, ub, stats, _ = asyncio.run(main())
    assert counts == (2, 1, 1, 2)
    assert np.array_equal(ua.pcm, ub.pcm) and ua.done is not None  # one seed, one audio, whichever gateway asks
    assert stats["state"] == "ready" and stats["link_up"] == 1 and stats["vocoded_frames"] > 0


def test_a_tcp_link_takes_the_right_token_and_refuses_a_wrong_or_missing_one_once_with_the_fix(
    engine, socket_path, caplog
) -> None:
    async def main():
        async with hosted(engine, None, token="s3cret") as host:
            address = host.bound_address
            assert address is not None and address.startswith("tcp:127.0.0.1:") and not address.endswith(":0")
            async with attached(address, token="s3cret") as good:
                session = await good.admit(Voice(), SETTINGS)
                spoken = await speak(session, *TEXTS)
                session.close()
                link = good._link
                assert link is not None
                nodelay = link.writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
            wrong, missing = RemoteEngine(address, token="guess"), RemoteEngine(address)
            wrong.start()
            missing.start()
            try:
                await until(lambda: wrong.refused and missing.refused, "the engine never refused the wrong tokens")
                first = wrong.reconnects
                window_s = 1.5
                await asyncio.sleep(window_s)  # the retries within a window: backing off to one a second
                tries = wrong.reconnects - first
                with pytest.raises(EngineUnavailable):
                    await wrong.admit(Voice(), SETTINGS)
                outcome = (wrong.state, wrong.refused, missing.refused, host.refusals.refused, tries, window_s)
            finally:
                wrong.stop()
                missing.stop()
        async with hosted(engine, socket_path, token="s3cret"), attached_later(socket_path) as unix:
            await until(lambda: unix.refused, "a Unix link without the token was not refused")
        return spoken, nodelay, outcome

    with caplog.at_level(logging.INFO):
        spoken, nodelay, (state, wrong_why, missing_why, refused, tries, window_s) = asyncio.run(main())
    assert spoken.done is not None and len(spoken.pcm) > 0 and nodelay
    assert state is EngineState.UNAVAILABLE
    for why in (wrong_why, missing_why):
        assert "refused this gateway's token" in why and "set FISHGATE_ENGINE_TOKEN to the engine's token" in why
    assert 1 <= tries <= window_s / 0.25, tries  # retried, at most a second apart once backed off: no storm
    said = [r.getMessage() for r in caplog.records if "refused this gateway" in r.getMessage()]
    assert len(said) == 3, said  # once for each gateway (wrong, missing, Unix), however often it retried
    logged = [r for r in caplog.records if r.name == "streaming.engine_link.auth"]
    assert refused > 3 and len(logged) == 2  # each host logs its first refusal, then at most once a minute


def test_nothing_but_a_hello_is_read_before_a_gateway_is_welcomed(engine) -> None:
    async def main():
        async with hosted(engine, None, token="s3cret") as host:
            port = int(str(host.bound_address).rsplit(":", 1)[1])
            answers = []
            for first in (
                frame([Op.CALL, 1, "admit", []]),  # a call before any HELLO
                (2**20).to_bytes(4, "big"),  # a 1 MB frame announced before any HELLO
                frame([Op.HELLO, PROTOCOL_VERSION, "probe", "guess"]),  # the wrong token
                frame([Op.HELLO, PROTOCOL_VERSION - 1, "old", "s3cret"]),  # another version
            ):
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(first)
                answers.append(FrameDecoder().feed(await asyncio.wait_for(reader.read(), WAIT_S)))  # read to EOF
                writer.close()
            return answers, host.gateways

    (call, big, wrong, old), gateways = asyncio.run(main())
    assert call == big == [] and gateways == 0  # closed unanswered
    assert wrong == [[Op.REFUSED, "the engine refused this gateway's token (wrong or missing)"]]
    assert len(old) == 1 and old[0][:2] == [Op.WELCOME, PROTOCOL_VERSION] and old[0][2] is None  # says its version


def test_the_engines_headroom_reaches_the_gateway_which_counts_its_own_admits_at_once(engine, socket_path) -> None:
    async def main():
        async with hosted(engine, socket_path), attached(socket_path) as remote:
            await until(lambda: remote.headroom == engine.capacity, "the headroom never reached the gateway")
            session = await remote.admit(Voice(), SETTINGS)
            at_once = remote.headroom  # before the engine's next STATUS
            link = remote._link
            assert link is not None
            await until(lambda: link.admits_unreported == 0, "no STATUS after the admit")
            reported = (link.reported_headroom, engine.headroom())
            session.close()
            await until(lambda: remote.headroom == engine.capacity, "the closed session still counts")
            return at_once, reported

    at_once, reported = asyncio.run(main())
    assert at_once == engine.capacity - 1 and reported == (engine.capacity - 1, engine.capacity - 1)


def test_headroom_follows_the_real_time_admission(engine) -> None:
    worker = engine._worker
    saved = worker.admission
    admission = RealtimeAdmission(frame_s=0.05, max_turn_fraction=0.8)
    limit_s = 0.04
    try:
        worker.admission = admission
        no_estimate = engine.headroom()
        admission.record_turn(limit_s / 2, rows=1)  # one stream in half the limit: about 2 fit
        estimated = engine.headroom()
        admission.record_turn(10 * limit_s, rows=1)  # far behind real time
        behind = engine.headroom()
    finally:
        worker.admission = saved
    assert (no_estimate, estimated, behind) == (engine.capacity, 2, 0)


# ---- the socket path and the wire format (no engine) ---------------------------------------------------------------
def test_a_stale_socket_is_taken_over_and_a_live_one_or_a_file_refused(socket_path) -> None:
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(socket_path))
    stale.close()  # bound, never unlinked: what a killed engine leaves behind
    live = claim_socket(socket_path)
    try:
        with pytest.raises(CannotListen, match=f"already listening on unix:{socket_path}"):
            claim_socket(socket_path)
    finally:
        live.close()
    socket_path.unlink()
    socket_path.write_text("not a socket")
    with pytest.raises(CannotListen, match="is not a socket"):
        claim_socket(socket_path)


def test_frames_cut_anywhere_decode_whole_and_oversized_ones_break_the_link() -> None:
    messages = [[Op.AUDIO, 7, 0, np.arange(1000, dtype=np.float32).tobytes()], [Op.STATUS, "ready"], [Op.ACK, [1, 2]]]
    data = b"".join(frame(m) for m in messages)
    for step in (1, 3, 4096):
        decoder = FrameDecoder()
        got = [m for i in range(0, len(data), step) for m in decoder.feed(data[i : i + step])]
        assert got == [[int(m[0]), *m[1:]] for m in messages]
    with pytest.raises(LinkBroken):
        FrameDecoder().feed((MAX_FRAME_BYTES + 1).to_bytes(4, "big"))
    with pytest.raises(LinkBroken):
        FrameDecoder().feed(b"\x00\x00\x00\x01\xc1")  # 0xc1: never used in MessagePack


def test_settings_and_model_info_cross_unchanged(engine) -> None:
    settings = SynthesisSettings(temperature=0.3, seed=None, latency=SETTINGS.latency, max_audio_s=12.5)
    assert unpack_settings(pack_settings(settings)) == settings
    assert unpack_info(pack_info(engine.info)) == engine.info

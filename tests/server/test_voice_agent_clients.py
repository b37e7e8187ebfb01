"""Voice-agent frameworks' own TTS clients, pinned and unchanged, against a real fishgate server on the default model.

LiveKit Agents' Fish Audio plugin pools one live socket across turns and sends a new `start` each turn; pipecat's
FishAudioTTSService keeps one socket and one `start` for a whole conversation and reconnects on a barge-in; both
frameworks' OpenAI TTS services post to `/v1/audio/speech` with their own default model and voice names. What each
client sends by default is written up in shared/ANCHORS.md ("How voice-agent clients really connect").

Users point pipecat's Fish service at fishgate by overriding its `_base_url` attribute (its URL is hard-coded to Fish's
cloud); that workaround is what these tests do. Every wait is bounded: a client that hangs fails its test.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterator

import aiohttp
import httpx
import pytest
import websockets
from livekit.agents import APIConnectOptions, APIError, APIStatusError
from livekit.agents.tts import TTSError
from livekit.agents.types import NOT_GIVEN
from livekit.plugins import fishaudio as lk_fish
from livekit.plugins import openai as lk_openai
from pipecat.frames.frames import (
    EndFrame,
    ErrorFrame,
    Frame,
    InterruptionFrame,
    TTSAudioRawFrame,
    TTSSpeakFrame,
    TTSStoppedFrame,
)
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.worker import PipelineParams, PipelineWorker
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor
from pipecat.services.fish.tts import FishAudioTTSService
from pipecat.services.openai.tts import OpenAITTSService
from pipecat.workers.runner import WorkerRunner

from streaming.errors import UnknownVoice
from tests.server.conftest import ServerHandle
from tests.server.http_helpers import clip

VOICE = "agent-voice"  # a voice stored on the server, as a LiveKit user would name their own
TURNS = [
    "Hello there, how can I help you today?",
    "Sure. Let me look that up for you.",
    "Your order ships tomorrow morning.",
]
LONG = (
    "This answer is long on purpose. It goes on for several sentences. Each one is sent on its own. "
    "The listener will cut it short. Nobody should hear the rest of it. It keeps going for a while yet."
)
TURN_TIMEOUT_S = 60.0  # one turn on the CPU test machine; a hang fails instead of blocking the suite


def run(coro: Awaitable) -> object:
    return asyncio.run(asyncio.wait_for(coro, 240))


@pytest.fixture(scope="module")
def voice(server: ServerHandle) -> Iterator[str]:
    files = {"audio": ("v.wav", clip(1.5), "audio/wav")}
    r = httpx.post(f"{server.base_url}/v1/references", data={"id": VOICE, "text": "A clip."}, files=files, timeout=60)
    assert r.status_code == 201, r.text
    yield VOICE
    httpx.delete(f"{server.base_url}/v1/references/{VOICE}", timeout=30)


def wait_until_idle(server: ServerHandle, timeout_s: float = 10.0) -> int:
    """Engine sessions still open after `timeout_s` (0: everything the clients started has been released)."""
    deadline = time.monotonic() + timeout_s
    while server.gateway.engine.stats()["sessions"] and time.monotonic() < deadline:
        time.sleep(0.05)
    return server.gateway.engine.stats()["sessions"]


def errors_sent(server: ServerHandle) -> dict[str, float]:
    """The server's count of `error` events and error responses so far, by code (fishgate_errors_total)."""
    return {
        sample.labels["code"]: sample.value
        for family in server.gateway.metrics.registry.collect()
        if family.name == "fishgate_errors"
        for sample in family.samples
        if sample.name == "fishgate_errors_total"
    }


def errors_since(server: ServerHandle, before: dict[str, float]) -> dict[str, float]:
    return {code: n - before.get(code, 0.0) for code, n in errors_sent(server).items() if n != before.get(code, 0.0)}


# ---- LiveKit Agents: livekit-plugins-fishaudio ------------------------------------------------------------------------


class LiveKitFish:
    """One `fishaudio.TTS` outside any room or job: its own aiohttp session (`http_session=`), whose trace hooks count
    the WebSocket handshakes the plugin makes, and the TTS's `error` events (one per failed attempt, retried or not)."""

    def __init__(self, server: ServerHandle, **options) -> None:
        self.handshakes: list[str] = []
        self.errors: list[TTSError] = []

        async def on_request_start(_session, _ctx, params: aiohttp.TraceRequestStartParams) -> None:
            if params.url.path == "/v1/tts/live":
                self.handshakes.append(str(params.url))

        trace = aiohttp.TraceConfig()
        trace.on_request_start.append(on_request_start)
        self.session = aiohttp.ClientSession(trace_configs=[trace])
        self.tts = lk_fish.TTS(base_url=server.base_url, api_key="x", http_session=self.session, **options)
        self.tts.on("error", self.errors.append)

    async def turn(
        self, text: str, *, interrupt_after_first_audio: bool = False, **stream_options
    ) -> tuple[list, float]:
        """One agent turn: push the text, end the input, read the frames; returns them and the seconds to the first."""
        t0 = time.perf_counter()
        first = float("inf")
        frames = []
        async with self.tts.stream(**stream_options) as stream:
            stream.push_text(text)
            stream.end_input()
            async with asyncio.timeout(TURN_TIMEOUT_S):
                async for ev in stream:
                    if not frames:
                        first = time.perf_counter() - t0
                    frames.append(ev.frame)
                    if interrupt_after_first_audio:
                        break  # leaving the block acloses the stream mid-turn, as an agent's barge-in does
        return frames, first

    async def aclose(self) -> None:
        await self.tts.aclose()
        await self.session.close()


def audio_seconds(frames: list) -> float:
    return sum(f.duration for f in frames)


def test_livekit_fish_plugin_reuses_one_socket_across_turns(server: ServerHandle, voice: str) -> None:
    async def main():
        lk = LiveKitFish(server, voice_id=voice)
        try:
            return [await lk.turn(text) for text in TURNS], lk.handshakes, lk.errors
        finally:
            await lk.aclose()

    before = errors_sent(server)
    turns, handshakes, errors = run(main())
    assert errors_since(server, before) == {}
    for frames, _ in turns:
        assert audio_seconds(frames) > 0.1 and frames[0].sample_rate == 24000  # the plugin's default: wav at 24 kHz
    # a pooled socket the server had closed would fail the next turn and retry it on a new socket: an error event each
    assert errors == []
    assert len(handshakes) == 1, handshakes
    first = turns[0][1]
    later = [ttfa for _, ttfa in turns[1:]]
    assert max(later) <= 3 * first + 1.0, (first, later)  # no reconnect, no retry back-off on a reused socket
    assert wait_until_idle(server) == 0


def test_livekit_fish_plugin_barge_in_then_next_turn(server: ServerHandle, voice: str) -> None:
    async def main():
        lk = LiveKitFish(server, voice_id=voice)
        try:
            before, _ = await lk.turn(TURNS[0])
            cut, _ = await lk.turn(LONG, interrupt_after_first_audio=True)
            after, _ = await lk.turn(TURNS[1])
            return before, cut, after, lk.handshakes, lk.errors
        finally:
            await lk.aclose()

    before, cut, after, handshakes, errors = run(main())
    assert audio_seconds(before) > 0.1 and len(cut) == 1 and audio_seconds(after) > 0.1
    assert errors == []
    # the plugin drops a socket whose turn was cancelled (it may still carry that turn's audio) and opens a new one
    assert len(handshakes) == 2, handshakes
    assert wait_until_idle(server) == 0  # the abandoned turn's engine session was released when its socket closed


def test_livekit_fish_plugin_default_voice_id_fails_fast(server: ServerHandle, voice: str) -> None:
    """The plugin sends Fish's cloud voice 933563129e564b19a115bedd57b7406a unless told otherwise: unknown here. The
    turn must end in `finish(error)` at once (the plugin has no receive timeout: a silent server hangs the agent)."""

    async def main():
        lk = LiveKitFish(server)  # no voice_id: the plugin's default
        assert lk.tts.voice_id == lk_fish.tts.DEFAULT_VOICE_ID
        try:
            t0 = time.perf_counter()
            with pytest.raises(APIStatusError) as info:
                await lk.turn(TURNS[0], conn_options=APIConnectOptions(max_retry=0))
            no_retry_s = time.perf_counter() - t0
            # the plugin's default connect options retry a failed turn 3 times (after 0.1 s, 2 s, 2 s), each on a new
            # socket: every attempt must fail as fast
            t0 = time.perf_counter()
            with pytest.raises(APIError):
                await lk.turn(TURNS[0])
            default_s = time.perf_counter() - t0
            # the socket after such a failure is not the plugin's to reuse, but a good turn on the same TTS still works
            lk.tts.update_options(voice_id=voice)
            good, _ = await lk.turn(TURNS[1])
            return info.value, no_retry_s, default_s, good, lk.handshakes, lk.errors
        finally:
            await lk.aclose()

    before = errors_sent(server)
    error, no_retry_s, default_s, good, handshakes, errors = run(main())
    sent = errors_since(server, before)
    # each of the 5 attempts failed on the voice; the server answers the failed turn's own flush once more with
    # `not_started` (by then the plugin has raised on the first finish(error) and dropped the socket)
    assert sent == {UnknownVoice.code: 5}, sent  # the answers to the failed turns' flushes are not counted again
    assert "reason': 'error'" in str(error.body)  # the finish(error) the plugin raises on
    assert no_retry_s < 2.0
    assert default_s < 0.1 + 2 + 2 + 4 * 1.0, default_s
    assert len(handshakes) == 1 + 4 + 1 and [e.recoverable for e in errors] == [False, True, True, True, False]
    assert audio_seconds(good) > 0.1


def test_livekit_fish_plugin_without_a_voice_speaks_the_models_own(server: ServerHandle) -> None:
    async def main():
        lk = LiveKitFish(server, voice_id=NOT_GIVEN)  # reference_id: null
        try:
            return await lk.turn(TURNS[0]), lk.errors
        finally:
            await lk.aclose()

    (frames, _), errors = run(main())
    assert audio_seconds(frames) > 0.1 and errors == []


def test_livekit_fish_plugin_synthesize_posts_msgpack_to_v1_tts(server: ServerHandle, voice: str) -> None:
    """`synthesize()` (one text, no socket) posts the same request as msgpack to fish-speech's `POST /v1/tts`."""

    async def main():
        lk = LiveKitFish(server, voice_id=voice)
        try:
            stream = lk.tts.synthesize(TURNS[0], conn_options=APIConnectOptions(max_retry=0))
            async with stream:
                return [ev.frame async for ev in stream], lk.handshakes
        finally:
            await lk.aclose()

    frames, handshakes = run(main())
    assert audio_seconds(frames) > 0.1 and frames[0].sample_rate == 24000 and handshakes == []


# ---- pipecat: FishAudioTTSService in a pipeline -----------------------------------------------------------------------


class Recorder(FrameProcessor):
    """Records the frames that pass it in one direction (with their arrival time) and passes everything on."""

    def __init__(self, direction: FrameDirection) -> None:
        super().__init__()
        self.direction = direction
        self.frames: list[tuple[float, Frame]] = []

    async def process_frame(self, frame: Frame, direction: FrameDirection) -> None:
        await super().process_frame(frame, direction)
        if direction == self.direction:
            self.frames.append((time.monotonic(), frame))
        await self.push_frame(frame, direction)

    def of(self, kind: type) -> list:
        return [f for _, f in self.frames if isinstance(f, kind)]

    async def wait_for(self, predicate: Callable[[Frame], bool], timeout_s: float = TURN_TIMEOUT_S) -> Frame:
        deadline = time.monotonic() + timeout_s
        while True:
            for _, f in self.frames:
                if predicate(f):
                    return f
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"no such frame within {timeout_s} s; got {[type(f).__name__ for _, f in self.frames]}"
                )
            await asyncio.sleep(0.02)


Script = Callable[[PipelineWorker, Recorder, Recorder], Awaitable[object]]


async def run_pipeline(service: FrameProcessor, script: Script) -> tuple[object, Recorder, Recorder]:
    """[upstream recorder, service, downstream recorder] in a PipelineWorker (pipecat's task), driven by `script`."""
    up, down = Recorder(FrameDirection.UPSTREAM), Recorder(FrameDirection.DOWNSTREAM)
    worker = PipelineWorker(Pipeline([up, service, down]), params=PipelineParams(), cancel_on_idle_timeout=False)
    started = asyncio.Event()
    result: list[object] = []

    @worker.event_handler("on_pipeline_started")
    async def _started(_worker, _frame) -> None:
        started.set()

    async def drive() -> None:
        try:
            await asyncio.wait_for(started.wait(), 30)
            result.append(await script(worker, up, down))
        finally:
            await worker.queue_frame(EndFrame())

    runner = WorkerRunner(handle_sigint=False)
    await runner.add_workers(worker)
    await asyncio.gather(runner.run(), drive())
    return result[0], up, down


def contexts_with_audio(down: Recorder) -> list[str]:
    """The TTS contexts (one per TTSSpeakFrame) that sent audio down the pipeline, in order of their first audio."""
    seen: list[str] = []
    for f in down.of(TTSAudioRawFrame):
        if f.context_id not in seen:
            seen.append(f.context_id)
    return seen


def test_pipecat_fish_service_two_turns_barge_in_and_a_third(server: ServerHandle) -> None:
    connects: list[float] = []

    async def script(worker: PipelineWorker, up: Recorder, down: Recorder):
        def audio_of(n: int) -> Callable[[Frame], bool]:
            return lambda f: isinstance(f, TTSAudioRawFrame) and len(contexts_with_audio(down)) >= n

        def stopped(ctx: str) -> Callable[[Frame], bool]:
            return lambda f: isinstance(f, TTSStoppedFrame) and f.context_id == ctx

        await worker.queue_frame(TTSSpeakFrame(TURNS[0]))
        await down.wait_for(audio_of(1))
        await down.wait_for(stopped(contexts_with_audio(down)[0]))  # pipecat ends an utterance 3 s after its audio
        await worker.queue_frame(TTSSpeakFrame(LONG))
        await down.wait_for(audio_of(2))
        interrupted_at = time.monotonic()
        await worker.queue_frame(InterruptionFrame())  # the user barges in while the answer streams
        await asyncio.sleep(0.5)
        await worker.queue_frame(TTSSpeakFrame(TURNS[2]))
        await down.wait_for(audio_of(3))
        await down.wait_for(stopped(contexts_with_audio(down)[2]))
        return interrupted_at

    async def main():
        tts = FishAudioTTSService(api_key="x")
        tts._base_url = server.ws_url  # the only way to leave Fish's cloud (pipecat-ai 1.14)

        @tts.event_handler("on_connected")
        async def _connected(_service) -> None:
            connects.append(time.monotonic())

        return await run_pipeline(tts, script)

    interrupted_at, up, down = run(main())
    turns = contexts_with_audio(down)
    assert len(turns) == 3, turns
    audio = down.of(TTSAudioRawFrame)
    for ctx in turns:
        assert sum(len(f.audio) for f in audio if f.context_id == ctx) > 0.1 * 24000 * 2
    assert all(f.sample_rate == 24000 and f.num_channels == 1 for f in audio)
    # nothing of the interrupted answer reaches the pipeline's end after the barge-in was handled
    cut = [t for t, f in down.frames if isinstance(f, TTSAudioRawFrame) and f.context_id == turns[1]]
    assert max(cut) < interrupted_at + 0.5
    assert up.of(ErrorFrame) == []
    assert len(connects) == 2  # the first connect, and the reconnect pipecat makes on a barge-in
    assert wait_until_idle(server) == 0


# ---- OpenAI-compatible TTS services with their framework defaults -----------------------------------------------------


def test_livekit_openai_plugin_defaults(server: ServerHandle) -> None:
    """model gpt-4o-mini-tts, voice ash, mp3, stream_format sse (the plugin's defaults), decoded by the plugin."""

    async def main():
        tts = lk_openai.TTS(base_url=f"{server.base_url}/v1", api_key="x")
        assert (tts.model, tts._opts.voice, tts._opts.response_format) == ("gpt-4o-mini-tts", "ash", "mp3")
        try:
            stream = tts.synthesize(TURNS[0], conn_options=APIConnectOptions(max_retry=0))
            async with stream:
                return [ev.frame async for ev in stream]
        finally:
            await tts.aclose()

    frames = run(main())
    assert audio_seconds(frames) > 0.1 and frames[0].sample_rate == 24000


def test_pipecat_openai_service_defaults(server: ServerHandle) -> None:
    """voice alloy, model gpt-4o-mini-tts, response_format pcm at 24 kHz (pipecat's defaults)."""

    async def script(worker: PipelineWorker, up: Recorder, down: Recorder):
        await worker.queue_frame(TTSSpeakFrame(TURNS[0]))
        await down.wait_for(lambda f: isinstance(f, TTSStoppedFrame))

    async def main():
        tts = OpenAITTSService(api_key="x", base_url=f"{server.base_url}/v1")
        try:
            return await run_pipeline(tts, script)
        finally:
            await tts._client.close()  # the service never closes its AsyncOpenAI client (pipecat-ai 1.14)

    _, up, down = run(main())
    audio = down.of(TTSAudioRawFrame)
    assert sum(len(f.audio) for f in audio) > 0.1 * 24000 * 2 and all(f.sample_rate == 24000 for f in audio)
    assert up.of(ErrorFrame) == []


# ---- the handshake: no permessage-deflate ----------------------------------------------------------------------------


def test_websocket_handshake_negotiates_no_compression(server: ServerHandle) -> None:
    """`websockets` at its defaults offers permessage-deflate, as pipecat and browsers do; the server declines it
    (deflating PCM saves ~4 % and costs every audio frame a compression pass on the event loop)."""

    async def main():
        async with websockets.connect(server.ws_url) as ws:
            offered = ws.request.headers.get("Sec-WebSocket-Extensions", "")
            return offered, ws.response.headers.get("Sec-WebSocket-Extensions"), ws.protocol.extensions

    offered, answered, extensions = run(main())
    assert "permessage-deflate" in offered  # the client did ask
    assert answered is None and extensions == []

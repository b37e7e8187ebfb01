"""`fishgate ttfa`: what a listener feels, measured against any Fish-live-compatible WebSocket URL.

Speaks plain Fish live MessagePack (`start`, `text`…, `stop`; reads `audio` and `finish`, ignores other events;
our own `timing` event is kept only as a cross-check). Per request: time from the first text frame sent to the
first byte of samples received, inter-chunk gaps, underruns of a simulated real-time player whose clock starts at
the first audio byte, real-time factor and audio seconds. Levels of concurrency run one after another, each as
`concurrency` workers pulling unique texts. Tables, JSON and plots are `ttfa_report`'s; printing is the CLI's.

By default it connects as real voice-agent clients do: it offers permessage-deflate (browsers, the `websockets`
library and pipecat do), and each worker keeps one socket for its successive requests, sending the next `start` after
reading `finish` (LiveKit's Fish plugin pools sockets so). A pooled socket the server closed is replaced by a new one
(a reconnect, counted). `compression="off"` and `sockets="per-request"` restore a bare client: no compression, a new
connection per request. Either way time to first audio starts at each request's first text frame; connecting is
`connect_ms`, and each request records whether it opened its own connection.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import re
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack

DEFAULT_URL = "ws://127.0.0.1:7860/v1/tts/live"
MEASURED_FORMATS = ("pcm", "wav")  # formats whose bytes we can count as samples without a decoder
WAV_HEADER_BYTES = 44  # the canonical RIFF header every Fish-compatible server sends for streaming WAV
BYTES_PER_SAMPLE = 2  # s16le mono, what pcm and wav carry
# Frames larger than this are refused by the client (a chunk of 24 codec frames at 44.1 kHz is ~100 kB).
MAX_FRAME_BYTES = 32 * 2**20
COMPRESSION_MODES = ("deflate", "off")  # deflate: offer permessage-deflate as the websockets client does by default
SOCKET_MODES = ("reuse", "per-request")  # reuse: one socket per worker across its requests (LiveKit's pool)
_TOKEN = re.compile(r"\s*\S+\s*|\s+")  # word-ish tokens, each keeping its surrounding whitespace

# Varied sentences (statements, questions, numbers, lists, quotes, long clauses) for unique request texts.
CORPUS = (
    "The quick brown fox jumps over the lazy dog.",
    "Could you tell me the way to the nearest train station, please?",
    "Our meeting has been moved to Thursday at half past three.",
    "She sells sea shells by the sea shore, and the shells she sells are surely sea shells.",
    "Warning: the bridge is closed for repairs until the end of the month.",
    "I ordered two coffees, one tea and a slice of lemon cake.",
    "It was the best of times, it was the worst of times.",
    "Please remember to water the plants while I am away.",
    "The temperature tomorrow will reach twenty-three degrees, with light winds from the west.",
    "Why does the moon look larger when it is close to the horizon?",
    "Turn left at the second light, then keep going until you see the bakery.",
    "My grandmother grew tomatoes, beans and sunflowers in a tiny garden behind the house.",
    "Flight 418 to Lisbon is now boarding at gate twelve.",
    "He opened the letter slowly, afraid of what it might say.",
    "If the battery drops below ten percent, the device will switch to power saving mode.",
    "Thank you for calling; all of our agents are currently busy.",
    "The library closes early on Sundays, so come before four.",
    "A gentle rain fell on the quiet streets of the old town.",
    "Do you prefer the blue one or the green one?",
    "The recipe calls for three eggs, a cup of flour and a pinch of salt.",
    "Scientists have discovered a new species of frog in the rainforest.",
    "Your package was delivered this morning and left at the front door.",
    "Let me know if there is anything else I can help you with today.",
    "The orchestra tuned their instruments as the audience took their seats.",
    "Traffic on the northern highway is moving slowly because of an accident near exit nine.",
    "Never underestimate the power of a good night's sleep.",
    "The museum's new exhibition features paintings from the early twentieth century.",
    "We will arrive at around seven, so please don't wait for us to start dinner.",
    "Is it true that octopuses have three hearts?",
    "The printer on the second floor is out of paper again.",
    "After a long climb, they finally reached the summit and watched the sun rise over the valley.",
    "Press one for sales, press two for support, or stay on the line.",
)


# ---- simulated playout ------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Underrun:
    at_s: float  # when the player's buffer ran dry, seconds since the first text frame
    gap_ms: float  # how long playback waited for the next chunk


@dataclass(frozen=True, slots=True)
class Playout:
    first_audio_s: float | None  # arrival of the first byte of samples; None when no audio came
    audio_s: float  # seconds of audio received
    end_s: float | None  # when the player finished the last sample
    underruns: tuple[Underrun, ...]
    chunk_gaps_ms: tuple[float, ...]  # between consecutive audio-bearing frames

    @property
    def underrun_ms(self) -> float:
        return sum(u.gap_ms for u in self.underruns)


def simulate_playout(arrivals: Sequence[tuple[float, int]], sample_rate_hz: int) -> Playout:
    """A real-time player fed by `arrivals` ((time_s, samples) in arrival order; 0-sample frames ignored).

    Playback starts with the first sample's arrival and consumes `sample_rate_hz` samples per second. When the
    buffer is empty before the next chunk arrives (strictly earlier), that is an underrun: playback waits and
    resumes the moment the chunk arrives, so later chunks are due correspondingly later.
    """
    first_s: float | None = None
    play_end_s = 0.0
    prev_s = 0.0
    total_samples = 0
    underruns: list[Underrun] = []
    gaps_ms: list[float] = []
    for t_s, samples in arrivals:
        if samples <= 0:
            continue
        duration_s = samples / sample_rate_hz
        if first_s is None:
            first_s = t_s
            play_end_s = t_s + duration_s
        else:
            gaps_ms.append((t_s - prev_s) * 1000.0)
            if t_s > play_end_s:
                underruns.append(Underrun(play_end_s, (t_s - play_end_s) * 1000.0))
                play_end_s = t_s + duration_s
            else:
                play_end_s += duration_s
        prev_s = t_s
        total_samples += samples
    return Playout(
        first_audio_s=first_s,
        audio_s=total_samples / sample_rate_hz,
        end_s=play_end_s if first_s is not None else None,
        underruns=tuple(underruns),
        chunk_gaps_ms=tuple(gaps_ms),
    )


class SampleCounter:
    """Counts s16le samples in a pcm or wav byte stream: skips the WAV header (reading its rate), keeps odd bytes."""

    def __init__(self, fmt: str, sample_rate_hz: int) -> None:
        if fmt not in MEASURED_FORMATS:
            raise ValueError(f"format {fmt!r} cannot be measured; use one of {', '.join(MEASURED_FORMATS)}")
        self.sample_rate_hz = sample_rate_hz
        self._header_left = WAV_HEADER_BYTES if fmt == "wav" else 0
        self._header = bytearray()
        self._sample_bytes = 0

    def feed(self, data: bytes) -> int:
        """Bytes of one audio frame → whole samples completed by it (a header is not audio)."""
        if self._header_left:
            head = data[: self._header_left]
            self._header += head
            self._header_left -= len(head)
            data = data[len(head) :]
            if not self._header_left and self._header[:4] == b"RIFF" and self._header[8:12] == b"WAVE":
                self.sample_rate_hz = struct.unpack_from("<I", self._header, 24)[0] or self.sample_rate_hz
        before = self._sample_bytes // BYTES_PER_SAMPLE
        self._sample_bytes += len(data)
        return self._sample_bytes // BYTES_PER_SAMPLE - before


# ---- one request ------------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class ProbeConfig:
    url: str = DEFAULT_URL
    format: str = "pcm"
    sample_rate_hz: int = 44_100
    tokens_per_s: float | None = None  # None: the whole text in one frame
    api_key: str | None = None
    model: str | None = None  # the `model` handshake header Fish clients send
    latency: str | None = None  # Fish `latency`; None: the server's default
    reference_id: str | None = None
    seed: int | None = None  # fishgate extension (other servers ignore unknown fields)
    max_new_tokens: int | None = None  # Fish `max_new_tokens` (frames per text segment); None: the server's default
    timeout_s: float = 120.0  # per request, connect to finish
    ramp_s: float = 0.0  # worker i of a level starts i/N of this after the first: arrivals spread, not a burst
    compression: str = "deflate"  # one of COMPRESSION_MODES
    sockets: str = "reuse"  # one of SOCKET_MODES

    def request(self) -> dict[str, Any]:
        req: dict[str, Any] = {"text": "", "format": self.format, "sample_rate": self.sample_rate_hz}
        optional = (
            ("latency", self.latency), ("reference_id", self.reference_id), ("seed", self.seed),
            ("max_new_tokens", self.max_new_tokens),
        )  # fmt: skip
        for key, value in optional:
            if value is not None:
                req[key] = value
        return req

    def connect_options(self) -> dict[str, Any]:
        """Keyword arguments of websockets' `connect`: compression as chosen, no keepalive pings (none would be
        answered late enough to matter within a request), frames up to MAX_FRAME_BYTES."""
        return {
            "additional_headers": self.headers(),
            "max_size": MAX_FRAME_BYTES,
            "compression": None if self.compression == "off" else "deflate",
            "open_timeout": self.timeout_s,
            "ping_interval": None,
        }

    def headers(self) -> dict[str, str]:
        headers = {}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        if self.model:
            headers["model"] = self.model
        return headers


@dataclass
class RequestResult:
    """One request's raw numbers; times are seconds since its first text frame unless named `_ms`."""

    concurrency: int
    index: int
    text: str
    text_frames: int
    started_s: float = 0.0  # first text frame, seconds since the level began
    connect_ms: float | None = None  # None when the request ran on its worker's open socket
    fresh_connection: bool = True  # it opened its own connection (always, with sockets="per-request")
    reconnect: bool = False  # sockets="reuse": a new socket, the worker's previous one was closed (server or error)
    extensions: list[str] = field(default_factory=list)  # negotiated on its connection, e.g. ["permessage-deflate"]
    compression: str = "deflate"  # the client's settings (ProbeConfig), so each result says what produced it
    sockets: str = "reuse"
    ttfa_ms: float | None = None
    audio_s: float = 0.0
    wall_s: float | None = None  # first text frame → last audio byte (generation wall time)
    rtf: float | None = None  # wall_s / audio_s
    chunks: int = 0
    underruns: int = 0
    underrun_ms: float = 0.0
    underrun_events: list[tuple[float, float]] = field(default_factory=list)  # (at_s, gap_ms)
    chunk_gaps_ms: list[float] = field(default_factory=list)
    playout_end_s: float | None = None
    arrivals: list[tuple[float, int]] = field(default_factory=list)  # (time_s, samples) per audio frame
    sample_rate_hz: int = 0
    server_first_audio_ms: float | None = None  # the server's own `timing` event, when it sends one
    finish_reason: str | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


def stream_tokens(text: str) -> list[str]:
    """Word-ish tokens, whitespace kept, that join back to `text` (what an LLM would stream)."""
    return _TOKEN.findall(text)


async def measure_request(text: str, config: ProbeConfig, *, concurrency: int = 1, index: int = 0) -> RequestResult:
    """One request on a connection of its own, closed after it (what each request does with sockets="per-request")."""
    client = WorkerSocket(dataclasses.replace(config, sockets="per-request"))
    try:
        return await client.measure(text, concurrency=concurrency, index=index)
    finally:
        await client.close()


@dataclass
class _Turn:
    """One request's exchange on an open socket: what came back, and how it ended."""

    counter: SampleCounter
    arrivals: list[tuple[float, int]] = field(default_factory=list)  # (perf_counter, samples) per audio frame
    t0: list[float] = field(default_factory=list)  # perf_counter of the first text frame, once sent
    errors: list[str] = field(default_factory=list)
    frames: int = 0  # frames received
    closed: bool = False  # the socket closed before `finish`


class WorkerSocket:
    """A worker's connection to the server, and its requests on it.

    sockets="reuse": opened for the worker's first request and kept for the next ones (a new `start` after each
    `finish`). When the server has closed it (seen before `start`, or as a close before any reply to this request),
    the request runs on a new socket instead: a reconnect. After a request that failed the socket is dropped, since
    frames of the failed request may still be on their way. sockets="per-request": a new connection every request,
    closed after it.
    """

    def __init__(self, config: ProbeConfig) -> None:
        self.config = config
        self._ws: Any = None
        self._opened = 0  # connections opened so far

    async def measure(self, text: str, *, concurrency: int = 1, index: int = 0) -> RequestResult:
        """Send `text` (at once or paced), read until `finish`, and account for every audio byte."""
        from websockets.exceptions import ConnectionClosed, InvalidStatus, WebSocketException

        config = self.config
        pieces = [text] if not config.tokens_per_s else stream_tokens(text)
        result = RequestResult(
            concurrency, index, text, len(pieces), sample_rate_hz=config.sample_rate_hz,
            compression=config.compression, sockets=config.sockets,
        )  # fmt: skip
        turn = _Turn(SampleCounter(config.format, config.sample_rate_hz))
        try:
            async with asyncio.timeout(config.timeout_s):
                ws = await self._socket(result)
                await _exchange(ws, pieces, config, turn, result)
                if turn.closed and not turn.frames and not result.fresh_connection:
                    # the server had closed the pooled socket before this request: run it on a new one
                    turn = _Turn(SampleCounter(config.format, config.sample_rate_hz))
                    await _exchange(await self._open(result), pieces, config, turn, result)
        except TimeoutError:
            turn.errors.append(f"timeout: no finish within {config.timeout_s:g} s")
        except InvalidStatus as e:
            turn.errors.append(f"handshake refused: HTTP {e.response.status_code}")
        except ConnectionClosed as e:
            turn.errors.append(_closed_text(e))
        except (OSError, WebSocketException) as e:
            turn.errors.append(f"{type(e).__name__}: {e}")
        _judge(result, turn.errors)
        if result.error is not None or config.sockets == "per-request":
            await self.close()
        if turn.t0:
            _account(result, turn.t0[0], turn.arrivals, turn.counter.sample_rate_hz)
        return result

    async def close(self) -> None:
        ws, self._ws = self._ws, None
        if ws is not None:
            with contextlib.suppress(Exception):
                await ws.close()

    async def _socket(self, result: RequestResult) -> Any:
        """The worker's open socket, or a new one."""
        from websockets.protocol import State

        if self._ws is not None and self._ws.state is State.OPEN:
            result.fresh_connection = False
            return self._ws
        return await self._open(result)

    async def _open(self, result: RequestResult) -> Any:
        from websockets.asyncio.client import connect

        await self.close()
        t_connect = time.perf_counter()
        self._ws = await connect(self.config.url, **self.config.connect_options())
        result.connect_ms = (time.perf_counter() - t_connect) * 1000.0
        result.fresh_connection = True
        result.reconnect = self.config.sockets == "reuse" and self._opened > 0
        result.extensions = [str(ext.name) for ext in self._ws.protocol.extensions]
        self._opened += 1
        return self._ws


async def _exchange(ws: Any, pieces: list[str], config: ProbeConfig, turn: _Turn, result: RequestResult) -> None:
    """`start`, the text, `stop` on an open socket, reading until `finish` or the socket's close."""
    from websockets.exceptions import ConnectionClosed

    try:
        await ws.send(msgpack.packb({"event": "start", "request": config.request()}, use_bin_type=True))
    except ConnectionClosed as e:
        turn.closed = True
        turn.errors.append(_closed_text(e))
        return
    reader = asyncio.create_task(_read_events(ws, turn, result))
    try:
        try:
            await _send_text(ws, pieces, config.tokens_per_s, turn.t0)
            await ws.send(msgpack.packb({"event": "stop"}, use_bin_type=True))
        except ConnectionClosed:
            pass  # the reader reports why
        await reader
    finally:
        reader.cancel()


def _judge(result: RequestResult, errors: list[str]) -> None:
    if result.finish_reason is None and not errors:
        errors.append("the server closed without a finish event")
    elif result.finish_reason not in (None, "stop") and not errors:
        errors.append(f"finish reason {result.finish_reason!r}")
    result.error = "; ".join(errors) or None


async def _send_text(ws: Any, pieces: list[str], tokens_per_s: float | None, t0: list[float]) -> None:
    for i, piece in enumerate(pieces):
        if i and tokens_per_s:
            await asyncio.sleep(max(0.0, t0[0] + i / tokens_per_s - time.perf_counter()))
        frame = msgpack.packb({"event": "text", "text": piece}, use_bin_type=True)
        if not t0:
            t0.append(time.perf_counter())
        await ws.send(frame)


async def _read_events(ws: Any, turn: _Turn, result: RequestResult) -> None:
    """Frames until `finish` (the socket is left open for the next request), or until the socket closes."""
    from websockets.exceptions import ConnectionClosed

    try:
        async for raw in ws:
            now = time.perf_counter()
            turn.frames += 1
            if not isinstance(raw, bytes):
                continue  # a text frame: not part of the MessagePack protocol we speak
            try:
                msg = msgpack.unpackb(raw, raw=False)
            except ValueError:
                turn.errors.append("a frame was not valid MessagePack")
                continue
            if not isinstance(msg, dict):
                continue
            event = msg.get("event")
            if event == "audio" and isinstance(msg.get("audio"), bytes):
                turn.arrivals.append((now, turn.counter.feed(msg["audio"])))
            elif event == "finish":
                result.finish_reason = str(msg.get("reason"))
                return
            elif event == "error":
                turn.errors.append(f"{msg.get('code', 'error')}: {msg.get('message', '')}")
            elif event == "timing" and result.server_first_audio_ms is None:
                with contextlib.suppress(TypeError, ValueError):
                    result.server_first_audio_ms = float(msg["first_audio_ms"])
    except ConnectionClosed as e:
        turn.errors.append(_closed_text(e))
    turn.closed = True  # a normal close ends the iteration without an exception


def _closed_text(e: Exception) -> str:
    rcvd = getattr(e, "rcvd", None)
    if rcvd is None:
        return "the connection dropped without a close frame"
    return f"closed with {rcvd.code}" + (f" ({rcvd.reason})" if rcvd.reason else "")


def _account(result: RequestResult, t0: float, arrivals_abs: list[tuple[float, int]], rate_hz: int) -> None:
    arrivals = [(t - t0, n) for t, n in arrivals_abs]
    playout = simulate_playout(arrivals, rate_hz)
    result.sample_rate_hz = rate_hz
    result.arrivals = [(round(t, 6), n) for t, n in arrivals]
    result.chunks = sum(1 for _, n in arrivals if n > 0)
    result.audio_s = playout.audio_s
    if playout.first_audio_s is not None:
        result.ttfa_ms = playout.first_audio_s * 1000.0
        result.wall_s = max(t for t, n in arrivals if n > 0)
        result.rtf = result.wall_s / playout.audio_s
    result.underruns = len(playout.underruns)
    result.underrun_ms = playout.underrun_ms
    result.underrun_events = [(u.at_s, u.gap_ms) for u in playout.underruns]
    result.chunk_gaps_ms = list(playout.chunk_gaps_ms)
    result.playout_end_s = playout.end_s


# ---- levels -----------------------------------------------------------------------------------------------------
def unique_texts(base: Sequence[str], n: int, offset: int = 0) -> list[str]:
    """Texts number offset … offset+n-1 of an endless sequence without repeats: each base text, then ordered
    pairs of distinct base texts, then pairs with a running number appended."""
    if not base:
        raise ValueError("no texts to send: the texts file is empty")
    k = len(base)
    out = []
    for i in range(offset, offset + n):
        if i < k:
            out.append(base[i])
            continue
        j = i - k
        pairs = k * (k - 1)
        if j < pairs:
            a, b = divmod(j, k - 1)
            out.append(f"{base[a]} {base[b if b < a else b + 1]}")
        else:
            m = j - pairs
            out.append(f"{base[m % k]} Number {m // k}.")
    return out


def read_texts(path: Path) -> list[str]:
    """One text per non-empty line."""
    texts = [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not texts:
        raise ValueError(f"{path} holds no text; write one sentence or paragraph per line")
    return texts


async def run_level(
    texts: Sequence[str],
    concurrency: int,
    config: ProbeConfig,
    on_done: Callable[[RequestResult], None] | None = None,
) -> list[RequestResult]:
    """Send every text once with at most `concurrency` requests in flight. The workers start together, or spread
    evenly over `config.ramp_s` (then each keeps its own rhythm: a steady load instead of waves of bursts). Each
    worker runs its requests on one socket, or one socket each (`config.sockets`)."""
    pending = list(enumerate(texts))
    results: list[RequestResult] = []
    level_start = time.perf_counter()
    workers = min(concurrency, len(texts))

    async def worker(i: int) -> None:
        await asyncio.sleep(config.ramp_s * i / workers)
        client = WorkerSocket(config)
        try:
            while pending:
                index, text = pending.pop(0)
                started = time.perf_counter()
                r = await client.measure(text, concurrency=concurrency, index=index)
                r.started_s = started - level_start
                results.append(r)
                if on_done is not None:
                    on_done(r)
        finally:
            await client.close()

    await asyncio.gather(*(worker(i) for i in range(workers)))
    return sorted(results, key=lambda r: r.index)


async def run_benchmark(
    levels: Sequence[int],
    requests_per_level: int,
    config: ProbeConfig,
    base_texts: Sequence[str] = CORPUS,
    on_done: Callable[[RequestResult], None] | None = None,
) -> dict[int, list[RequestResult]]:
    """Each level in turn; every request of the whole run gets a different text."""
    out: dict[int, list[RequestResult]] = {}
    offset = 0
    for level in levels:
        texts = unique_texts(base_texts, requests_per_level, offset)
        offset += requests_per_level
        out[level] = await run_level(texts, level, config, on_done)
    return out


# ---- command line -----------------------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    a = parser.add_argument
    a("url", nargs="?", default=DEFAULT_URL, help=f"Fish live WebSocket URL [default {DEFAULT_URL}]")
    a("--concurrency", default="1", help="comma-separated concurrency levels, e.g. 1,8,32,64 [default 1]")
    a("--requests", type=int, default=10, help="requests per level [default 10]")
    a("--texts", type=Path, default=None, help="file with one text per line (default: a built-in corpus)")
    a("--tokens-per-s", type=float, default=0.0, help="stream text word by word at this rate (0 = all at once)")
    a("--api-key", default=None, help="sent as Authorization: Bearer <key>")
    a("--model", default=None, help="the `model` handshake header (Fish's hosted API uses it)")
    a("--format", default="pcm", choices=MEASURED_FORMATS, help="audio format to request [default pcm]")
    a("--sample-rate", type=int, default=44_100, help="sample rate to request, in Hz [default 44100]")
    a("--latency", default=None, choices=("low", "balanced", "normal"), help="Fish latency mode (server default)")
    a("--reference-id", default=None, help="a stored voice on the server")
    a("--seed", type=int, default=None, help="fishgate extension: fixed sampling seed")
    a("--max-new-tokens", type=int, default=None, help="Fish max_new_tokens: frames per text segment")
    a("--timeout-s", type=float, default=120.0, help="per-request limit, connect to finish [default 120]")
    a("--ramp-s", type=float, default=0.0, help="spread each level's first requests over this many seconds [default 0]")
    a("--compression", default="deflate", choices=COMPRESSION_MODES,
      help="deflate: offer permessage-deflate as browsers and websockets do; off: none [default deflate]")  # fmt: skip
    a("--sockets", default="reuse", choices=SOCKET_MODES,
      help="reuse: a worker's requests share one socket (LiveKit's pool); per-request [default reuse]")  # fmt: skip
    a("--out", type=Path, default=Path("ttfa-results"), help="folder for ttfa.json and plots [default ttfa-results]")
    a("--no-plots", action="store_true", help="skip the PNG plots (no matplotlib needed)")
    return parser


def parse_levels(raw: str) -> list[int]:
    try:
        levels = [int(part) for part in raw.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"--concurrency takes comma-separated whole numbers like 1,8,32 (got {raw!r})") from None
    if not levels or min(levels) < 1:
        raise ValueError(f"--concurrency needs levels of at least 1 (got {raw!r})")
    return levels


def config_from(args: argparse.Namespace) -> ProbeConfig:
    if args.requests < 1:
        raise ValueError("--requests must be at least 1")
    if args.tokens_per_s < 0:
        raise ValueError("--tokens-per-s must be 0 (all at once) or a positive rate")
    if args.ramp_s < 0:
        raise ValueError("--ramp-s must be 0 (all workers at once) or a positive number of seconds")
    return ProbeConfig(
        url=args.url,
        format=args.format,
        sample_rate_hz=args.sample_rate,
        tokens_per_s=args.tokens_per_s or None,
        api_key=args.api_key,
        model=args.model,
        latency=args.latency,
        reference_id=args.reference_id,
        seed=args.seed,
        max_new_tokens=args.max_new_tokens,
        timeout_s=args.timeout_s,
        ramp_s=args.ramp_s,
        compression=args.compression,
        sockets=args.sockets,
    )

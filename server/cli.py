"""`fishgate` command line: `serve` (the gateway), `engine` (a resident engine process that gateways attach to with
`serve --engine`), `convert` (checkpoint → safetensors), `ttfa` (latency probe against any Fish live URL), `synth`
(offline one-shot synthesis to a WAV file, through the streaming engine).

The only place that configures logging and process-wide torch settings. `serve` runs uvicorn with a graceful
drain on SIGTERM/SIGINT: readiness turns false, new sessions are refused, running utterances get `--drain-grace-s`
to finish, then sockets close (1012) and the process exits. A faulted engine exits with status 3 so a supervisor
(systemd: `Restart=on-failure`, see docs/fishgate.service) restarts it. `engine` drains the same way
(streaming.engine_link.process) and exits 3 on a fault, 2 on a refused configuration or an address it cannot listen
on (a socket path or port in use, a TCP address beyond loopback without FISHGATE_ENGINE_TOKEN).
`serve --workers N` runs N such gateways and an engine child, and supervises them (server.workers).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import logging
import socket
import sys
import time
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from streaming.engine_api import EngineHandle

    from .gateway import Gateway
    from .settings import Settings

EXIT_CONFIG_ERROR = 2  # the engine refused its configuration at start-up: a restart cannot help
EXIT_ENGINE_FAULT = 3  # the engine faulted (e.g. a poisoned CUDA context): a supervisor should restart it
GIL_SWITCH_INTERVAL_S = 0.0005


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="fishgate", description="Real-time streaming speech gateway for Fish Speech 1.5"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    from .settings import build_parser

    build_parser(sub.add_parser("serve", help="run the gateway (API + demo page on one port)"))
    _add_engine_arguments(
        sub.add_parser("engine", help="run a resident engine that gateways attach to (serve --engine ADDRESS)")
    )
    conv = sub.add_parser("convert", help="write safetensors next to a checkpoint's .pth files (zero-copy loads)")
    conv.add_argument("checkpoint", type=Path, help="Fish Speech 1.5 checkpoint folder")
    conv.add_argument("--out", type=Path, default=None, help="write a converted copy here instead")
    from .ttfa import add_arguments as add_ttfa_arguments

    add_ttfa_arguments(
        sub.add_parser("ttfa", help="measure time to first audio, gaps and underruns against a Fish live URL")
    )
    _add_synth_arguments(sub.add_parser("synth", help="synthesize text to a WAV file (same engine path as streaming)"))
    args = parser.parse_args(argv)
    if args.command == "serve":
        return serve(args)
    if args.command == "engine":
        return engine(args)
    if args.command == "convert":
        return convert(args)
    if args.command == "ttfa":
        return ttfa(args)
    if args.command == "synth":
        return synth(args)
    parser.error(f"unknown command {args.command}")
    return 2


def _configure_logging(level: str, pid: bool = False) -> None:
    """The root logger's level and format; `pid`: each line names its process (`serve --workers`' processes share
    one stream)."""
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s " + ("[%(process)d] " if pid else "") + "%(name)s: %(message)s",
    )


def serve(args: argparse.Namespace, engine: EngineHandle | None = None) -> int:
    """`fishgate serve`; `engine` replaces the one the settings describe (a test or benchmark may pass its own)."""
    from .gateway import is_loopback
    from .settings import engine_settings_given, settings_from

    settings = settings_from(args)
    _configure_logging(settings.log_level, pid=settings.workers > 1)
    log = logging.getLogger("fishgate")
    taken = _address_in_use(settings.host, settings.port)
    if taken is not None:  # before the model loads: say so at once and hold nothing
        log.critical("fishgate could not start: %s:%d is in use (%s); stop the other server or pass another --port",
                     settings.host, settings.port, taken)  # fmt: skip
        return EXIT_CONFIG_ERROR
    if settings.engine is not None and (ignored := engine_settings_given(settings)):
        log.warning("%s have no effect with --engine: the engine process's own flags set them", ", ".join(ignored))
    if not settings.api_key and not is_loopback(settings.host):
        log.warning("listening on %s without --api-key: anyone who can reach it can use it", settings.host)
    if settings.workers > 1:
        if engine is not None:
            raise ValueError("serve(engine=...) runs one process: --workers must be 1")
        from .workers import run_workers

        return run_workers(settings)
    log.info("fishgate serving on http://%s:%d (demo page at /, API under /v1)", settings.host, settings.port)
    return run_gateway(settings, engine)


def run_gateway(
    settings: Settings,
    engine: EngineHandle | None = None,
    listener: socket.socket | None = None,
    control_fd: int | None = None,
) -> int:
    """One gateway process, drained by SIGTERM/SIGINT; its exit status. `listener`: a socket bound for it (else
    uvicorn binds --host/--port); `control_fd`: a pipe whose end drains it too (server.workers' gateways)."""
    from .app import build_gateway, create_app

    # The engine's worker thread and the event loop share the GIL; with the default 5 ms switch interval the worker
    # waits up to 5 ms at every hand-back while hundreds of sockets are busy. A shorter interval keeps the decode
    # loop fed (measured on the H200 end-to-end run; see docs/BENCHMARKS.md).
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    log = logging.getLogger("fishgate")
    gateway = build_gateway(settings, engine)
    app = create_app(settings, gateway)
    server = DrainingServer(uvicorn_config(gateway, app), gateway)
    gateway.on_fault = server.stop_now
    if control_fd is not None:
        from .workers import on_pipe_end

        on_pipe_end(control_fd, server.request_drain)
    server.run(None if listener is None else [listener])
    if gateway.engine.config_error is not None:
        log.critical("fishgate could not start: %s", gateway.engine.config_error)
        return EXIT_CONFIG_ERROR
    if gateway.engine.fault is not None:
        log.critical("exiting with status %d: %s", EXIT_ENGINE_FAULT, gateway.engine.fault)
        return EXIT_ENGINE_FAULT
    return 0


ENGINE_DESCRIPTION = (
    "A resident engine: owns the model on this device and serves it to the gateways\n"
    "that attach with `fishgate serve --engine ADDRESS`, so a gateway restarts in\n"
    "about a second and several gateways share one engine. SIGTERM drains it. A TCP\n"
    "address beyond loopback needs FISHGATE_ENGINE_TOKEN (its gateways send the same).\n"
    "Every setting is also an environment variable FISHGATE_<NAME> (flags win).\n"
)


def _add_engine_arguments(p: argparse.ArgumentParser) -> None:
    from .settings import ENGINE_PROCESS_SETTINGS, build_parser

    build_parser(p, only=ENGINE_PROCESS_SETTINGS, description=ENGINE_DESCRIPTION)
    p.usage = "%(prog)s --listen unix:PATH|tcp:HOST:PORT [--profile latency|throughput] [options]"
    p.add_argument(
        "--listen", default=None, metavar="ADDRESS",
        help="unix:PATH (a Unix socket) or tcp:HOST:PORT (port 0: any free one, logged) to serve gateways on "
        "[default $FISHGATE_ENGINE, the address gateways attach to]",
    )  # fmt: skip


def engine(args: argparse.Namespace) -> int:
    """`fishgate engine`: claim the socket path, load the engine, serve gateways until SIGTERM (then drain)."""
    from .settings import settings_from

    settings = settings_from(args)
    _configure_logging(settings.log_level)
    return run_engine(settings, args.listen or settings.engine)


def run_engine(settings: Settings, listen_at: str | None) -> int:
    """A resident engine process serving gateways at `listen_at` until a signal (then drained), or a fault; its exit
    status (`fishgate engine`, and the engine child of `serve --workers`)."""
    from streaming.engine_link.address import parse_address
    from streaming.engine_link.process import serve as serve_engine
    from streaming.engine_link.sockets import CannotListen, listen

    from .app import build_local_engine

    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)  # as in serve: the worker and the link's loop share the GIL
    log = logging.getLogger("fishgate")
    try:
        if listen_at is None:
            raise ValueError("it needs --listen unix:PATH or tcp:HOST:PORT (or FISHGATE_ENGINE)")
        sock = listen(parse_address(listen_at), settings.engine_token)
    except (ValueError, CannotListen) as e:  # before the model loads: say so at once and hold nothing
        log.critical("fishgate engine could not start: %s", e)
        return EXIT_CONFIG_ERROR
    resident = build_local_engine(settings)
    asyncio.run(serve_engine(resident, sock, settings.drain_grace_s, settings.engine_token))
    if resident.config_error is not None:
        log.critical("fishgate engine could not start: %s", resident.config_error)
        return EXIT_CONFIG_ERROR
    if resident.fault is not None:
        log.critical("exiting with status %d: %s", EXIT_ENGINE_FAULT, resident.fault)
        return EXIT_ENGINE_FAULT
    return 0


def _address_in_use(host: str, port: int) -> str | None:
    """Why `host:port` cannot be bound (as uvicorn binds it: SO_REUSEADDR), or None when it can."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as e:
            return e.strerror or str(e)
    return None


class DrainingServer:
    """uvicorn.Server whose first SIGTERM/SIGINT drains instead of stopping at once; a second one stops now."""

    def __init__(self, config: Any, gateway: Any) -> None:
        import uvicorn

        gw = gateway
        outer = self

        class Server(uvicorn.Server):
            def handle_exit(self, sig: int, frame: FrameType | None) -> None:
                if gw.draining.is_set() or outer.loop is None:
                    return super().handle_exit(sig, frame)
                outer.loop.call_soon_threadsafe(outer.start_drain)

        self.server = Server(config)
        self.gateway = gateway
        self.loop: asyncio.AbstractEventLoop | None = None
        self.drain_requested = False

    def run(self, sockets: list[socket.socket] | None = None) -> None:
        asyncio.run(self.serve(sockets))

    async def serve(self, sockets: list[socket.socket] | None) -> None:
        """Serve until stopped or drained, on the running loop (a Ray Serve gateway replica's; server.ray_serve)."""
        self.loop = asyncio.get_running_loop()
        if self.drain_requested:
            self.start_drain()
        await self.server.serve(sockets)

    def stop_now(self) -> None:
        self.server.should_exit = True

    def request_drain(self) -> None:
        """Drain unless already draining (a drain asked for twice is one drain, not a stop). Any thread."""
        self.drain_requested = True
        loop = self.loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(lambda: None if self.gateway.draining.is_set() else self.start_drain())

    def start_drain(self) -> None:
        gw = self.gateway
        log = logging.getLogger("fishgate")
        log.info("draining: readiness is false; running utterances have %.0f s to finish", gw.settings.drain_grace_s)
        gw.draining.set()
        gw.engine.drain()
        asyncio.get_running_loop().create_task(self._wait_drained())

    async def _wait_drained(self) -> None:
        gw = self.gateway
        deadline = time.monotonic() + gw.settings.drain_grace_s
        while time.monotonic() < deadline and gw.engine.open_sessions > 0:
            await asyncio.sleep(0.1)
        self.server.should_exit = True


def uvicorn_config(gateway: Gateway, app: Any) -> Any:
    """The ASGI server's settings for `gateway`'s `app` (also what the tests' real servers run): WebSocket frame cap and
    compression (--ws-compression; uvicorn's default would negotiate it with every client that offers it), uvicorn's
    connection limit as a backstop above the app's own cap (server.connection_cap), no logging config of its own,
    a bounded graceful shutdown."""
    from .connection_cap import BackstoppedConfig

    settings = gateway.settings
    return BackstoppedConfig(
        app,
        gateway,
        host=settings.host,
        port=settings.port,
        ws="websockets-sansio",
        ws_max_size=settings.max_frame_bytes,
        ws_per_message_deflate=settings.ws_compression == "on",
        log_config=None,
        lifespan="on",
        timeout_graceful_shutdown=5,
    )


def convert(args: argparse.Namespace) -> int:
    _configure_logging("info")
    from model.convert import convert_checkpoint
    from model.weights import CheckpointError

    last = [0.0]

    def progress(name: str, done: int, total: int) -> None:
        now = time.monotonic()
        if done < total and now - last[0] < 0.1:
            return
        last[0] = now
        width = 30
        filled = int(width * done / max(total, 1))
        end = "\n" if done >= total else ""
        sys.stderr.write(
            f"\r{name:24s} [{'#' * filled}{'.' * (width - filled)}] {done / 2**20:8.1f} / {total / 2**20:.1f} MiB{end}"
        )
        sys.stderr.flush()

    try:
        written = convert_checkpoint(args.checkpoint, args.out, progress)
    except CheckpointError as e:
        print(f"fishgate convert: {e}", file=sys.stderr)
        return 2
    if not written:
        print(f"nothing to convert in {args.checkpoint}: safetensors files are already there")
    for path in written:
        print(f"wrote {path}")
    return 0


def ttfa(args: argparse.Namespace) -> int:
    from . import ttfa as probe
    from .ttfa_report import format_table, summarize, write_outputs

    try:
        config = probe.config_from(args)
        levels = probe.parse_levels(args.concurrency)
        texts = probe.read_texts(args.texts) if args.texts is not None else list(probe.CORPUS)
    except (ValueError, OSError) as e:
        print(f"fishgate ttfa: {e}", file=sys.stderr)
        return 2
    done = {level: 0 for level in levels}

    def progress(r: probe.RequestResult) -> None:
        done[r.concurrency] += 1
        ttfa_ms = "-" if r.ttfa_ms is None else f"{r.ttfa_ms:.0f} ms"
        rtf = "-" if r.rtf is None else f"{r.rtf:.2f}"
        status = f"ERROR {r.error}" if r.error else "ok"
        sys.stderr.write(
            f"[c={r.concurrency} {done[r.concurrency]}/{args.requests}] #{r.index} ttfa {ttfa_ms}, "
            f"audio {r.audio_s:.2f} s, underruns {r.underruns} ({r.underrun_ms:.0f} ms), rtf {rtf}: {status}\n"
        )
        sys.stderr.flush()

    results = asyncio.run(probe.run_benchmark(levels, args.requests, config, texts, progress))
    print(format_table([summarize(c, rs) for c, rs in results.items()]))
    plots = not args.no_plots
    if plots and importlib.util.find_spec("matplotlib") is None:
        plots = False
        print("plots skipped: they need matplotlib (pip install 'fishgate[ttfa]' in the same environment), or pass "
              "--no-plots", file=sys.stderr)  # fmt: skip
    for path in write_outputs(args.out, config, results, plots=plots):
        print(f"wrote {path}")
    return 1 if any(r.error for rs in results.values() for r in rs) else 0


def _add_synth_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("text", help="the text to speak")
    p.add_argument("-o", "--output", type=Path, required=True, help="WAV file to write (16-bit mono)")
    p.add_argument("--checkpoint", type=Path, default=None, help="checkpoint folder (default: the embedded model)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N [default auto]")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (same seed = same audio as streaming)")
    p.add_argument("--voice-audio", type=Path, default=None, help="reference recording to clone (WAV/FLAC/MP3/Ogg)")
    p.add_argument("--voice-text", default=None, help="transcript of --voice-audio")
    p.add_argument("--temperature", type=float, default=None, help="[default: the model's, else 0.7; 0 = greedy]")
    p.add_argument("--top-p", type=float, default=None, help="[default: the model's, else 0.7]")
    p.add_argument("--repetition-penalty", type=float, default=None, help="[default: the model's, else 1.2]")
    p.add_argument("--max-new-tokens", type=int, default=1024, help="frames per text segment [default 1024]")
    p.add_argument("--chunk-length", type=int, default=200, help="characters per text segment [default 200]")
    p.add_argument("--latency", default="balanced", choices=("low", "balanced", "normal"), help="[default balanced]")
    p.add_argument("--sample-rate", type=int, default=44_100, help="output rate in Hz [default 44100]")


def synth(args: argparse.Namespace) -> int:
    _configure_logging("warning")
    from streaming.errors import FishgateError

    from .params import parse_tts_request

    if (args.voice_audio is None) != (args.voice_text is None):
        print("fishgate synth: --voice-audio and --voice-text go together (a recording and its words)", file=sys.stderr)
        return 2
    request = {
        "text": "", "format": "pcm", "sample_rate": args.sample_rate, "seed": args.seed,
        "temperature": args.temperature, "top_p": args.top_p, "repetition_penalty": args.repetition_penalty,
        "max_new_tokens": args.max_new_tokens, "chunk_length": args.chunk_length, "latency": args.latency,
    }  # fmt: skip
    try:  # the live endpoint's own validation and defaults, so both paths build identical settings
        parse_tts_request(request, max_text_chars=len(args.text) + 1)  # bad values fail before the model loads
        voice_audio = args.voice_audio.read_bytes() if args.voice_audio is not None else None
        # a file has no listener who can fall behind: the engine's real-time alarm says nothing useful here
        worker_log = logging.getLogger("streaming.worker")
        worker_log.addFilter(_not_a_slow_turn)
        try:
            pcm, rate_hz = asyncio.run(_synthesize(args, request, voice_audio))
        finally:
            worker_log.removeFilter(_not_a_slow_turn)
    except (FishgateError, ValueError, OSError, RuntimeError) as e:
        print(f"fishgate synth: {e}", file=sys.stderr)
        return 2
    args.output.parent.mkdir(parents=True, exist_ok=True)
    from streaming.audio_encoders import wav_header

    args.output.write_bytes(wav_header(rate_hz, len(pcm)) + pcm)
    print(f"wrote {args.output} ({len(pcm) // 2 / rate_hz:.2f} s at {rate_hz} Hz)")
    return 0


def _not_a_slow_turn(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith("slow turn:")


async def _synthesize(
    args: argparse.Namespace, request: dict[str, Any], voice_audio: bytes | None
) -> tuple[bytes, int]:
    """Start an engine, speak the text through streaming.synth, encode as the live endpoint's pcm output does.
    The request is parsed once the model is known: sampling values not given come from its defaults."""
    from streaming.audio_out import AudioOutput
    from streaming.config import BackendConfig
    from streaming.engine import MAX_QUEUED_CHARS, Engine, EngineConfig
    from streaming.session import Voice
    from streaming.synth import reference_voice, synthesize

    from .params import REFERENCE_SECONDS, parse_tts_request

    engine = Engine(
        EngineConfig(
            # one utterance does not repay torch.compile's start-up (minutes on an empty cache): plain graphs
            BackendConfig(checkpoint=args.checkpoint, device=args.device, max_sessions=1, compile_max_batch=0),
            max_queued_chars=max(MAX_QUEUED_CHARS, len(args.text)),  # the whole text is queued at once
        )
    )
    engine.start()
    try:
        if not await asyncio.to_thread(engine.wait_ready):
            raise RuntimeError(f"the engine did not start: {engine.fault}")
        assert engine.info is not None
        params = parse_tts_request(request, max_text_chars=len(args.text) + 1, sampling=engine.info.sampling)
        voice = Voice()
        if voice_audio is not None:
            lo, hi = REFERENCE_SECONDS
            voice = await reference_voice(engine, voice_audio, args.voice_text, min_duration_s=lo, max_duration_s=hi)
        pcm_f32 = await synthesize(engine, args.text, voice, params.settings, params.segmenter)
    finally:
        engine.stop()
    output = AudioOutput(params.output)
    return output.push(pcm_f32) + output.finish(), params.output.sample_rate_hz


if __name__ == "__main__":
    sys.exit(main())

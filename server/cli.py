"""`fishgate` command line: `serve` (the gateway), `convert` (checkpoint → safetensors).

The only place that configures logging and process-wide torch settings. `serve` runs uvicorn with a graceful
drain on SIGTERM/SIGINT: readiness turns false, new sessions are refused, running utterances get `--drain-grace-s`
to finish, then sockets close (1012) and the process exits. A faulted engine exits with status 3 so a supervisor
(systemd: `Restart=on-failure`, see docs/fishgate.service) restarts it.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import time
from pathlib import Path
from types import FrameType
from typing import Any

EXIT_ENGINE_FAULT = 3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="fishgate", description="Real-time streaming speech gateway for Fish Speech 1.5"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    from .settings import build_parser

    build_parser(sub.add_parser("serve", help="run the gateway (API + demo page on one port)"))
    conv = sub.add_parser("convert", help="write safetensors next to a checkpoint's .pth files (zero-copy loads)")
    conv.add_argument("checkpoint", type=Path, help="Fish Speech 1.5 checkpoint folder")
    conv.add_argument("--out", type=Path, default=None, help="write a converted copy here instead")
    args = parser.parse_args(argv)
    if args.command == "serve":
        return serve(args)
    if args.command == "convert":
        return convert(args)
    parser.error(f"unknown command {args.command}")
    return 2


def _configure_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    from .app import build_gateway, create_app
    from .settings import settings_from

    settings = settings_from(args)
    _configure_logging(settings.log_level)
    gateway = build_gateway(settings)
    app = create_app(settings, gateway)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        ws="websockets-sansio",
        ws_max_size=settings.max_frame_bytes,
        log_config=None,
        lifespan="on",
        timeout_graceful_shutdown=5,
    )
    server = _DrainingServer(config, gateway)
    gateway.on_fault = server.stop_now
    log = logging.getLogger("fishgate")
    log.info("fishgate serving on http://%s:%d (demo page at /, API under /v1)", settings.host, settings.port)
    if not settings.api_key and settings.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("listening on %s without --api-key: anyone who can reach it can use it", settings.host)
    server.run()
    if gateway.engine.fault is not None:
        log.critical("exiting with status %d: %s", EXIT_ENGINE_FAULT, gateway.engine.fault)
        return EXIT_ENGINE_FAULT
    return 0


class _DrainingServer:
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

    def run(self) -> None:
        asyncio.run(self._serve())

    async def _serve(self) -> None:
        self.loop = asyncio.get_running_loop()
        await self.server.serve()

    def stop_now(self) -> None:
        self.server.should_exit = True

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


if __name__ == "__main__":
    sys.exit(main())

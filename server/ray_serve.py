"""fishgate on Ray Serve: gateway replicas (CPU) in front of engine replicas (one per GPU), one port for clients
(`serve run deploy/ray/serve.yaml`; docs/OPERATIONS.md, "Ray Serve").

    client ─ws/http─► Gateway ×G on --host:--port (8000) of its node: fishgate's own app and uvicorn over an EnginePool
                          │ engine link over TCP (token in HELLO); each session stays on one engine,
                          ▼ a new one goes where the engine's own admission sees most headroom
                      EngineReplica ×N: an Engine and its EngineService on tcp:<node ip>:<kernel's port>
    EngineDirectory ×1: engine replicas register their address every HEARTBEAT_S, entries expire after ENTRY_TTL_S
    (server.engine_replicas); gateways poll it every POLL_S and hand the addresses to their pool.

Ray Serve places the replicas (a GPU per engine), checks their health, replaces dead ones and rolls upgrades; it
carries no traffic. Its HTTP proxy is off (`proxy_location: Disabled`): the proxy relays every WebSocket message
between processes and compresses each one, which cost 6-7x the CPU per stream and seconds of first audio at 300
streams (bench.ray_cost; docs/DECISIONS.md, "Ray Serve: gateway replicas serve clients, the engine link carries
audio"). The only module that imports Ray (`pip install 'fishgate[ray]'`); nothing else in fishgate imports this one.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import secrets
import sys
from collections.abc import Mapping
from dataclasses import asdict, fields, replace
from typing import Any

import ray
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from streaming.engine_api import EngineState
from streaming.engine_link.address import TcpAddress
from streaming.engine_link.auth import TOKEN_VARIABLE
from streaming.engine_link.pool import EnginePool
from streaming.engine_link.service import EngineService
from streaming.engine_link.sockets import listen

from .app import build_gateway, build_local_engine, create_app
from .app import readyz as app_readyz
from .cli import DrainingServer, uvicorn_config
from .engine_replicas import HEARTBEAT_S, DirectoryTable, EngineEntry, ReplicaInfo, summary
from .settings import ENGINE_PROCESS_SETTINGS, Settings, settings_from
from .workers import gateway_listener

log = logging.getLogger(__name__)

ENGINES_ENV = "FISHGATE_RAY_ENGINES"  # engine replicas (default: one per GPU of the cluster, else 1)
GATEWAYS_ENV = "FISHGATE_RAY_GATEWAYS"  # gateway replicas (default 1)
POLL_S = 0.5  # how often a gateway asks the directory for the engines' addresses
CALL_TIMEOUT_S = 5.0  # a directory call that takes longer has failed (the directory is restarting)
# CPU reservations. Without GPUs two engine replicas and what fronts them fit on 2 cores (an engine runs one torch
# thread: streaming.config.BackendConfig.cpu_threads); with GPUs an engine replica holds one GPU and one core.
ENGINE_CPUS_WITHOUT_GPU = 0.5
ENGINE_CPUS_WITH_GPU = 1.0
GATEWAY_CPUS = 0.25
DIRECTORY_CPUS = 0.05
PORT = 8000  # the gateways' port unless the args name one (`fishgate serve`'s own default is 7860)
# An engine replica's graceful shutdown (Serve's graceful_shutdown_timeout_s): its drain (--drain-grace-s) and this.
SHUTDOWN_MARGIN_S = 10.0
# Where the generated link token is kept for the cluster's life (Ray's internal key-value store), so a redeploy gets
# the same one and replicas of two versions keep talking during a rolling upgrade.
TOKEN_KV_NAMESPACE = "fishgate"
TOKEN_KV_KEY = b"engine_link_token"
FISHGATE_LOGGERS = ("server", "streaming", "model", "fishgate")  # the packages' loggers, and the CLI's
SWITCH_INTERVAL_S = 0.0005  # as `fishgate engine` sets it (server.cli): the worker and the link's loop share the GIL


def settings_of(args: Mapping[str, Any]) -> Settings:
    """Settings from the application's args (`fishgate serve`'s flags, named as their FISHGATE_ variables are, in
    lower case: `checkpoint`, `max_sessions`, …) over this process's FISHGATE_* variables; ValueError naming the
    setting otherwise."""
    known = {f.name for f in fields(Settings)}
    raw: dict[str, str] = {}
    for key, value in args.items():
        name = key.replace("-", "_")
        if name not in known:
            raise ValueError(f"{key!r} is not a fishgate setting (`fishgate serve --help-all` lists them)")
        if value is not None:
            raw[name] = _as_flag(value)
    try:
        return settings_from(argparse.Namespace(**raw))
    except SystemExit as e:  # the CLI's refusal, which names the setting
        raise ValueError(str(e)) from None


def _as_flag(value: object) -> str:
    """A YAML value as its flag would be written: true/false as on/off, a list comma-separated."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, list | tuple):
        return ",".join(str(v) for v in value)
    return str(value)


def split_args(args: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the engine replicas' args, the gateways'): `fishgate engine`'s settings go to the engines, the others to the
    gateways (what they need of the engines comes over the link), the log level and drain grace to both."""
    shared = {"log_level", "drain_grace_s"}
    engine = {k: v for k, v in args.items() if k.replace("-", "_") in ENGINE_PROCESS_SETTINGS}
    gateway = {k: v for k, v in args.items() if k.replace("-", "_") not in ENGINE_PROCESS_SETTINGS - shared}
    return engine, gateway


def _replica_logging(level: str) -> None:
    """fishgate's loggers into this replica's Serve log (its handlers on the `ray.serve` logger: the replica's file,
    Serve's format with the replica's id) at the settings' level. A replica's constructor is its process's entry point,
    as the CLI is `fishgate serve`'s: the only place that configures logging there."""
    handlers = logging.getLogger("ray.serve").handlers
    for name in FISHGATE_LOGGERS:
        logger = logging.getLogger(name)
        logger.setLevel(getattr(logging, level.upper(), logging.INFO))
        for handler in handlers:
            if handler not in logger.handlers:
                logger.addHandler(handler)
        logger.propagate = not handlers  # else a line would also reach the root logger's stderr


def _gateway_replicas() -> int:
    """The gateway deployment's replicas as Serve has them now (a config's own `num_replicas` included, and updated
    when it changes). Under autoscaling Serve gives none: then 1, so that no gateway refuses a connection for want of a
    share while the engines still have sessions (they refuse beyond those themselves)."""
    return max(1, int(serve.get_replica_context().world_size or 1))


async def _within(awaitable: Any, timeout_s: float = CALL_TIMEOUT_S) -> Any:
    async with asyncio.timeout(timeout_s):
        return await awaitable


@serve.deployment(
    name="EngineDirectory",
    num_replicas=1,
    ray_actor_options={"num_cpus": DIRECTORY_CPUS},
    max_ongoing_requests=1000,
    logging_config={"enable_access_log": False},  # a line per heartbeat and poll would bury everything else
)
class EngineDirectory:
    """Where engine replicas say where their link listens, and gateways look. One replica: its table lives in memory;
    when it restarts, the engines' next heartbeats refill it and gateways keep their linked engines meanwhile."""

    def __init__(self) -> None:
        self.table = DirectoryTable()

    async def register(self, entry: dict[str, Any]) -> None:
        self.table.register(EngineEntry.of(entry))

    async def withdraw(self, address: str) -> None:
        self.table.withdraw(address)

    async def listing(self) -> dict[str, Any]:
        """The live engines and how many the deployment wants."""
        return {"engines": [asdict(e) for e in self.table.entries()], "expected": self.table.expected}


@serve.deployment(name="EngineReplica", health_check_period_s=2.0, health_check_timeout_s=10.0)
class EngineReplica:
    """One engine (the GPU Ray gave this replica, or the CPU) served on the engine link by the EngineService that
    `fishgate engine` runs; registered in the directory from ready until it has drained. A faulted engine closes its
    link at once and fails Serve's health check, and Serve replaces the replica. Graceful shutdown drains: no new
    sessions, running utterances finish (up to --drain-grace-s), then the link closes."""

    async def __init__(  # type: ignore[misc]  # Ray Serve awaits a coroutine constructor: the loop runs meanwhile
        self, directory: DeploymentHandle, args: dict[str, Any], token: str
    ) -> None:
        self.directory = directory
        self.settings = settings = settings_of(args)
        _replica_logging(settings.log_level)
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        node_ip = ray.util.get_node_ip_address()
        sock = listen(TcpAddress(node_ip, 0), token)  # before the model loads: a refusal costs nothing
        self.engine = build_local_engine(settings)
        self.service = EngineService(self.engine, token=token)
        await self.service.start(sock)
        if not await asyncio.to_thread(self.engine.wait_ready):
            await self.service.close()
            why = self.engine.config_error or self.engine.fault
            raise RuntimeError(f"the engine did not start: {why}")  # Serve retries, then reports the deployment
        context = serve.get_replica_context()
        assert self.service.address is not None
        self.entry = EngineEntry(
            address=self.service.address, replica_id=context.replica_id.unique_id,
            rank=int(getattr(context.rank, "rank", 0)), world_size=int(context.world_size), node_ip=node_ip,
            pid=os.getpid(),
        )  # fmt: skip
        self._heartbeat_task = asyncio.get_running_loop().create_task(self._heartbeat())
        log.info(
            "engine replica %s (rank %d) serving on %s", self.entry.replica_id, self.entry.rank, self.entry.address
        )

    async def _heartbeat(self) -> None:
        failing = False
        while True:
            try:
                await _within(self.directory.register.remote(asdict(self.entry)))
                failing = False
            except Exception as e:  # the directory is restarting: the next beat refills it
                if not failing:
                    log.warning("engine replica %s: the directory did not take its heartbeat (%s)",
                                self.entry.replica_id, type(e).__name__)  # fmt: skip
                failing = True
            await asyncio.sleep(HEARTBEAT_S)

    def check_health(self) -> None:
        if self.service.faulted:
            raise RuntimeError(f"the engine faulted: {self.engine.fault}")

    async def __del__(self) -> None:
        """Serve's graceful shutdown: drain (running utterances finish within --drain-grace-s), then close."""
        if not hasattr(self, "entry"):
            return  # never became ready: the constructor closed what it had
        self.service.drain(self.settings.drain_grace_s)  # gateways stop routing here now, not at the next tick
        self.entry = replace(self.entry, draining=True)  # the next heartbeat says so; the link's ticks go on
        await self.service.until_done()
        self._heartbeat_task.cancel()  # before the withdrawal: no heartbeat re-registers it
        with contextlib.suppress(Exception):  # else its entry expires by itself
            await _within(self.directory.withdraw.remote(self.entry.address))
        await self.service.close()  # sessions still open end with engine_unavailable


# max_surge_percent: a new gateway is up before an old one stops taking connections (a redeploy leaves no gap)
@serve.deployment(name="Gateway", ray_actor_options={"num_cpus": GATEWAY_CPUS}, max_surge_percent=100)
class GatewayReplica:
    """fishgate's own gateway (create_app: every endpoint, its lifespan, limits and metrics, on fishgate's uvicorn
    settings) over a pool of the engine replicas that the directory lists, serving clients itself on --host:--port of
    its node. Its listening socket is bound with SO_REUSEPORT, as `serve --workers`' gateways are: several gateway
    replicas on one node share the port (the kernel spreads connections), and during a rolling upgrade the new replica
    listens before the old one drains. Serve places, health-checks and replaces it, but carries none of its traffic:
    Serve's proxy relays every WebSocket message and compresses each one (docs/DECISIONS.md). Adds `/engines`
    (per-replica summary), the engine counts on `/readyz` (`expected`: replicas the deployment wants) and, on
    `/metrics`, `fishgate_engine_replica_info` (each engine's replica, rank, node and pid beside the pool's per-engine
    fishgate_engine_replica). `engines` is the engine deployment's handle: bound here so that the application deploys
    it; audio never goes through it."""

    async def __init__(  # type: ignore[misc]  # Ray Serve awaits a coroutine constructor
        self, directory: DeploymentHandle, engines: DeploymentHandle, args: dict[str, Any], token: str
    ) -> None:
        self.directory = directory
        self.settings = settings = settings_of(args)
        _replica_logging(settings.log_level)
        self.pool = EnginePool(token=token)
        self.gateway = build_gateway(settings, self.pool)
        if settings.max_connections is None:  # as `serve --workers N --engine`: a share of the pool's sessions
            self.gateway.gateways_sharing_engine = _gateway_replicas
        self.entries: list[EngineEntry] = []
        self.expected = 0
        app = create_app(settings, self.gateway)
        # ahead of the app's own routes: /readyz answers as the app does, plus the deployment's engine count
        app.router.routes[0:0] = [Route("/readyz", self.readyz), Route("/engines", self.engines)]
        self.gateway.metrics.registry.register(ReplicaInfo(lambda: self.entries))
        listener = gateway_listener(settings.host, settings.port)  # OSError: Serve reports it and retries
        self.server = DrainingServer(uvicorn_config(self.gateway, app), self.gateway)
        loop = asyncio.get_running_loop()
        self._serving = loop.create_task(self.server.serve([listener]))
        self._poller = loop.create_task(self._poll())
        while not self.server.server.started:  # the app's lifespan ran and the socket accepts
            if self._serving.done():
                self._poller.cancel()
                raise RuntimeError(f"the gateway did not start on {settings.host}:{settings.port}")
            await asyncio.sleep(0.02)
        log.info("gateway replica serving on %s:%d", settings.host, settings.port)

    def check_health(self) -> None:
        if self._serving.done():
            raise RuntimeError("the gateway's server stopped")

    async def readyz(self, request: Request) -> JSONResponse:
        response = await app_readyz(request)
        body = json.loads(bytes(response.body))
        body.setdefault("engines", {})["expected"] = max(self.expected, len(self.pool.engines))
        return JSONResponse(body, status_code=response.status_code)

    async def engines(self, request: Request) -> JSONResponse:
        return JSONResponse(summary(self.entries, self.pool, self.expected))

    async def _poll(self) -> None:
        """The directory's engines into the pool, every POLL_S. An engine leaves the pool only once the directory has
        forgotten it and its link is down: while the directory restarts (or, during a redeploy, has not heard every
        engine yet) no live engine's sessions end."""
        failing = False
        while True:
            try:
                listing = await _within(self.directory.listing.remote())
                entries = [EngineEntry.of(e) for e in listing["engines"]]
                linked = [a for a, r in self.pool.engines.items() if r.state is not EngineState.UNAVAILABLE]
                self.pool.set_addresses([e.address for e in entries] + linked)
                self.entries, self.expected = entries, int(listing["expected"])
                failing = False
            except Exception as e:
                if not failing:
                    log.warning("the engine directory did not answer (%s); keeping the engines known",
                                type(e).__name__)  # fmt: skip
                failing = True
            await asyncio.sleep(POLL_S)

    async def __del__(self) -> None:
        """Serve's graceful shutdown: drain as `fishgate serve` does on SIGTERM (readiness false, no new sessions,
        running utterances get --drain-grace-s, then sockets close with 1012), then stop."""
        if not hasattr(self, "_serving"):
            return
        self.server.request_drain()
        with contextlib.suppress(TimeoutError, asyncio.CancelledError):
            await asyncio.wait_for(asyncio.shield(self._serving), self.settings.drain_grace_s + SHUTDOWN_MARGIN_S)
        self.server.stop_now()
        self._poller.cancel()


def engine_token() -> str:
    """The engine link's token: FISHGATE_ENGINE_TOKEN where set, else one generated once per Ray cluster."""
    given = os.environ.get(TOKEN_VARIABLE)
    if given:
        return given
    from ray.experimental import internal_kv  # no public store outlives an application's redeploy

    if not internal_kv._internal_kv_initialized():
        return secrets.token_urlsafe(32)
    internal_kv._internal_kv_put(TOKEN_KV_KEY, secrets.token_urlsafe(32).encode(), overwrite=False,
                                 namespace=TOKEN_KV_NAMESPACE)  # fmt: skip
    stored = internal_kv._internal_kv_get(TOKEN_KV_KEY, namespace=TOKEN_KV_NAMESPACE)
    assert stored is not None
    return bytes(stored).decode()


def _count(variable: str, arg: object, default: int) -> int:
    raw = os.environ.get(variable, arg)
    if raw is None or raw == "":
        return default
    try:
        value = int(str(raw))
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{variable} (or the args' {variable.removeprefix('FISHGATE_RAY_').lower()}) must be a "
                         f"whole number of replicas, at least 1, not {raw!r}")  # fmt: skip
    return value


def app_builder(args: dict[str, Any]) -> serve.Application:
    """The application for serve.yaml's `import_path` (or `serve.run(app_builder({...}))`). `args`: fishgate settings
    (server.settings), plus `engines` and `gateways` (replica counts; FISHGATE_RAY_ENGINES and FISHGATE_RAY_GATEWAYS
    win). Engine replicas hold a GPU each where the cluster has GPUs, else run on CPU (the embedded default model
    unless `checkpoint` is given). A config's own `num_replicas` for a deployment wins over all of these."""
    args = dict(args or {})
    engines_arg, gateways_arg = args.pop("engines", None), args.pop("gateways", None)
    if "workers" in args:
        raise ValueError("'workers' has no effect on Ray Serve: set `gateways` (FISHGATE_RAY_GATEWAYS) instead")
    engine_args, gateway_args = split_args(args)
    gateway_args.setdefault("port", PORT)
    engine_settings, gateway_settings = settings_of(engine_args), settings_of(gateway_args)  # refused here, not later
    gpus = int(ray.cluster_resources().get("GPU", 0)) if ray.is_initialized() else 0
    on_gpu = gpus > 0 and (engine_settings.device or "auto") != "cpu"
    engine_options = (
        {"num_cpus": ENGINE_CPUS_WITH_GPU, "num_gpus": 1} if on_gpu else {"num_cpus": ENGINE_CPUS_WITHOUT_GPU}
    )
    engine_count = _count(ENGINES_ENV, engines_arg, gpus if on_gpu else 1)
    gateway_count = _count(GATEWAYS_ENV, gateways_arg, 1)
    token = engine_token()
    directory = EngineDirectory.bind()  # type: ignore[attr-defined]
    engines = EngineReplica.options(  # type: ignore[attr-defined]
        num_replicas=engine_count,
        ray_actor_options=engine_options,
        graceful_shutdown_timeout_s=engine_settings.drain_grace_s + SHUTDOWN_MARGIN_S,
    ).bind(directory, engine_args, token)
    gateway = GatewayReplica.options(  # type: ignore[attr-defined]
        num_replicas=gateway_count,
        graceful_shutdown_timeout_s=gateway_settings.drain_grace_s + SHUTDOWN_MARGIN_S,
    )
    app: serve.Application = gateway.bind(directory, engines, gateway_args, token)
    return app

"""`EnginePool`: the gateway's EngineHandle (streaming.engine_api) over several resident engines, one RemoteEngine
link each (`fishgate serve --engine A,B,…`, or a deployment that calls `set_addresses` as engines come and go).

A new session goes to the ready engine with the most headroom (each engine's own admission judgement, sent with its
STATUS every 0.25 s; streaming.engine_link.routing orders them); an engine that refuses (overloaded) passes it to the
next, and the pool refuses only when every ready engine has. A session stays on its engine for its whole life: an
engine that dies or leaves the pool ends its sessions with `engine_unavailable`, as a lone engine's death does. All
engines must serve one model: an engine whose ModelInfo differs from the pool's (the first one known) is logged and
never routed to. Calls that are not sessions (text checks, reference encodes) go to the engine with most headroom.
Runs on the gateway's event loop; imports no torch.
"""

from __future__ import annotations

import logging
import random
import types
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

import numpy as np

from ..engine_api import EngineState, ModelInfo
from ..errors import AdmissionDeferred, EngineUnavailable, FishgateError, NotReady, Overloaded
from ..session import Session, SynthesisSettings, Voice
from .address import parse_address
from .client import RemoteEngine
from .connection import UNAVAILABLE_MESSAGE
from .routing import Candidate, pool_state, rank, same_model, total_stats

log = logging.getLogger(__name__)

T = TypeVar("T")


class EnginePool:
    """Several resident engines behind one EngineHandle; `token`: their shared secret (FISHGATE_ENGINE_TOKEN)."""

    def __init__(self, addresses: Iterable[str] = (), *, token: str | None = None) -> None:
        self.fault: str | None = None  # never set: each engine process reports its own
        self.config_error: str | None = None
        self._token = token
        self._engines: dict[str, RemoteEngine] = {}
        self._model: ModelInfo | None = None  # the model the pool serves: the first engine's to be known
        self._refused_models: dict[str, ModelInfo] = {}  # address → the other model it serves (logged once)
        self._started = False
        self._draining = False
        self._stopped = False
        self._rng = random.Random()
        self.set_addresses(addresses)

    # ---- membership --------------------------------------------------------------------------------------------------
    def set_addresses(self, addresses: Iterable[str]) -> None:
        """Link the engines at `addresses` (`unix:PATH` / `tcp:HOST:PORT`) and drop the others: a dropped engine's
        sessions end with `engine_unavailable`. Call on the event loop once the pool has started. ValueError (and no
        change) for an address that does not parse."""
        wanted = list(dict.fromkeys(a.strip() for a in addresses if a.strip()))
        for address in wanted:
            parse_address(address)
        for address in [a for a in self._engines if a not in wanted]:
            remote = self._engines.pop(address)
            self._refused_models.pop(address, None)
            if remote.open_sessions:
                log.warning("engine %s left the pool; its %d sessions end", address, remote.open_sessions)
            remote.stop()
        for address in wanted:
            if address not in self._engines:
                remote = RemoteEngine(address, token=self._token)
                self._engines[address] = remote
                if self._started and not self._stopped:
                    remote.start()

    @property
    def engines(self) -> Mapping[str, RemoteEngine]:
        """address → its link (a read-only view)."""
        return types.MappingProxyType(self._engines)

    # ---- state -------------------------------------------------------------------------------------------------------
    @property
    def state(self) -> EngineState:
        if self._stopped:
            return EngineState.STOPPED
        state = pool_state(r.state for a, r in self._engines.items() if not self._model_refused(a, r))
        return EngineState.DRAINING if self._draining and state is EngineState.READY else state

    @property
    def ready(self) -> bool:
        return self.state is EngineState.READY

    @property
    def info(self) -> ModelInfo | None:
        routable = self._routable()
        return routable[0].info if routable else self._pool_model()

    @property
    def capacity(self) -> int:
        """Sessions the ready engines hold together (each shared with its other gateways)."""
        return sum(r.capacity for r in self._routable())

    @property
    def open_sessions(self) -> int:
        """This gateway's sessions, on all engines."""
        return sum(r.open_sessions for r in self._engines.values())

    @property
    def engines_ready(self) -> int:
        """Engines that take sessions now (ready, serving the pool's model)."""
        return len(self._routable())

    # ---- lifecycle ---------------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Link every engine (on the event loop); idempotent."""
        self._started = True
        for remote in self._engines.values():
            remote.start()

    def drain(self) -> None:
        """This gateway admits no new sessions; the engines (shared with other gateways) go on."""
        self._draining = True
        for remote in self._engines.values():
            remote.drain()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Close every link (their engines close this gateway's sessions). Callable from any thread."""
        self._stopped = True
        for remote in list(self._engines.values()):
            remote.stop(timeout_s)

    # ---- routing -----------------------------------------------------------------------------------------------------
    def _pool_model(self) -> ModelInfo | None:
        """The pool's model: kept while an engine in the pool serves it, else the first known engine's."""
        known = [r.info for r in self._engines.values() if r.info is not None]
        if self._model is None or not any(same_model(info, self._model) for info in known):
            self._model = known[0] if known else None
        return self._model

    def _model_refused(self, address: str, remote: RemoteEngine) -> bool:
        model, info = self._pool_model(), remote.info
        if model is None or info is None or same_model(info, model):
            self._refused_models.pop(address, None)
            return False
        if self._refused_models.get(address) != info:
            self._refused_models[address] = info
            log.error("engine %s serves another model than the pool's (%s; the pool: %s): no sessions go to it; run "
                      "every engine of a pool with the same checkpoint and settings", address, info, model)  # fmt: skip
        return True

    def _routable(self) -> list[RemoteEngine]:
        return [r for a, r in self._engines.items() if r.ready and not self._model_refused(a, r)]

    def _ranked(self, among: Sequence[RemoteEngine] | None = None) -> list[RemoteEngine]:
        """Ready engines serving the pool's model (or `among`), in the order a new session tries them."""
        remotes = self._routable() if among is None else among
        by_address = {r.address: r for r in remotes}
        order = rank([Candidate(r.address, r.headroom, r.open_sessions) for r in remotes], self._rng)
        return [by_address[a] for a in order]

    def _fallback(self) -> RemoteEngine:
        """With no engine ready: one that answers (its refusal says why: starting, draining), else unavailable."""
        linked = [r for a, r in self._engines.items() if not self._model_refused(a, r)]
        for remote in linked:
            if remote.state is not EngineState.UNAVAILABLE:
                return remote
        if linked:
            return linked[0]
        raise EngineUnavailable(UNAVAILABLE_MESSAGE)

    # ---- sessions and calls ------------------------------------------------------------------------------------------
    async def admit(self, voice: Voice, settings: SynthesisSettings, wait_s: float | None = None) -> Session:
        """A session on the engine with most headroom; the next best when it refuses (overloaded), and so on. When
        every engine refused and one of them only deferred it (its real-time admission), it waits `wait_s` on the
        best of those as a lone engine's admit would; else the first refusal stands (Overloaded, `overloaded`)."""
        if self._draining:
            raise NotReady("this gateway is shutting down; retry on another")
        ranked = self._ranked()
        if len(ranked) <= 1:
            remote = ranked[0] if ranked else self._fallback()
            return await remote.admit(voice, settings, wait_s)
        refusals: list[FishgateError] = []
        deferred: list[RemoteEngine] = []
        for remote in ranked:
            try:
                return await remote.admit(voice, settings, 0.0)
            except AdmissionDeferred as e:
                refusals.append(e)
                deferred.append(remote)
            except (Overloaded, NotReady) as e:  # full, or gone or draining since it was ranked: the next one
                refusals.append(e)
        if deferred and (wait_s is None or wait_s > 0):
            best = self._ranked([r for r in deferred if r.ready]) or deferred
            return await best[0].admit(voice, settings, wait_s)
        raise next((e for e in refusals if isinstance(e, Overloaded)), refusals[0])

    async def check_texts(self, texts: Sequence[str]) -> None:
        await self._on_best(lambda r: r.check_texts(texts))

    async def encode_reference(self, audio: np.ndarray, sample_rate_hz: int) -> np.ndarray:
        return await self._on_best(lambda r: r.encode_reference(audio, sample_rate_hz))

    async def _on_best(self, call: Callable[[RemoteEngine], Awaitable[T]]) -> T:
        """`call` on the engine with most headroom; on the next when one is gone or too busy for it."""
        ranked = self._ranked() or [self._fallback()]
        for remote in ranked[:-1]:
            try:
                return await call(remote)
            except (EngineUnavailable, Overloaded):
                continue
        return await call(ranked[-1])

    # ---- counters ----------------------------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """The engines' counters summed (streaming.engine_link.routing.total_stats), with `engines`: each engine's
        own (RemoteEngine.stats, with `ready` and `model_refused`), by address."""
        routable = {r.address for r in self._routable()}
        per_engine: dict[str, dict[str, Any]] = {}
        for address, remote in self._engines.items():
            stats = remote.stats()
            stats["ready"] = int(address in routable)
            stats["model_refused"] = int(address in self._refused_models)
            per_engine[address] = stats
        out = total_stats(per_engine)
        out["state"] = self.state.value
        out["engines_ready"] = len(routable)
        out["engines_total"] = len(self._engines)
        out["engines"] = per_engine
        return out

    def gpu_memory_bytes(self) -> int:
        return sum(r.gpu_memory_bytes() for r in self._engines.values())

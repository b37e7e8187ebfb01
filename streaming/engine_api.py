"""What a gateway sees of an engine, whether it runs in this process (`streaming.engine.Engine`) or in a resident
engine process reached over a Unix socket (`streaming.engine_link.client.RemoteEngine`): its states, the served
model's description, and `EngineHandle`, the one interface `server/` programs against.

Imports no torch (and nothing that does): a gateway attached to a remote engine starts without loading it.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from .sampling_defaults import FISH_SAMPLING, SamplingDefaults
from .session import Session, SynthesisSettings, Voice


class EngineState(enum.Enum):
    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"
    STOPPED = "stopped"
    FAULTED = "faulted"
    # a remote engine this gateway cannot reach (not started, restarting, dead); the gateway reconnects by itself.
    # An in-process Engine never takes it.
    UNAVAILABLE = "engine_unavailable"


@dataclass(frozen=True, slots=True)
class ModelInfo:
    name: str
    untrained: bool  # a random-weight model: its output is noise
    max_frames_per_char: float | None  # cap on frames per input character (untrained models never stop alone)
    sample_rate_hz: int
    samples_per_frame: int
    num_codebooks: int
    max_seq_len: int
    device: str
    dtype: str
    sampling: SamplingDefaults = FISH_SAMPLING  # what requests naming no sampling value get


class EngineHandle(Protocol):
    """The engine as the gateway uses it. Read-only members are properties here so that plain attributes
    (Engine's) and computed ones (RemoteEngine's) both satisfy it."""

    @property
    def state(self) -> EngineState: ...

    @property
    def info(self) -> ModelInfo | None: ...

    @property
    def fault(self) -> str | None: ...

    @property
    def config_error(self) -> str | None: ...

    @property
    def ready(self) -> bool: ...

    @property
    def capacity(self) -> int: ...

    @property
    def open_sessions(self) -> int: ...

    def start(self) -> None:
        """Begin starting (idempotent); readiness follows. Called on the gateway's event loop."""

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop for good; may block (the server calls it from a thread)."""

    def drain(self) -> None:
        """Admit no new sessions; running ones go on until closed."""

    async def admit(self, voice: Voice, settings: SynthesisSettings, wait_s: float | None = None) -> Session: ...

    async def check_texts(self, texts: Sequence[str]) -> None:
        """UnsupportedLanguage for the first text the served model cannot read."""

    async def encode_reference(self, audio: np.ndarray, sample_rate_hz: int) -> np.ndarray: ...

    def stats(self) -> dict[str, Any]: ...

    def gpu_memory_bytes(self) -> int: ...

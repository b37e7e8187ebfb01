"""Named groups of engine settings: `fishgate serve --profile NAME`, or `backend_config(NAME)` and
`worker_limits(NAME)` for a library user (`Engine(EngineConfig(backend_config("throughput"), worker_limits(
"throughput")))`). A profile is only the fields it changes from BackendConfig's and WorkerLimits' own defaults
(streaming.config), which are the latency profile. Pure Python; knows nothing about flags or the environment.

Figures from docs/BENCHMARKS.md and docs/DECISIONS.md (full-size Fish 1.5, random weights, bf16). A third profile for a
fast start (`compile_after_ready`: ready in ~10 s instead of 31-37 s on warm caches) was left out: it is one
setting, orthogonal to both workloads, measured only with the latency defaults, and its price (uncompiled graphs for
~35 s after ready, a request that meets a compiled capture waits up to 3.7 s) is a deployment choice to make
explicitly, not a side effect of picking a workload.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from .config import BackendConfig, WorkerLimits


@dataclass(frozen=True, slots=True)
class Profile:
    summary: str  # one line for `fishgate serve --help`
    backend: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))  # BackendConfig overrides
    limits: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))  # WorkerLimits overrides


PROFILES: Mapping[str, Profile] = MappingProxyType({
    # The dataclasses' defaults: a few streams, each with the lowest first audio. H200: a lone stream's decode step
    # 1.45 ms, engine first audio p50 14.5-17 ms server side; warm start 31-37 s.
    "latency": Profile("few streams, lowest first audio: 8 sessions, batch buckets up to 8 rows compiled"),
    # The settings of every end-to-end 300-stream measurement (`python -m bench.gpu`'s throughput settings). H100,
    # clients at their defaults: 300 streams, first audio p50 109 / p95 142 ms, no underruns; H200 with the bare
    # client: p95 120-131 ms. Start-up is longer, every bucket up to 512 rows compiling: H200, ready in 102-142 s on
    # an empty compile cache, 28-51 s on a warm one.
    "throughput": Profile(
        "many streams per GPU: 512 sessions, every batch bucket compiled, real-time admission at 0.9 of a frame",
        backend=MappingProxyType({
            "max_sessions": 512,
            "compile_max_batch": 512,  # every bucket: H200, step at 384 rows 19.6 → 13.3-13.6 ms
            "vocoder_half_step_buckets": True,  # fewer padded vocoder rows in the large batched calls
        }),
        limits=MappingProxyType({
            # refuse new sessions while turns average over 0.9 of a frame (41.8 ms): running streams keep real time
            "admission_turn_fraction": 0.9,
        }),
    ),
})  # fmt: skip
DEFAULT_PROFILE = "latency"  # what `fishgate serve` and BackendConfig() run


def get_profile(name: str) -> Profile:
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown profile {name!r}: choose {' or '.join(PROFILES)}") from None


def backend_config(profile: str = DEFAULT_PROFILE, **overrides: Any) -> BackendConfig:
    """The profile's BackendConfig, with `overrides` (BackendConfig fields) on top."""
    return BackendConfig(**{**get_profile(profile).backend, **overrides})


def worker_limits(profile: str = DEFAULT_PROFILE, **overrides: Any) -> WorkerLimits:
    """The profile's WorkerLimits, with `overrides` (WorkerLimits fields) on top."""
    return WorkerLimits(**{**get_profile(profile).limits, **overrides})

"""What a request that names no sampling value gets, and the ranges every sampling value must fall in.

Fish's defaults (temperature 0.7, top-p 0.7, repetition penalty 1.2, each segment conditioned on the utterance's
previous ones) suit the official weights. A model folder can declare its own in `fishgate.json`
(`"sampling": {"temperature": 0.4, "condition_on_previous_chunks": false}`): the small embedded default voice reads
more words correctly at a lower temperature, and it was trained on single utterances without a previous segment in
the prompt, so it reads each segment on its own (issue 6's gate, model/default_model/README.md). A request's own
values always win; the server validates them against the same ranges (server/params.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Any

from .session import SynthesisSettings

SAMPLING_RANGES: dict[str, tuple[float, float]] = {
    "temperature": (0.0, 2.0),  # 0 = greedy
    "top_p": (0.01, 1.0),
    "repetition_penalty": (0.9, 2.0),
}


@dataclass(frozen=True, slots=True)
class SamplingDefaults:
    temperature: float = 0.7
    top_p: float = 0.7
    repetition_penalty: float = 1.2
    # Fish's request field: each segment's prompt holds the utterance's previous segments (text and codes)
    condition_on_previous_chunks: bool = True

    @classmethod
    def from_metadata(cls, raw: Any, source: str) -> SamplingDefaults:
        """fishgate.json's `sampling` object (absent: Fish's defaults); ValueError naming the field and its range."""
        if raw is None:
            return cls()
        if not isinstance(raw, dict):
            raise ValueError(f"{source}: 'sampling' must be an object such as {{\"temperature\": 0.4}}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"{source}: unknown sampling field(s) {unknown}; known: {sorted(known)}")
        values: dict[str, Any] = {}
        for name, value in raw.items():
            if name == "condition_on_previous_chunks":
                if not isinstance(value, bool):
                    raise ValueError(f"{source}: sampling.{name} must be true or false (got {value!r})")
                values[name] = value
                continue
            lo, hi = SAMPLING_RANGES[name]
            ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
            if not ok or not lo <= value <= hi:
                raise ValueError(f"{source}: sampling.{name} must be a number in [{lo}, {hi}] (got {value!r})")
            values[name] = float(value)
        return cls(**values)

    def applied_to(self, settings: SynthesisSettings) -> SynthesisSettings:
        """`settings` with these sampling values: what the servers' parsers build for a request that names none
        (programmatic callers of the engine pass their settings whole)."""
        return replace(
            settings, temperature=self.temperature, top_p=self.top_p, repetition_penalty=self.repetition_penalty,
            condition_on_previous_chunks=self.condition_on_previous_chunks,
        )  # fmt: skip


FISH_SAMPLING = SamplingDefaults()  # upstream's defaults, for models that declare none

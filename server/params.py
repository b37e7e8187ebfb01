"""Request parameters: the one table of accepted ranges, and parsing of Fish's TTSRequest into engine settings.

Every synthesis API (Fish live WebSocket, fish-speech `/v1/tts`, OpenAI `/v1/audio/speech`) validates through
here, so a range is written once and enforced everywhere. Out-of-range or mistyped values raise ValueOutOfRange
naming the field, the accepted range and what was sent. `null` means "use the default" (the SDKs send every field).
Knows nothing about sockets or the model.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from streaming.audio_out import (
    ACCEPTED_SAMPLE_RATES_HZ,
    MP3_BITRATES_KBPS,
    OPUS_BITRATES_KBPS,
    OutputFormat,
)
from streaming.chunking import Latency
from streaming.errors import TextTooLong, ValueOutOfRange
from streaming.sampling_defaults import FISH_SAMPLING, SAMPLING_RANGES, SamplingDefaults
from streaming.segmenter import SegmenterConfig
from streaming.session import SynthesisSettings

# ---- the table (docs/API.md reproduces it) -----------------------------------------------------------------------
# temperature, top_p, repetition_penalty: SAMPLING_RANGES (streaming/sampling_defaults.py, shared with model folders)
MAX_NEW_TOKENS = (1, 4096)  # frames per text segment
CHUNK_LENGTH = (100, 300)  # characters per text segment (Fish)
MIN_CHUNK_LENGTH = (0, 100)
SPEED = (0.5, 2.0)  # Fish prosody.speed
OPENAI_SPEED = (0.25, 4.0)  # OpenAI `speed`; beyond 0.5–2.0 two stretch passes are chained
VOLUME_DB = (-20.0, 20.0)
LIVE_FORMATS = ("pcm", "wav", "mp3", "opus")
HTTP_FORMATS = ("pcm", "wav", "mp3", "opus", "flac")
MAX_REFERENCES = 4
# A reference transcript is what its audio says (at most 60 s of speech, ~1,000 characters); the cap keeps a huge
# "transcript" from being tokenized on the engine thread only to fail the context check afterwards.
MAX_REFERENCE_TEXT_CHARS = 2_000
REFERENCE_SECONDS = (1.0, 60.0)  # per reference, and never more than the model's context allows
SEED = (0, 2**62)
MAX_AUDIO_S_PER_UTTERANCE = 600.0
OPUS_AUTO_BITRATE = -1000  # Fish's "let the encoder choose"


def check_range(name: str, value: Any, bounds: tuple[float, float], *, integer: bool = False) -> Any:
    """Return value if it is a number (an int where `integer`) within bounds; else raise with the range."""
    kind = "an integer" if integer else "a number"
    if isinstance(value, bool) or not isinstance(value, int | float) or (integer and not isinstance(value, int)):
        raise ValueOutOfRange(f"{name} must be {kind} in {bounds[0]}–{bounds[1]} (got {value!r})")
    if not math.isfinite(value) or not bounds[0] <= value <= bounds[1]:
        raise ValueOutOfRange(f"{name} must be in {bounds[0]}–{bounds[1]} (got {value!r})")
    return value


def check_choice(name: str, value: Any, choices: tuple[Any, ...]) -> Any:
    if value not in choices or isinstance(value, bool):
        shown = ", ".join(map(str, choices))
        raise ValueOutOfRange(f"{name} must be one of {shown} (got {value!r})")
    return value


def check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueOutOfRange(f"{name} must be true or false (got {value!r})")
    return value


def require_field(req: Mapping[str, Any], name: str, hint: str) -> None:
    """A field the request cannot do without; the message lists what was sent (a field of another API, a typo)."""
    if req.get(name) is None:
        sent = ", ".join(sorted(map(str, req))[:12]) or "none"
        raise ValueOutOfRange(f"{name} is required: {hint} (the request's fields: {sent})")


def check_text(name: str, value: Any, max_chars: int) -> str:
    if not isinstance(value, str):
        raise ValueOutOfRange(f"{name} must be a string (got {type(value).__name__})")
    if len(value) > max_chars:
        raise ValueOutOfRange(f"{name} is {len(value)} characters; the limit is {max_chars} — send it in parts")
    return value


@dataclass(frozen=True, slots=True)
class ReferenceSpec:
    """An inline reference voice before encoding: the audio file bytes and its transcript."""

    audio: bytes
    text: str


@dataclass(frozen=True, slots=True)
class TTSParams:
    """A parsed, validated TTSRequest."""

    text: str
    settings: SynthesisSettings
    output: OutputFormat
    segmenter: SegmenterConfig
    references: tuple[ReferenceSpec, ...]
    reference_id: str | None
    # Accepted and validated, with no effect on the text (docs/API.md): fish-speech v1.5.1 ignores it too, Fish
    # Speech 1.5 reads text as sent, and a model's own normaliser (the English default voice) always runs.
    normalize: bool


def _get(req: Mapping[str, Any], key: str, default: Any) -> Any:
    value = req.get(key)
    return default if value is None else value


def parse_tts_request(
    req: Any, *, formats: tuple[str, ...] = LIVE_FORMATS, max_text_chars: int,
    sampling: SamplingDefaults = FISH_SAMPLING,
) -> TTSParams:  # fmt: skip
    """Validate a Fish TTSRequest mapping (msgpack/JSON). Unknown fields are ignored (clients add fields). Sampling
    values the request leaves out come from `sampling` (the served model's defaults)."""
    if not isinstance(req, Mapping):
        raise ValueOutOfRange("request must be an object with TTSRequest fields (text, format, references, …)")
    text = check_text("text", _get(req, "text", ""), max_text_chars)
    fmt = check_choice("format", _get(req, "format", "mp3"), formats)
    rate_default = 48000 if fmt == "opus" else 44100
    rate = check_choice("sample_rate", _get(req, "sample_rate", rate_default), ACCEPTED_SAMPLE_RATES_HZ)
    bitrate: int | None = None
    if fmt == "mp3":
        bitrate = check_choice("mp3_bitrate", _get(req, "mp3_bitrate", 128), MP3_BITRATES_KBPS)
    elif fmt == "opus":
        opus = check_choice("opus_bitrate", _get(req, "opus_bitrate", 32), (OPUS_AUTO_BITRATE, *OPUS_BITRATES_KBPS))
        bitrate = None if opus == OPUS_AUTO_BITRATE else opus
    prosody = _get(req, "prosody", {})
    if not isinstance(prosody, Mapping):
        raise ValueOutOfRange("prosody must be an object {speed, volume}")
    speed = check_range("prosody.speed", _get(prosody, "speed", 1.0), SPEED)
    volume = check_range("prosody.volume", _get(prosody, "volume", 0.0), VOLUME_DB)
    latency_name = check_choice("latency", _get(req, "latency", "balanced"), tuple(m.value for m in Latency))
    latency = Latency(latency_name)
    chunk_length = check_range("chunk_length", _get(req, "chunk_length", 200), CHUNK_LENGTH, integer=True)
    min_chunk = check_range("min_chunk_length", _get(req, "min_chunk_length", 50), MIN_CHUNK_LENGTH, integer=True)
    seed = req.get("seed")
    if seed is not None:
        check_range("seed", seed, SEED, integer=True)
    sampled = {
        name: float(check_range(name, _get(req, name, getattr(sampling, name)), accepted))
        for name, accepted in SAMPLING_RANGES.items()
    }
    settings = SynthesisSettings(
        **sampled,
        max_new_tokens=check_range("max_new_tokens", _get(req, "max_new_tokens", 1024), MAX_NEW_TOKENS, integer=True),
        seed=seed,
        condition_on_previous_chunks=check_bool(
            "condition_on_previous_chunks",
            _get(req, "condition_on_previous_chunks", sampling.condition_on_previous_chunks),
        ),
        latency=latency,
        max_audio_s=MAX_AUDIO_S_PER_UTTERANCE,
    )
    references = parse_references(_get(req, "references", []))
    reference_id = req.get("reference_id")
    if reference_id is not None and not isinstance(reference_id, str):
        raise ValueOutOfRange(f"reference_id must be a string (got {type(reference_id).__name__})")
    return TTSParams(
        text=text,
        settings=settings,
        output=OutputFormat(fmt, rate, bitrate, float(volume), float(speed)),
        segmenter=SegmenterConfig.from_fish(chunk_length, min(min_chunk, chunk_length), latency),
        references=references,
        reference_id=reference_id or None,
        normalize=check_bool("normalize", _get(req, "normalize", True)),
    )


def parse_references(refs: Any) -> tuple[ReferenceSpec, ...]:
    if not isinstance(refs, list | tuple):
        raise ValueOutOfRange("references must be a list of {audio: bytes, text: str}")
    if len(refs) > MAX_REFERENCES:
        raise ValueOutOfRange(f"at most {MAX_REFERENCES} references are accepted (got {len(refs)})")
    out = []
    for i, ref in enumerate(refs):
        if not isinstance(ref, Mapping) or not isinstance(ref.get("audio"), bytes | bytearray):
            raise ValueOutOfRange(f"references[{i}] must be {{audio: <audio file bytes>, text: <its transcript>}}")
        text = ref.get("text")
        if not isinstance(text, str) or not text.strip():
            raise ValueOutOfRange(f"references[{i}].text must be the transcript of its audio (a non-empty string)")
        check_reference_text(text, f"references[{i}].text")
        out.append(ReferenceSpec(bytes(ref["audio"]), text))
    return tuple(out)


def check_reference_text(text: str, what: str) -> None:
    if len(text) > MAX_REFERENCE_TEXT_CHARS:
        raise TextTooLong(
            f"{what} is {len(text)} characters; a reference transcript holds at most {MAX_REFERENCE_TEXT_CHARS} "
            "(the words of a clip of at most 60 s)"
        )

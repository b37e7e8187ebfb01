"""Server settings: every flag of `fishgate serve`, each also readable from `FISHGATE_<FLAG>`, and every limit.

Owns names, help texts and parsing of flags and the environment. Settings that configure the engine default to
unset (None) and resolve through the profile (`--profile`, streaming.profiles) and then streaming.config's dataclass
defaults, so the CLI and a library user share one source of defaults. `--help` lists the flags an operator needs,
`--help-all` every setting. Knows nothing about Starlette or the engine's internals. Most of its length is the
settings' help texts, kept beside their fields.
"""

from __future__ import annotations

import argparse
import logging
import os
import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import Field, dataclass, field, fields
from pathlib import Path
from typing import Any

from streaming import profiles
from streaming.config import ADMISSION_WAIT_S, MAX_QUEUED_CHARS, BackendConfig, WorkerLimits
from streaming.engine_link.address import TcpAddress, parse_addresses

log = logging.getLogger("fishgate")

ENV_PREFIX = "FISHGATE_"
ON_OFF: Mapping[str, object] = {"on": True, "off": False}
AUTO_ON_OFF: Mapping[str, object] = {"auto": None, "on": True, "off": False}
OFF: Mapping[str, object] = {"off": None}
# argparse group titles in --help order; a setting marked advanced shows only in --help-all
GROUPS = {
    "engine": "model and engine",
    "access": "network and access",
    "limits": "limits",
    "process": "process",
    "gpu": "GPU graphs and kernels (advanced; docs/OPERATIONS.md)",
    "scheduling": "scheduling and admission (advanced; docs/OPERATIONS.md)",
}
DESCRIPTION = (
    "Real-time streaming speech gateway: API and demo page on one port. Every setting\n"
    "is also an environment variable FISHGATE_<NAME> (flags win). Profiles:\n"
    + "".join(
        textwrap.fill(p.summary, 78, initial_indent=f"  {name:<12}", subsequent_indent=" " * 14) + "\n"
        for name, p in profiles.PROFILES.items()
    )
)
EPILOG = "--help-all lists every setting (graphs, kernels, scheduling);\ndocs/OPERATIONS.md says what each does."
# Options earlier versions had, and what became of them (docs/OPERATIONS.md, "Removed options"): a flag is refused
# with this reason, a FISHGATE_ variable only warned about (an environment file may outlive an upgrade).
REMOVED_OPTIONS = {
    "vocoder_merge_padding": "merged vocoder calls measured slower; each chunk length has its own call",
    "compile_vocoder": "the vocoder's CUDA graphs are faster uncompiled",
    "vocoder_channels_last": "the GPU vocoder is always channels-last",
    "vocoder_autotune": "the GPU vocoder uses cuDNN's heuristic kernels",
    "compile_symbolic_batch_above": "compiled buckets share a symbolic-batch compilation (streaming.backend)",
    "prefill_max_rows": "prefill passes take up to 4 prompts",
    "prefill_step_share": "a turn's prompt budget is in tokens only",
    "admission_per_turn": "admission has no per-turn cap",
    "graph_first_frames": "first frames use CUDA graphs wherever the engine captures graphs",
    "graph_prefill": "prefill uses CUDA graphs wherever the engine captures graphs",
    "prefill_hold_for": "prompt holds wait only for latency-low streams",
}


def connections_for(sessions: int) -> int:
    """The default connection cap for an engine of `sessions` sessions: each twice over (a socket between turns and
    the next one), plus health checks, metrics and HTTP calls."""
    return 2 * sessions + 256


@dataclass(frozen=True, slots=True)
class Flag:
    help: str  # what --help shows (advanced settings: --help-all only)
    group: str  # a GROUPS key
    more: str = ""  # appended in --help-all
    advanced: bool = False
    engine: str | None = None  # "backend.<BackendConfig field>" or "limits.<WorkerLimits field>"
    words: Mapping[str, object] | None = None  # words the setting takes, each with its config value
    shown: str | None = None  # the default as --help words it, where the value alone would not say it
    secret: bool = False


@dataclass(frozen=True, slots=True)
class Settings:
    profile: str | None = field(default=None, metadata={"flag": Flag(
        "a coherent group of engine settings (above); single flags override its values",
        "engine", engine=None, words={name: name for name in profiles.PROFILES})})  # fmt: skip
    checkpoint: Path | None = field(default=None, metadata={"flag": Flag(
        "Fish Speech 1.5 checkpoint folder",
        "engine", engine="backend.checkpoint", shown="the embedded model")})  # fmt: skip
    device: str | None = field(default=None, metadata={"flag": Flag(
        "auto | cpu | cuda | cuda:N", "engine", engine="backend.device")})  # fmt: skip
    max_sessions: int | None = field(default=None, metadata={"flag": Flag(
        "sessions at once (WebSocket turns + HTTP); more get 1013/503; one KV-cache row each",
        "engine", engine="backend.max_sessions")})  # fmt: skip
    max_seq_len: int | None = field(default=None, metadata={"flag": Flag(
        "lower the model's context (positions) to save KV memory per session",
        "engine", engine="backend.max_seq_len", shown="the model's")})  # fmt: skip
    compile_max_batch: int | str | None = field(default=None, metadata={"flag": Flag(
        "GPU: torch.compile the decode step of batch buckets up to N rows (0 = off): faster steps, longer start",
        "engine", engine="backend.compile_max_batch", words={"auto": None},
        more=" (auto = 8 with CUDA graphs, off on CPU). H200, full-size model: first audio p50 36 → 25 ms; start-up "
        "+18 s on a warm --compile-cache-dir, +78 s on an empty one")})  # fmt: skip
    compile_after_ready: str | None = field(default=None, metadata={"flag": Flag(
        "GPU: ready before compiling; compiled graphs replace plain ones while idle (H200, warm caches: "
        "ready in 10 s instead of 31-37 s)",
        "engine", engine="backend.compile_after_ready", words=ON_OFF,
        more=". Until every compiled graph is in place (~35 s of idle time) a lone stream's first audio is ~30 ms "
        "instead of 16-18 ms, and a request arriving during a compiled capture waits for it (once 3.7 s)",
    )})  # fmt: skip
    compile_cache_dir: Path | None = field(default=None, metadata={"flag": Flag(
        "compiled code (torch.compile's and, unless TRITON_CACHE_DIR is exported, Triton's caches): keep it across "
        "restarts",
        "engine", shown="$TORCHINDUCTOR_CACHE_DIR, else ~/.cache/fishgate/compile")})  # fmt: skip
    references_dir: Path | None = field(default=None, metadata={"flag": Flag(
        "where stored voices live",
        "engine", shown="~/.cache/fishgate/references")})  # fmt: skip
    engine: str | None = field(default=None, metadata={"flag": Flag(
        "attach to a resident engine process (unix:PATH or tcp:HOST:PORT, as given to `fishgate engine --listen`; "
        "several, comma-separated, make a pool) instead of starting one here; its own flags then set the model and "
        "engine",
        "engine", shown="an engine in this process",
        more=". The gateway restarts in about a second, several gateways share one engine, and while the engine "
        "cannot be reached /readyz says engine_unavailable and the gateway reconnects by itself. A pool sends each "
        "new session to the engine with most headroom and is ready while one of its engines is")})  # fmt: skip
    engine_token: str | None = field(default=None, repr=False, metadata={"flag": Flag(
        "the engine link's shared secret: `fishgate engine` serves only gateways that send it, and needs one to "
        "listen beyond loopback",
        "access", advanced=True, secret=True,
        more="; set the same on the engine and its gateways, preferably as the variable (a flag shows in "
        "ps)")})  # fmt: skip
    batch_invariant: str | None = field(default=None, metadata={"flag": Flag(
        "row-wise kernels so a seeded stream is bitwise the same alone or under load (auto = on for "
        "CPU, off for GPU, where it costs throughput)",
        "engine", advanced=True, engine="backend.batch_invariant", words=AUTO_ON_OFF)})  # fmt: skip

    host: str = field(default="127.0.0.1", metadata={"flag": Flag("interface to listen on", "access")})
    port: int = field(default=7860, metadata={"flag": Flag("port for the API and the demo page", "access")})
    api_key: tuple[str, ...] = field(default=(), metadata={"flag": Flag(
        "required bearer key(s) on /v1, comma-separated; none = open",
        "access", secret=True)})  # fmt: skip
    allowed_origins: tuple[str, ...] = field(default=(), metadata={"flag": Flag(
        "browser origins allowed besides same-origin and localhost pages (comma-separated; '*' = any)",
        "access",
        more="; drives WebSocket, CORS and /v1 checks; 'null' only when listed")})  # fmt: skip
    allowed_hosts: tuple[str, ...] = field(default=(), metadata={"flag": Flag(
        "names besides localhost that requests to a loopback --host may be addressed to (a proxy's public name)",
        "access",
        more="; comma-separated, '*' = any. Without them a page that points its own domain at 127.0.0.1 (DNS "
        "rebinding) could use the server")})  # fmt: skip
    rate_limit_per_min: int = field(default=600, metadata={"flag": Flag(
        "requests + sessions per key (or IP) per minute", "access")})  # fmt: skip
    ws_compression: str = field(default="off", metadata={"flag": Flag(
        "negotiate permessage-deflate when a client offers it",
        "access", advanced=True, words=ON_OFF,
        more=". Audio barely compresses and every frame then costs deflate work on the event loop (H100, 300 streams "
        "offering it: 459 of 600 requests served, p95 first audio 17 s, against 600 and 142 ms off)")})  # fmt: skip

    max_text_chars: int = field(default=20_000, metadata={"flag": Flag(
        "text per request / utterance, in characters", "limits")})  # fmt: skip
    max_connections: int | None = field(default=None, metadata={"flag": Flag(
        "open HTTP + WebSocket connections; beyond it 503 before any work",
        "limits", shown="2 x max sessions + 256")})  # fmt: skip
    admission_turn_fraction: float | str | None = field(default=None, metadata={"flag": Flag(
        "refuse new sessions while engine turns average over F of a frame's 46 ms, so running streams keep real time "
        "(off: only --max-sessions limits)",
        "limits", engine="limits.admission_turn_fraction", words=OFF,
        more="; admit again below 0.8 x that or when the engine idles; sessions with work are also capped at the "
        "streams the last turns say fit, so a burst comes in a few turns at a time")})  # fmt: skip
    idle_timeout_s: float = field(default=600.0, metadata={"flag": Flag(
        "close a live WebSocket whose client sent nothing for this long, with no audio in flight",
        "limits",
        more="; pings do not count: voice agents idle between turns for minutes")})  # fmt: skip
    max_queued_chars: int = field(default=MAX_QUEUED_CHARS, metadata={"flag": Flag(
        "text one session may have waiting to be spoken; more gets text_too_long and the session goes on",
        "limits", advanced=True,
        more=". At least --max-text-chars")})  # fmt: skip
    max_frame_bytes: int = field(default=32 * 2**20, metadata={"flag": Flag(
        "largest WebSocket frame (bigger: close 1009)",
        "limits", advanced=True)})  # fmt: skip
    max_reference_bytes: int = field(default=10 * 2**20, metadata={"flag": Flag(
        "largest reference audio file",
        "limits", advanced=True)})  # fmt: skip
    max_session_s: float = field(default=0.0, metadata={"flag": Flag(
        "wall-time cap of one live WebSocket, all its turns together (close 1008); 0 = none",
        "limits", advanced=True)})  # fmt: skip
    send_timeout_s: float = field(default=30.0, metadata={"flag": Flag(
        "a send blocked this long closes the socket",
        "limits", advanced=True)})  # fmt: skip

    drain_grace_s: float = field(default=20.0, metadata={"flag": Flag(
        "on SIGTERM, time running utterances get to finish",
        "process")})  # fmt: skip
    log_level: str = field(default="info", metadata={"flag": Flag(
        "debug | info | warning | error",
        "process")})  # fmt: skip
    workers: int = field(default=1, metadata={"flag": Flag(
        "gateway processes serving this port, sharing one engine (a child process, or --engine's)",
        "process",
        more=": HTTP, WebSockets and audio encoding on more cores. Linux only. --max-connections (by default sized "
        "from the engine's sessions) and --rate-limit-per-min stay the whole server's, shared out among the gateways; "
        "a gateway or engine child that dies is restarted")})  # fmt: skip

    graphs_up_front: int | str | None = field(default=None, metadata={"flag": Flag(
        "capture decode and first-frame graphs only up to this batch bucket before ready; the rest while idle or on "
        "first use (a pause for that turn). H200, warm cache: the buckets above one row took ~24 of a 29.7 s capture",
        "gpu", advanced=True, engine="backend.graphs_up_front", words={"all": None})})  # fmt: skip
    prefill_graphs_up_front: int | None = field(default=None, metadata={"flag": Flag(
        "capture the prefill graphs of up to N prompts a pass before ready (0 = none; the rest while idle or on first "
        "use). H200: the one-row ones take 1.4-3.1 s; without them 2 of the first 8 requests met a capture in their "
        "turn (255 and 370 ms)",
        "gpu", advanced=True, engine="backend.prefill_graphs_up_front")})  # fmt: skip
    compile_tune_single_row: str | None = field(default=None, metadata={"flag": Flag(
        "compile the one-row decode step with inductor's coordinate-descent tuning (off by default: with the GEMV "
        "kernels, H200 batch-1 step 1.485 ms tuned against 1.451 ms off, for ~37 s more of cold compile and up to 16 s "
        "of re-tuning at warm starts)",
        "gpu", advanced=True, engine="backend.tune_single_row", words=ON_OFF)})  # fmt: skip
    length_attention: str | None = field(default=None, metadata={"flag": Flag(
        "decode attention through a Triton kernel that reads each stream's keys only up to its "
        "position (H200: step at 384 rows 12.1 → 9.3 ms). auto = on for a CUDA GPU with Triton unless batch-invariant;"
        " on refuses to start elsewhere",
        "gpu", advanced=True, engine="backend.length_attention", words=AUTO_ON_OFF)})  # fmt: skip
    gemv_kernels: str | None = field(default=None, metadata={"flag": Flag(
        "the compiled one-row step's matrix-vector products as fused Triton kernels (H200: batch-1 "
        "step 2.16 → 1.57 ms). auto = on where they pass a start-up self-check, unless batch-invariant",
        "gpu", advanced=True, engine="backend.gemv_kernels", words=AUTO_ON_OFF)})  # fmt: skip
    gemv_configs: Path | None = field(default=None, metadata={"flag": Flag(
        "JSON launch configs for --gemv-kernels from `python -m bench.gemv_sweep --out FILE` on this GPU (built in: "
        "the H200's)",
        "gpu", advanced=True, engine="backend.gemv_configs", shown="the built-in ones")})  # fmt: skip
    programmatic_launch: str | None = field(default=None, metadata={"flag": Flag(
        "the decode step's Triton kernels by programmatic dependent launch on compute capability 9.0+ "
        "(H200: batch-1 step 1.64 → 1.45 ms, bitwise the same); off is an escape hatch for drivers and profilers",
        "gpu", advanced=True, engine="backend.programmatic_launch", words={"auto": True, "off": False})})  # fmt: skip
    vocoder_overlap: str | None = field(default=None, metadata={"flag": Flag(
        "the vocoder decodes on its own CUDA stream beside the next turn's step (H200, 300 streams: "
        "turn 22.5-23.4 → 17.8-19.0 ms, p95 first audio 215-283 → 189-250 ms). auto = on for CUDA graphs",
        "gpu", advanced=True, engine="backend.vocoder_overlap", words=AUTO_ON_OFF)})  # fmt: skip
    vocoder_half_step_buckets: str | None = field(default=None, metadata={"flag": Flag(
        "vocoder graphs also at 3, 6, 12, 24, 48 rows (72 graphs instead of 42, the extra ones captured "
        "while idle), so batched calls pad fewer rows (stand-in device, 256 streams: vocoder time a turn -8 %)",
        "gpu", advanced=True, engine="backend.vocoder_half_step_buckets", words=ON_OFF)})  # fmt: skip

    admission_capacity_fraction: float | str | None = field(default=None, metadata={"flag": Flag(
        "with --admission-turn-fraction: fit the streams with work into F of a frame when that should be tighter than "
        "the turn fraction (H200, 384 streams: 0.67 with 0.9 held underruns at 0 against 1.4 %, p95 first audio 317 "
        "against 184 ms)",
        "scheduling", advanced=True, engine="limits.admission_capacity_fraction", words=OFF,
        shown="the turn fraction")})  # fmt: skip
    admission_wait_s: float = field(default=ADMISSION_WAIT_S, metadata={"flag": Flag(
        "with --admission-turn-fraction: how long a new session waits for room before it is refused (0: at once); the "
        "wait counts in its first audio",
        "scheduling", advanced=True)})  # fmt: skip
    prefill_hold_below_s: float | str | None = field(default=None, metadata={"flag": Flag(
        "while a latency-low stream's client has less audio than this buffered, new prompts wait (off: never)",
        "scheduling", advanced=True, engine="limits.prefill_hold_below_s", words=OFF)})  # fmt: skip
    prefill_hold_max_s: float | None = field(default=None, metadata={"flag": Flag(
        "the longest new prompts wait at a time under --prefill-hold-below-s",
        "scheduling", advanced=True, engine="limits.prefill_hold_max_s")})  # fmt: skip
    pace_lead_s: float | str | None = field(default=None, metadata={"flag": Flag(
        "while a stream needs audio soon, streams with more than this much audio ahead sit out the turn (H200, 300 "
        "streams: p95 first audio 238 → 185 ms; off: every stream every turn)",
        "scheduling", advanced=True, engine="limits.pace_lead_s", words=OFF)})  # fmt: skip

    @property
    def resolved_profile(self) -> str:
        return self.profile or profiles.DEFAULT_PROFILE

    @property
    def resolved_references_dir(self) -> Path:
        return self.references_dir or Path.home() / ".cache" / "fishgate" / "references"

    @property
    def connections_follow_engine(self) -> bool:
        """Attached to a resident engine (--engine) without --max-connections: this process's own --max-sessions says
        nothing of that engine, so the connection cap follows the engine's sessions (server.connection_cap)."""
        return self.engine is not None and self.max_connections is None

    @property
    def resolved_max_connections(self) -> int:
        """--max-connections, else room for every session twice over plus health checks, metrics and HTTP calls
        (a gateway attached with --engine: of its engine's sessions, once it knows them; server.connection_cap)."""
        if self.max_connections is not None:
            return self.max_connections
        return connections_for(self.backend_config().max_sessions)

    @property
    def resolved_compile_cache_dir(self) -> Path:
        """--compile-cache-dir, else an exported TORCHINDUCTOR_CACHE_DIR, else ~/.cache/fishgate/compile."""
        if self.compile_cache_dir is not None:
            return self.compile_cache_dir
        exported = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
        return Path(exported) if exported else Path.home() / ".cache" / "fishgate" / "compile"

    def backend_config(self) -> BackendConfig:
        """The profile's BackendConfig with the engine settings given here on top (and the CLI's compile cache)."""
        overrides = engine_overrides(self, "backend")
        return profiles.backend_config(self.resolved_profile, compile_cache_dir=self.resolved_compile_cache_dir,
                                       **overrides)  # fmt: skip

    def worker_limits(self) -> WorkerLimits:
        return profiles.worker_limits(self.resolved_profile, **engine_overrides(self, "limits"))


# What `fishgate engine` takes besides --listen: every setting of the engine itself, and its process's. The rest
# (address, access, request limits, stored voices) belong to the gateways that attach to it.
ENGINE_PROCESS_SETTINGS = frozenset(
    {f.name for f in fields(Settings) if f.metadata["flag"].engine is not None}
    | {"profile", "compile_cache_dir", "max_queued_chars", "admission_wait_s", "drain_grace_s", "log_level"}
    | {"engine_token"}  # the link's secret: the engine checks it, its gateways send it
)


def engine_settings_given(settings: Settings) -> list[str]:
    """The engine-process settings given to a gateway that attaches to a resident engine (they have no effect)."""
    default = Settings()
    names = ENGINE_PROCESS_SETTINGS - {"drain_grace_s", "log_level", "engine_token"}
    return sorted(f"--{n.replace('_', '-')}" for n in names if getattr(settings, n) != getattr(default, n))


def flag_of(f: Field[Any]) -> Flag:
    flag = f.metadata["flag"]
    assert isinstance(flag, Flag)
    return flag


def engine_overrides(settings: Settings, target: str) -> dict[str, object]:
    """{config field: value} of the engine settings given for `target` ("backend" or "limits"), words translated."""
    out: dict[str, object] = {}
    for f in fields(Settings):
        flag, value = flag_of(f), getattr(settings, f.name)
        if flag.engine is None or value is None or flag.engine.split(".")[0] != target:
            continue
        if isinstance(value, str) and flag.words is not None and value in flag.words:
            value = flag.words[value]
        out[flag.engine.split(".")[1]] = value
    return out


def _shown_default(f: Field[Any]) -> str:
    """The default --help prints: for an engine setting each profile's value where they differ."""
    flag = flag_of(f)
    if flag.engine is None:
        if flag.shown is not None:
            return flag.shown
        if f.name == "profile":
            return profiles.DEFAULT_PROFILE
        return "none" if f.default in (None, ()) else str(f.default)
    kind, name = flag.engine.split(".")
    build = profiles.backend_config if kind == "backend" else profiles.worker_limits
    shown = {p: _word(flag, getattr(build(p), name)) for p in profiles.PROFILES}
    if len(set(shown.values())) == 1:
        return shown[profiles.DEFAULT_PROFILE]
    return ", ".join(f"{p}: {v}" for p, v in shown.items())


def _word(flag: Flag, value: object) -> str:
    if value is None and flag.shown is not None:
        return flag.shown
    for word, meant in (flag.words or {}).items():
        if meant is value or (type(meant) is type(value) and meant == value):
            return word
    return str(value)


def _metavar(f: Field[Any]) -> str:
    flag = flag_of(f)
    if flag.words is not None and "str" in str(f.type) and not any(t in str(f.type) for t in ("int", "float")):
        return "|".join(flag.words)
    last = f.name.split("_")[-1]
    if "tuple" in str(f.type):
        return last.removesuffix("s").upper() + ",..."  # api_key: KEY,...
    if "Path" in str(f.type):
        return "FILE" if f.name == "gemv_configs" else "DIR"
    if f.name.endswith("_s"):
        return "S"
    return "F" if "float" in str(f.type) else ("N" if "int" in str(f.type) else last.upper())  # host: HOST


def _help_text(f: Field[Any], full: bool) -> str:
    flag = flag_of(f)
    text = flag.help + (flag.more if full else "")
    default = "set" if flag.secret and f.default else _shown_default(f)
    return f"{text} [{ENV_PREFIX}{f.name.upper()}; default {default}]".replace("%", "%%")


class _HelpAll(argparse.Action):
    """--help-all: the help with every setting and its longer text, then exit."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help=kwargs.get("help"))

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: object, values: object, option_string: str | None = None
    ) -> None:
        by_name = {f.name: f for f in fields(Settings)}
        for action in parser._actions:
            if action.dest in by_name:
                action.help = _help_text(by_name[action.dest], full=True)
        parser.print_help()
        parser.exit()


def build_parser(
    parser: argparse.ArgumentParser, only: frozenset[str] | None = None, description: str = DESCRIPTION
) -> argparse.ArgumentParser:
    """`fishgate serve`'s flags on `parser`; `only`: just these settings (`fishgate engine`)."""
    parser.usage = "%(prog)s [--profile latency|throughput] [options]"
    parser.description = description
    parser.epilog = EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--help-all", action=_HelpAll, help="show every setting, advanced ones included, and exit")
    groups = {key: parser.add_argument_group(title) for key, title in GROUPS.items()}
    for f in fields(Settings):
        if only is not None and f.name not in only:
            continue
        flag = flag_of(f)
        help_text = argparse.SUPPRESS if flag.advanced else _help_text(f, full=False)
        groups[flag.group].add_argument(
            "--" + f.name.replace("_", "-"), dest=f.name, default=None, metavar=_metavar(f), help=help_text
        )
    for name in REMOVED_OPTIONS:
        parser.add_argument("--" + name.replace("_", "-"), action=_Removed, nargs="?", help=argparse.SUPPRESS)
    return parser


class _Removed(argparse.Action):
    """A flag of an earlier version: refused with what became of it, instead of argparse's "unrecognized"."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: object, values: object, option: str | None = None):
        reason = REMOVED_OPTIONS[self.dest]
        parser.error(f"{option} was removed ({reason}); drop it. docs/OPERATIONS.md, 'Removed options', says why")


def _convert(f: Field[Any], raw: str) -> object:
    flag, kind = flag_of(f), str(f.type)
    word = raw.strip().lower()
    if flag.words is not None and word in flag.words:
        return word
    if "tuple" in kind:
        return tuple(part.strip() for part in raw.split(",") if part.strip())
    if "Path" in kind:
        return Path(raw) if raw else None
    if "int" in kind:
        return int(raw)
    if "float" in kind:
        return float(raw)
    if flag.words is not None:
        raise ValueError(raw)
    return raw


def _describe(f: Field[Any]) -> str:
    """What a setting takes, for an error message: "on or off", "a number or off", …"""
    flag, kind = flag_of(f), str(f.type)
    words = list(flag.words or ())
    listed = ", ".join(words[:-1]) + " or " + words[-1] if len(words) > 1 else "".join(words)
    number = "a whole number" if "int" in kind else "a number"
    if "int" in kind or "float" in kind:
        return f"{number} or {listed}" if words else number
    return listed or kind


def settings_from(args: argparse.Namespace, environ: dict[str, str] | None = None) -> Settings:
    """Flags win over FISHGATE_* environment variables, which win over the profile and the defaults."""
    environ = dict(os.environ) if environ is None else environ
    for name, reason in REMOVED_OPTIONS.items():
        if ENV_PREFIX + name.upper() in environ:
            log.warning("%s%s is ignored: that option was removed (%s)", ENV_PREFIX, name.upper(), reason)
    values: dict[str, object] = {}
    for f in fields(Settings):
        raw = getattr(args, f.name, None)
        if raw is None:
            raw = environ.get(ENV_PREFIX + f.name.upper())
        if raw is None:
            continue
        try:
            values[f.name] = _convert(f, raw)
        except ValueError:
            raise SystemExit(f"fishgate: --{f.name.replace('_', '-')} must be {_describe(f)}, not {raw!r}") from None
        if f.name == "api_key" and not values[f.name]:  # a key that was meant to be set must not mean "open"
            raise SystemExit(f"fishgate: --api-key / {ENV_PREFIX}API_KEY is set but holds no key; unset it to run open")
    settings = Settings(**values)  # type: ignore[arg-type]
    check(settings)
    return settings


def check(settings: Settings) -> None:
    """Refuse values out of range, naming the flag (SystemExit), then resolve the engine's configs once."""
    s = settings
    for f in fields(Settings):  # a word setting holds one of its words (Settings may also be built directly)
        flag, value = flag_of(f), getattr(s, f.name)
        if isinstance(value, str) and flag.words is not None and value not in flag.words:
            raise SystemExit(f"fishgate: --{f.name.replace('_', '-')} must be {_describe(f)}, not {value!r}")

    def number(name: str) -> float | None:
        value = getattr(s, name)
        return None if value is None or isinstance(value, str) else value

    rules: list[tuple[bool, str]] = [
        ((n := number("max_sessions")) is not None and n < 1, "--max-sessions must be at least 1"),
        (s.max_queued_chars < s.max_text_chars, "--max-queued-chars must be at least --max-text-chars (one request's "
         "text)"),
        (s.max_connections is not None and s.max_connections < 1, "--max-connections must be at least 1 (leave it "
         "out for the default)"),
        (s.idle_timeout_s <= 0 or s.max_session_s < 0, "--idle-timeout-s must be above 0 and --max-session-s at "
         "least 0 (0: no cap)"),
        (not _within(number("admission_turn_fraction"), 0, 2), "--admission-turn-fraction must be in (0, 2] (e.g. "
         "0.9) or off"),
        (not _within(number("admission_capacity_fraction"), 0, 2), "--admission-capacity-fraction must be in (0, 2] "
         "(e.g. 0.67) or off"),
        (not _within(number("prefill_hold_below_s"), 0, 5), "--prefill-hold-below-s must be in (0, 5] seconds (e.g. "
         "0.1) or off"),
        (not _within(number("pace_lead_s"), 0.5, 60), "--pace-lead-s must be in (0.5, 60] seconds (e.g. 1.5) or off"),
        ((n := number("prefill_hold_max_s")) is not None and not 0 <= n <= 5, "--prefill-hold-max-s must be in "
         "[0, 5] seconds"),
        (not 0 <= s.admission_wait_s <= 60, "--admission-wait-s must be in [0, 60] seconds"),
        ((n := number("compile_max_batch")) is not None and n < 0, "--compile-max-batch must be 0 (off), a number of "
         "rows or auto"),
        ((n := number("prefill_graphs_up_front")) is not None and n < 0, "--prefill-graphs-up-front must be 0 "
         "(none) or a number of prompts"),
        ((n := number("graphs_up_front")) is not None and n < 1, "--graphs-up-front must be at least 1, or all"),
        (s.workers < 1, "--workers must be at least 1 (gateway processes)"),
        (s.engine is not None and not _are_engine_addresses(s.engine), "--engine must be unix:PATH or tcp:HOST:PORT "
         f"(the --listen address of `fishgate engine`; several comma-separated), not {s.engine!r}"),
    ]  # fmt: skip
    for broken, message in rules:
        if broken:
            raise SystemExit(f"fishgate: {message}")
    try:
        s.backend_config()
        s.worker_limits()
    except (TypeError, ValueError) as e:
        raise SystemExit(f"fishgate: {e}") from None


def _are_engine_addresses(text: str) -> bool:
    """Addresses a gateway can attach to: each unix:PATH or tcp:HOST:PORT with a port (not 0)."""
    try:
        addresses = parse_addresses(text)
    except ValueError:
        return False
    return all(not isinstance(a, TcpAddress) or a.port > 0 for a in addresses)


def _within(value: float | None, low: float, high: float) -> bool:
    """value in (low, high], or None (off)."""
    return value is None or low < value <= high


def parse_settings(argv: Sequence[str], environ: dict[str, str] | None = None) -> Settings:
    return settings_from(build_parser(argparse.ArgumentParser()).parse_args(argv), environ)

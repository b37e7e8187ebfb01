"""Server settings: every flag of `fishgate serve`, each also readable from `FISHGATE_<FLAG>`, and every limit.

Owns names, defaults, help texts and parsing of the environment. The CLI builds a Settings from argv + env;
tests build one directly. Knows nothing about Starlette or the engine.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path

ENV_PREFIX = "FISHGATE_"


@dataclass(frozen=True, slots=True)
class Settings:
    host: str = field(default="127.0.0.1", metadata={"help": "interface to listen on"})
    port: int = field(default=7860, metadata={"help": "port for the API and the demo page"})
    checkpoint: Path | None = field(
        default=None, metadata={"help": "Fish Speech 1.5 checkpoint folder (default: the embedded default model)"}
    )
    device: str = field(default="auto", metadata={"help": "auto | cpu | cuda | cuda:N"})
    max_sessions: int = field(default=8, metadata={"help": "concurrent sessions (WebSocket + HTTP); more get 1013/503"})
    batch_invariant: str = field(
        default="auto",
        metadata={"help": "auto | on | off: row-wise kernels so a seeded stream is bitwise the same alone or under "
                  "load (auto = on for CPU, off for GPU, where it costs throughput)"},
    )  # fmt: skip
    max_seq_len: int | None = field(
        default=None, metadata={"help": "lower the model's context (positions) to save KV memory per session"}
    )
    graphs_up_front: int | None = field(
        default=None,
        metadata={"help": "GPU: capture decode and first-frame graphs only up to this batch bucket before reporting "
                  "ready (faster start: H200 run 19 spent ~24 of a 29.7 s warm capture on the buckets above one "
                  "row); the rest are captured while the engine is idle, or on first use, a pause for that turn "
                  "(default: all)"},
    )  # fmt: skip
    graph_first_frames: str = field(
        default="on",
        metadata={"help": "on | off: sample the first frame of each segment through static buffers, on a GPU one CUDA "
                  "graph per batch bucket (eager it costs tens of ms per request; run 8: steady 128 streams p95 "
                  "first audio 830 → 300 ms); off = the plain eager path"},
    )  # fmt: skip
    graph_prefill: str = field(
        default="auto",
        metadata={"help": "auto | on | off: run prefill chunks through CUDA graphs, one per (rows, chunk, context) "
                  "bucket, captured on first use or after 0.5 s idle (eager, a pass is thousands of kernel launches); "
                  "auto = on for a GPU with CUDA graphs unless batch-invariant, off on CPU (run 11, same hold: level-1 "
                  "first audio p50 35 ms on against 45-88 off, a first burst of 64 2.6 s against 4.6 s)"},
    )  # fmt: skip
    prefill_max_rows: int = field(
        default=4,
        metadata={"help": "prompts per graph-captured prefill pass, 1, 2, 4, 8 or 16 (row buckets 1, 2, 4, ... up to "
                  "it; each bucket adds prefill graphs captured in idle time). H200 run 19: a pass of 8 short prompts "
                  "4.66 ms against 3.86 ms for 4, so 0.58 against 0.96 ms a prompt; 8 not yet measured end to end"},
    )  # fmt: skip
    prefill_graphs_up_front: int = field(
        default=1,
        metadata={"help": "GPU: capture the prefill graphs of up to this many prompts per pass before reporting ready "
                  "(0 = none; the rest are captured while the engine is idle, or on first use). 1 = the 12 one-row "
                  "buckets, 1.4-3.1 s of start-up on an H200 (run 30): without them the first requests after ready "
                  "paid captures inside their turns (2 of 8 requests at 255 and 370 ms)"},
    )  # fmt: skip
    compile_max_batch: int | None = field(
        default=None,
        metadata={"help": "torch.compile the decode step's repeated regions (transformer block, sampler, noise hash) "
                  "for batch buckets up to this many rows, before their CUDA graphs are captured; 0 = off; default "
                  "auto = 8 on a GPU with CUDA graphs, off on CPU. H200, full-size model: first audio p50 36 → 25 ms, "
                  "start-up +18 s with a warm --compile-cache-dir, +78 s on an empty one (docs/BENCHMARKS.md run 12)",
                  "shown_default": "auto"},
    )  # fmt: skip
    compile_tune_single_row: str = field(
        default="on",
        metadata={"help": "on | off: compile the one-row decode step with inductor's coordinate-descent tuning, its "
                  "GEMVs as fused Triton kernels (with --compile-max-batch; H200 run 14: batch-1 step 3.28 -> 2.64 ms, "
                  "about a minute more of compile per context bucket on an empty --compile-cache-dir)"},
    )  # fmt: skip
    compile_after_ready: str = field(
        default="off",
        metadata={"help": "on | off: with --compile-max-batch, capture every bucket's graph uncompiled first (no "
                  "compilation before ready), then replace each by its compiled capture, one at a time while the "
                  "engine is idle. H200 run 30, warm caches: process to ready 10 s instead of 31-37 s, every compiled "
                  "graph in place 33-37 s later; until then level-1 first audio ~30 ms instead of 16-18, and a "
                  "request that arrives during a compiled capture waits for it (once 3.7 s)"},
    )  # fmt: skip
    length_attention: str = field(
        default="auto",
        metadata={"help": "auto | on | off: the slow stack's decode attention through a Triton kernel that reads each "
                  "stream's keys only up to its position, instead of SDPA over the whole context bucket; the step then "
                  "runs at one context length, so a quarter of the decode graphs to capture at start-up (H200 run 19: "
                  "step at 384 rows 12.1 -> 9.3 ms; 300 streams' p95 first audio 323-1,370 -> 235-403 ms). auto = "
                  "on for a CUDA GPU with Triton unless batch-invariant; on refuses to start elsewhere"},
    )  # fmt: skip
    gemv_kernels: str = field(
        default="auto",
        metadata={"help": "auto | on | off: the compiled one-row decode step's matrix-vector products through Triton "
                  "kernels with the RMSNorms, RoPE, KV-cache writes, SwiGLU and residual adds fused in (and the "
                  "codebook head's), instead of inductor's reductions (H200 run 26: batch-1 step 2.16 -> 1.72 ms in "
                  "one call, 1.57 ms with the cache writes fused). Used where the one-row "
                  "step is compiled (--compile-max-batch >= 1). auto = on for a CUDA GPU with Triton whose kernels "
                  "pass a self-check at start-up, unless batch-invariant; on refuses to start elsewhere"},
    )  # fmt: skip
    programmatic_launch: str = field(
        default="auto",
        metadata={"help": "auto | off: the decode step's own Triton kernels (--gemv-kernels, --length-attention) "
                  "launched with programmatic dependent launch, so each one's weight reads start while the kernel "
                  "before it still runs (results bitwise the same; H200 run 27: batch-1 step 1.64 -> 1.45 ms). "
                  "auto = on for CUDA GPUs of compute capability 9.0 (Hopper) or newer"},
    )  # fmt: skip
    gemv_configs: Path | None = field(
        default=None,
        metadata={"help": "a JSON file of launch configs for the --gemv-kernels kernels, as `python -m "
                  "bench.gemv_sweep --out FILE` writes it on the GPU at hand (the built-in ones are the H200's)"},
    )  # fmt: skip
    vocoder_overlap: str = field(
        default="auto",
        metadata={"help": "auto | on | off: the vocoder decodes on its own CUDA stream beside the next turn's prefill "
                  "and decode step instead of after the step. H200 runs 20-21, warm servers: a turn at 300 streams "
                  "22.5-23.4 -> 17.8-19.0 ms; p95 first audio 189-250 ms with 0-1.3 %% of streams underrunning "
                  "(serial: 215-283 ms, 0.5-3 %%); at 384 streams 327-353 ms, at most 0.3 %% underran (serial, run "
                  "19: 0.5-8.2 %%). A stream's next segment starts one turn later. auto = on for a CUDA-graph "
                  "engine, off on CPU (no second stream there)"},
    )  # fmt: skip
    vocoder_merge_padding: int = field(
        default=0,
        metadata={"help": "row-frames of padding a turn's vocoder may spend to merge chunks of different lengths into "
                  "one call (the shorter ones padded and cut again). 0 = off, one call per chunk length. Measured "
                  "slower (H200 run 21 at 32: 2.7 -> 1.9 calls a turn, but the vocoder's share of a turn at 300 "
                  "streams 6.6-8.0 -> 8.2-8.9 ms and p95 first audio worse in all three A/Bs, e.g. 384 streams with "
                  "the overlap 353 -> 779 ms): each merged call gathers every causal layer's state by row"},
    )  # fmt: skip
    compile_symbolic_batch_above: int = field(
        default=8,
        metadata={"help": "with --compile-max-batch above this, the larger buckets compile with a symbolic batch "
                  "size: one compilation per attention length for all of them instead of one per bucket and length "
                  "(H200 run 15 with --compile-max-batch 512: step at 384 rows 19.6 -> 13.5 ms; set it to "
                  "--compile-max-batch or more for static shapes everywhere)"},
    )  # fmt: skip
    vocoder_half_step_buckets: str = field(
        default="off",
        metadata={"help": "on | off: vocoder graphs also at 3, 6, 12, 24, 48 rows (72 graphs instead of 42, the extra "
                  "ones captured in idle time), so batched calls pad fewer rows (stand-in device: vocoder time per "
                  "turn -8 %% at 256 streams; H200 run 15, on throughout: 9 %% padding; not measured against off)"},
    )  # fmt: skip
    vocoder_channels_last: str = field(
        default="on",
        metadata={"help": "off | on | tuned: the streaming vocoder keeps activations, state and conv weights "
                  "channels-last (time-major), cuDNN's tensor-core layout (GPU only; H200 run 17, 64 x 24 frames: "
                  "50 ms off, 29.5 ms on); tuned also autotunes each conv while its graphs are captured (26.5 ms, "
                  "but 5-16 s per graph). See docs/OPERATIONS.md"},
    )  # fmt: skip
    compile_vocoder: str = field(
        default="off",
        metadata={"help": "on | off: torch.compile the streaming vocoder's chunk decode before its CUDA graphs are "
                  "captured (GPU only; experimental: H200 run 13, 1x8-frame chunk 2.65 -> 2.16 ms, 938 -> 1,079x real "
                  "time batched, but minutes of compile before ready on an empty --compile-cache-dir)"},
    )  # fmt: skip
    compile_cache_dir: Path | None = field(
        default=None,
        metadata={"help": "torch.compile's cache (default: $TORCHINDUCTOR_CACHE_DIR if exported, else "
                  "~/.cache/fishgate/compile)"},
    )  # fmt: skip
    api_key: tuple[str, ...] = field(
        default=(), metadata={"help": "required bearer key(s) on /v1 (comma-separated); none = open", "secret": True}
    )
    allowed_origins: tuple[str, ...] = field(
        default=(),
        metadata={"help": "browser origins allowed for WebSocket, CORS and /v1 requests (comma-separated; '*' = any; "
                  "'null' only when listed); same-origin and localhost pages are always allowed"},
    )  # fmt: skip
    allowed_hosts: tuple[str, ...] = field(
        default=(),
        metadata={"help": "with --host on loopback, names besides localhost that requests may be addressed to (a "
                  "reverse proxy's public name; comma-separated; '*' = any). Without them a page that points its own "
                  "domain at 127.0.0.1 (DNS rebinding) could use the server"},
    )  # fmt: skip
    references_dir: Path | None = field(
        default=None, metadata={"help": "where stored voices live (default: ~/.cache/fishgate/references)"}
    )
    max_text_chars: int = field(default=20_000, metadata={"help": "text per request / utterance, in characters"})
    max_queued_chars: int = field(
        default=50_000,
        metadata={"help": "text one session may have waiting to be spoken (sent faster than it is spoken); more "
                  "gets a text_too_long error event and the session goes on. At least --max-text-chars"},
    )  # fmt: skip
    max_frame_bytes: int = field(default=32 * 2**20, metadata={"help": "largest WebSocket frame (bigger: close 1009)"})
    max_connections: int | None = field(
        default=None,
        metadata={"help": "open connections (HTTP and WebSocket together) the server holds at once; beyond it new "
                  "requests get 503 before any work. Default: 2 x --max-sessions + 256",
                  "shown_default": "auto"},
    )  # fmt: skip
    admission_turn_fraction: float | None = field(
        default=None,
        metadata={"help": "refuse new sessions (503 / close 1013, Retry-After) while the engine's turns average more "
                  "than this share of a frame's 46 ms, i.e. while the streams already running fall behind real time; "
                  "admit again below 0.8x that, or when the engine idles; sessions with work are also capped at the "
                  "streams the last turns say fit that limit, so a burst comes in a few turns at a time. E.g. 0.9; "
                  "off by default (only --max-sessions limits admission)", "shown_default": "off"},
    )  # fmt: skip
    admission_capacity_fraction: float | None = field(
        default=None,
        metadata={"help": "with --admission-turn-fraction: the share of a frame's 46 ms that the capacity cap fits "
                  "the streams with work into, when it should be tighter than the turn fraction (which still decides "
                  "when the engine is behind). A stream whose chunks are still growing needs turns of at most 0.67 "
                  "of a frame; e.g. 0.67 with a turn fraction of 0.9 (H200 run 31, 384 streams, one server: no "
                  "underruns against 11 of 768 requests, p95 first audio 317 against 184 ms). "
                  "Default: the turn fraction",
                  "shown_default": "the turn fraction"},
    )  # fmt: skip
    prefill_step_share: float | None = field(
        default=None,
        metadata={"help": "while streams decode, a turn writes only the new prompt tokens that fit in this share of "
                  "a decode step's time at the measured seconds per token (at least one prompt chunk), so a burst of "
                  "arrivals stalls the running streams by about a step instead of several (H200 run 17: 1,024-token "
                  "turns took 49-92 ms against 10-27 ms steps); the burst's first audio comes later instead (on the "
                  "stand-in device with 300 streams arriving steadily: 3 s). E.g. 1; off by default (not measured on "
                  "a GPU)", "shown_default": "off"},
    )  # fmt: skip
    prefill_hold_below_s: float | None = field(
        default=0.1,
        metadata={"help": "while any decoding stream's client has less than this many seconds of audio buffered, new "
                  "prompts wait (at most --prefill-hold-max-s at a time), so the running streams' turns are shorter "
                  "through a burst; new sessions' first audio comes later instead. off: never hold",
                  "shown_default": "0.1"},
    )  # fmt: skip
    prefill_hold_for: str = field(
        default="low",
        metadata={"help": "low | all: with --prefill-hold-below-s, hold new prompts only for nearly dry streams of "
                  "sessions that asked for latency low, or for any nearly dry stream (H200 run 29: 300 normal-latency "
                  "streams' p95 first audio 123-152 ms with low against 165 ms with all, no underruns either way; "
                  "near capacity, at 384 streams, low underran 2.7-14.5 %%, all 0 %%: use all there)"},
    )  # fmt: skip
    pace_lead_s: float | None = field(
        default=1.5,
        metadata={"help": "while some stream needs audio soon (its prompt is being written, or its client has under "
                  "0.5 s of audio ahead), streams whose clients have more than this many seconds of audio ahead of "
                  "playback sit out the turn: their frames would cost vocoder and host time in every turn that the "
                  "newcomers' first audio waits on. Codes and audio are unchanged, only when they are made. off: every "
                  "stream advances every turn (a batch request alone is never paced)", "shown_default": "1.5"},
    )  # fmt: skip
    prefill_hold_max_s: float = field(
        default=0.25,
        metadata={"help": "the longest new prompts wait at a time under --prefill-hold-below-s, so a burst still "
                  "gets in"},
    )  # fmt: skip
    admission_per_turn: int | None = field(
        default=None,
        metadata={"help": "with --admission-turn-fraction: admit at most this many new sessions between two decoding "
                  "turns (the rest wait in the admission queue), so the sessions let in when room opens do not all "
                  "start their prompts together. Stand-in device at H200 costs, 300 steady streams: 4 took requests "
                  "that underran from 5-15 %% to 1 %% and first audio p50 from ~0.3 to 0.8 s; on the H200 (run 18) no "
                  "difference at 300 streams. Off by default",
                  "shown_default": "off"},
    )  # fmt: skip
    admission_wait_s: float = field(
        default=2.0,
        metadata={"help": "with --admission-turn-fraction: how long a new session waits for room before it is refused "
                  "(a burst then comes in as the capacity estimate grows instead of being refused); 0 refuses at "
                  "once. At most --max-sessions sessions wait; the wait counts in their time to first audio"},
    )  # fmt: skip
    max_reference_bytes: int = field(default=10 * 2**20, metadata={"help": "largest reference audio file"})
    idle_timeout_s: float = field(
        default=600.0,
        metadata={"help": "close a live WebSocket whose client sent no message for this long and that has no audio "
                  "in flight (between turns: close 1000 with the reason; during a turn: error + finish first). "
                  "WebSocket pings do not count: voice agents idle between turns for minutes"},
    )  # fmt: skip
    max_session_s: float = field(
        default=0.0,
        metadata={"help": "wall-time cap of one live WebSocket connection, all its turns together (error + finish, "
                  "close 1008); 0 = no cap: a voice-agent conversation keeps one socket for its whole length",
                  "shown_default": "0 (off)"},
    )  # fmt: skip
    ws_compression: str = field(
        default="off",
        metadata={"help": "off | on: negotiate permessage-deflate when a client offers it (browsers, the websockets "
                  "library and pipecat do). PCM and encoded audio barely compress, and every frame then costs deflate "
                  "work on the event loop (one H200, 300 streams: 600/600 served off, 389/600 on). On only for "
                  "JSON-heavy clients on slow links"},
    )  # fmt: skip
    send_timeout_s: float = field(default=30.0, metadata={"help": "a send blocked this long closes the socket"})
    rate_limit_per_min: int = field(default=600, metadata={"help": "requests + sessions per key (or IP) per minute"})
    drain_grace_s: float = field(default=20.0, metadata={"help": "on SIGTERM, time running utterances get to finish"})
    log_level: str = field(default="info", metadata={"help": "debug | info | warning | error"})

    @property
    def resolved_references_dir(self) -> Path:
        return self.references_dir or Path.home() / ".cache" / "fishgate" / "references"

    @property
    def resolved_max_connections(self) -> int:
        """--max-connections, else room for every session twice over plus health checks, metrics and HTTP calls."""
        if self.max_connections is not None:
            return self.max_connections
        return 2 * self.max_sessions + 256

    @property
    def resolved_compile_cache_dir(self) -> Path:
        """--compile-cache-dir, else an exported TORCHINDUCTOR_CACHE_DIR, else ~/.cache/fishgate/compile."""
        if self.compile_cache_dir is not None:
            return self.compile_cache_dir
        exported = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
        return Path(exported) if exported else Path.home() / ".cache" / "fishgate" / "compile"


def _convert(name: str, raw: str) -> object:
    kind = {f.name: f for f in fields(Settings)}[name].type
    if kind in ("int", "int | None"):
        return int(raw)
    if kind in ("float",):
        return float(raw)
    if kind == "float | None":
        return None if raw.strip().lower() == "off" else float(raw)
    if "tuple" in str(kind):
        return tuple(part.strip() for part in raw.split(",") if part.strip())
    if "Path" in str(kind):
        return Path(raw) if raw else None
    return raw


def build_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    for f in fields(Settings):
        flag = "--" + f.name.replace("_", "-")
        env = ENV_PREFIX + f.name.upper()
        default = f.default
        shown = f.metadata.get("shown_default") or (
            "none" if default in (None, ()) else ("set" if f.metadata.get("secret") else default)
        )
        parser.add_argument(flag, dest=f.name, default=None, help=f"{f.metadata['help']} [env {env}; default {shown}]")
    return parser


def settings_from(args: argparse.Namespace, environ: dict[str, str] | None = None) -> Settings:
    """Flags win over FISHGATE_* environment variables, which win over defaults."""
    environ = dict(os.environ) if environ is None else environ
    values: dict[str, object] = {}
    for f in fields(Settings):
        raw = getattr(args, f.name, None)
        if raw is None:
            raw = environ.get(ENV_PREFIX + f.name.upper())
        if raw is None:
            continue
        try:
            values[f.name] = _convert(f.name, raw)
        except ValueError:
            raise SystemExit(
                f"fishgate: --{f.name.replace('_', '-')} got {raw!r}, which is not a valid {f.type}"
            ) from None
        if f.name == "api_key" and not values[f.name]:  # a key that was meant to be set must not mean "open"
            raise SystemExit(f"fishgate: --api-key / {ENV_PREFIX}API_KEY is set but holds no key; unset it to run open")
    settings = Settings(**values)  # type: ignore[arg-type]
    if settings.max_sessions < 1:
        raise SystemExit("fishgate: --max-sessions must be at least 1")
    for f in fields(Settings):  # "on | off: …" flags take one of the words their help starts with
        choices = _choices(f.metadata["help"])
        if choices and getattr(settings, f.name) not in choices:
            flag = f.name.replace("_", "-")
            raise SystemExit(f"fishgate: --{flag} must be {', '.join(choices[:-1])} or {choices[-1]}")
    if settings.max_queued_chars < settings.max_text_chars:
        raise SystemExit("fishgate: --max-queued-chars must be at least --max-text-chars (one request's text)")
    if settings.max_connections is not None and settings.max_connections < 1:
        raise SystemExit("fishgate: --max-connections must be at least 1 (leave it out for the default)")
    if settings.idle_timeout_s <= 0 or settings.max_session_s < 0:
        raise SystemExit("fishgate: --idle-timeout-s must be above 0 and --max-session-s at least 0 (0: no cap)")
    if settings.admission_turn_fraction is not None and not 0 < settings.admission_turn_fraction <= 2:
        raise SystemExit("fishgate: --admission-turn-fraction must be in (0, 2] (e.g. 0.9) or off")
    if settings.admission_capacity_fraction is not None and not 0 < settings.admission_capacity_fraction <= 2:
        raise SystemExit("fishgate: --admission-capacity-fraction must be in (0, 2] (e.g. 0.67) or off")
    if settings.vocoder_merge_padding < 0:
        raise SystemExit("fishgate: --vocoder-merge-padding must be at least 0 (0: off)")
    if settings.admission_per_turn is not None and settings.admission_per_turn < 1:
        raise SystemExit("fishgate: --admission-per-turn must be at least 1 (leave it out for no cap)")
    if settings.prefill_step_share is not None and not 0 < settings.prefill_step_share <= 16:
        raise SystemExit("fishgate: --prefill-step-share must be in (0, 16] (e.g. 1) or off")
    if settings.prefill_hold_below_s is not None and not 0 < settings.prefill_hold_below_s <= 5:
        raise SystemExit("fishgate: --prefill-hold-below-s must be in (0, 5] seconds (e.g. 0.1) or off")
    if settings.pace_lead_s is not None and not 0.5 < settings.pace_lead_s <= 60:
        raise SystemExit("fishgate: --pace-lead-s must be in (0.5, 60] seconds (e.g. 1.5) or off")
    if not 0 <= settings.prefill_hold_max_s <= 5:
        raise SystemExit("fishgate: --prefill-hold-max-s must be in [0, 5] seconds")
    if not 0 <= settings.admission_wait_s <= 60:
        raise SystemExit("fishgate: --admission-wait-s must be in [0, 60] seconds")
    if settings.compile_symbolic_batch_above < 1:
        raise SystemExit("fishgate: --compile-symbolic-batch-above must be at least 1 (dynamo specialises one row)")
    if settings.compile_max_batch is not None and settings.compile_max_batch < 0:
        raise SystemExit("fishgate: --compile-max-batch must be 0 (off) or a number of rows")
    if settings.prefill_max_rows not in (1, 2, 4, 8, 16):
        raise SystemExit("fishgate: --prefill-max-rows must be 1, 2, 4, 8 or 16")
    if settings.prefill_graphs_up_front not in (0, 1, 2, 4, 8, 16):
        raise SystemExit("fishgate: --prefill-graphs-up-front must be 0 (none) or a row bucket: 1, 2, 4, 8 or 16")
    if settings.graphs_up_front is not None and settings.graphs_up_front < 1:
        raise SystemExit("fishgate: --graphs-up-front must be at least 1 (leave it out to capture every graph)")
    return settings


def _choices(help_text: str) -> tuple[str, ...] | None:
    """The words of a choice flag's help prefix ("auto | on | off: …" → ("auto", "on", "off")), else None."""
    match = re.match(r"([a-z]+(?: \| [a-z]+)+): ", help_text)
    return tuple(match.group(1).split(" | ")) if match else None


def parse_settings(argv: Sequence[str], environ: dict[str, str] | None = None) -> Settings:
    return settings_from(build_parser(argparse.ArgumentParser()).parse_args(argv), environ)

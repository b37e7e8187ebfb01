"""The engine's settings: what the backend loads and how (BackendConfig), and the worker's scheduling limits
(WorkerLimits). Pure Python (no torch): the scheduler, streaming.profiles, the server's settings and the CLI read
their defaults here, so that every default has one source. The defaults are the latency profile
(streaming.profiles). Figures cited: full-size Fish 1.5, random weights, bf16; today's in docs/BENCHMARKS.md, the
A/B measurements behind each default in docs/DECISIONS.md and docs/archive/benchmark-log.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# Batch buckets whose decode step is compiled by default on a GPU (the latency-bound ones; each bucket costs a few
# seconds of compile per attention length at start-up on an H200)
COMPILE_MAX_BATCH_AUTO = 8
# Pacing (WorkerLimits.pace_lead_s) applies while a stream needs audio soon: its prompt is queued or being written,
# or it decodes with less than this much audio ahead of its client (0 before its first chunk).
PACE_NEEDY_S = 0.5
# Text one session may have waiting to be spoken (sent faster than it is spoken), in characters
MAX_QUEUED_CHARS = 50_000
# How long a session the real-time admission defers waits for room before it is refused (0: refused at once)
ADMISSION_WAIT_S = 2.0


@dataclass(frozen=True, slots=True)
class BackendConfig:
    checkpoint: Path | None = None  # None = the embedded default model
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    max_sessions: int = 8
    max_seq_len: int | None = None  # lower the context to save memory (default: the model's)
    batch_invariant: bool | None = None  # None = on for CPU (bitwise reproducible under load), off on GPU
    cuda_graphs: bool = True
    # decode and first-frame graphs captured before the engine reports ready: all (None), or only batch buckets ≤
    # this; the rest are captured by the worker when it is idle (one graph at a time), or on first use. H200 with a
    # warm compile cache: the buckets above one row took ~24 s of a 29.7 s capture phase
    graphs_up_front: int | None = None
    # first frames of segments sampled through static buffers padded to a batch bucket (padding rows use the swap
    # spare row), on a GPU one CUDA graph per bucket; bitwise the plain path's frames (tests/streaming/test_engine.py,
    # tests/model/test_gpu.py). H200, 128 steady streams: p95 first audio 830 → 300 ms. False (the plain eager path)
    # is kept for those equivalence tests
    graph_first_frames: bool = True
    # prefill chunks run through one CUDA graph per (rows, chunk, attention length) bucket, captured on first use
    # or in idle time (padding rows use the swap spare row); prompts that fit no bucket run eagerly. None = on for a
    # GPU with CUDA graphs unless batch-invariant, off on CPU (there the padded passes only cost). H200, on and off in
    # one hold: level-1 first audio p50 35 against 45-88 ms, a first burst of 64 2.6 against 4.6 s
    graph_prefill: bool | None = None
    # prefill graphs of up to this many prompts per pass captured before ready (0: none; every other one in idle
    # time or on first use). The one-row buckets are 3 chunks x 4 context lengths, 1.4-3.1 s of an H200 start-up;
    # without them 2 of the first 8 requests after ready met a capture in their turn (255 and 370 ms), with them none
    prefill_graphs_up_front: int = 1
    # torch.compile the decode step's regions (model.compiled_regions) for batch buckets up to this size; 0 = off,
    # None = auto: COMPILE_MAX_BATCH_AUTO on a GPU with CUDA graphs, off on CPU (no graph hides the compiled calls'
    # guard checks there: the default voice's step went 26 → 38 ms on 2 cores). H200, full-size model: batch-1 step
    # 6.5 → 3.8 ms, first audio p50 36 → 25 ms; start-up 22 s → ~100 s on an empty compile cache, ~40 s on a warm
    # one. Inductor's caches live in compile_cache_dir (None: TORCHINDUCTOR_CACHE_DIR, else torch's default under
    # /tmp), so a restart skips code generation; Triton's cache too, unless TRITON_CACHE_DIR is exported
    # (backend.use_compile_cache).
    compile_max_batch: int | None = None
    # the one-row bucket's compiled regions with inductor's coordinate-descent tuning (model.compiled_regions
    # TUNED_OPTIONS). Before the GEMV kernels carried the one-row step it took the H200's batch-1 step 3.28 → 2.64 ms;
    # with them, 1.451 ms untuned against 1.485 ms tuned (H200, bench/step.py, 2026-12-07; the script from an empty
    # cache 15 s against 52 s), and warm engine starts re-ran 90-117 tuning benchmarks that its cache should have
    # answered (first-frame capture 10-19 s against 3 s without). Off: the one-row graphs compile like the others
    tune_single_row: bool = False
    # capture every compiled bucket uncompiled first (plain PyTorch in the graph, no dynamo: start-up waits for no
    # compilation), then replace each by its compiled capture one at a time in idle time after ready
    # (DecodeStepper defer_compile; counted in graphs_missing until done). H200, warm caches: ready in 10 s instead
    # of 31-37 s; the upgrades took 33-37 s of idle time, and a request arriving during one waited 3.7 s.
    compile_after_ready: bool = False
    # the slow stack's decode attention through model.decode_attention's length-aware kernel (CUDA and Triton only;
    # not batch-invariant engines); the step then has one attention length (the cache's), so a quarter of the decode
    # graphs, while prefill keeps GPU_LENGTH_BUCKETS. None = on for CUDA-graph engines where the kernel runs, unless
    # batch-invariant. H200: step at 384 rows 12.1 → 9.3 ms, 256 rows 9.0 → 7.3 ms
    length_attention: bool | None = None
    # the one-row decode step's products (with the norms, RoPE, KV-cache writes, SwiGLU and residual adds fused in)
    # and the codebook head by model.gemv's Triton kernels instead of inductor's reductions (compiled one-row regions
    # on CUDA only; not batch-invariant engines). None = on where the kernels run and pass their self-check. H200:
    # batch-1 step 2.155 → 1.722 ms in the same call, 1.574 ms with the cache writes fused
    gemv_kernels: bool | None = None
    # launch configs for them from bench/gemv_sweep.py's JSON (gemv.load_configs), over the built-in H200 ones
    gemv_configs: Path | None = None
    # model.gemv's and model.decode_attention's kernels by programmatic dependent launch where the GPU has it (compute
    # capability 9.0+; model.launch_overlap): their weight reads overlap the kernel before. H200: batch-1 step
    # 1.641 → 1.446 ms in the same call, bitwise the same results. False: plain launches
    programmatic_launch: bool = True
    # vocoder graph batch buckets at 1.5× each power of two too (1, 2, 3, 4, 6, 8, 12, …, 64: 12 buckets instead of
    # 7, so 72 graphs instead of 42, the extra ones captured in idle time): a call pads fewer rows. A timed CPU
    # stand-in for the H200 at 256 steady streams: padding 17.6 → 7.2 % of vocoded frames, vocoder time per turn
    # -8 %. On in the throughput profile, the configuration of every end-to-end 300-stream GPU measurement; never
    # measured against off on a GPU
    vocoder_half_step_buckets: bool = False
    # the vocoder decodes on its own CUDA stream beside the next turn's prefill and decode step, instead of after
    # the step on the same stream (the worker queues the chunks its previous step completed, then prefills and steps
    # while they decode, and collects the audio before it waits for the step). H200, warm servers at 300 streams: a
    # turn 22.5-23.4 → 17.8-19.0 ms, p95 first audio 189-250 ms against 215-283 ms serial; at 384 streams ≤ 0.3 % of
    # requests underran (serial: 0.5-8.2 %). None = auto: on for a CUDA-graph engine; on a CPU (no second stream) it
    # would only move the vocoder's place in the turn (the equivalence tests run it there)
    vocoder_overlap: bool | None = None
    compile_cache_dir: Path | None = None
    # torch intra-op threads on CPU. 1 is fastest for these small ops on small machines (measured: 2 threads made
    # small convs up to 20x slower on a loaded 2-core VM, spinning against the server's other threads)
    cpu_threads: int | None = 1


@dataclass(frozen=True, slots=True)
class WorkerLimits:
    # a prompt is written in chunks of this many tokens, one chunk per turn; 256 is also the largest chunk of the
    # graph-captured prefill (BackendConfig.graph_prefill): larger chunks would run eagerly
    prefill_chunk_tokens: int = 256
    # tokens written per turn, over all prompts (one batched call); None: one chunk where the backend prefills row
    # by row (batch-invariant, CPU), four where it runs prompts as one batch
    prefill_tokens_per_turn: int | None = None
    max_undelivered_s: float = 20.0  # unread audio per session before its stream stalls
    stall_timeout_s: float = 30.0  # a stalled stream is closed after this long
    idle_wait_s: float = 0.05  # how long an idle worker blocks on the command queue
    # a graph still missing is captured in idle time only once the worker has had no work for this long: a capture
    # blocks the worker for tens of ms, and a request that arrives during one waits for it. H200 with graph prefill:
    # captures at every gap between back-to-back requests cost each one 40-70 ms of first audio
    idle_capture_after_s: float = 0.5
    # A stream whose client buffer (audio sent minus real time since its first chunk) fell below this gets the frames
    # it has queued (at least MIN_REFILL_FRAMES) at once, in a smaller chunk, instead of waiting for its scheduled
    # size: under load the schedule's growing chunks otherwise arrive after the client ran dry. None = off. Unseeded
    # streams only (chunk boundaries move the last bits of the audio; a seeded stream must not depend on timing).
    refill_below_s: float | None = 0.15
    # Refills per turn, driest streams first: an overloaded engine would otherwise cut every stream's audio into
    # tiny chunks (per-chunk host and vocoder-call costs) while still not keeping up.
    max_refills_per_turn: int = 8
    # While a decoding stream's client buffer is under this, new prompts wait (at most prefill_hold_max_s at a time):
    # running streams keep real time through a burst of arrivals, at the cost of later first audio. None = off.
    prefill_hold_below_s: float | None = 0.1
    prefill_hold_max_s: float = 0.25
    # Pacing: while some stream needs audio soon (PACE_NEEDY_S), decoding streams whose clients have more than this
    # many seconds of audio ahead sit out the turn (their rows compute and discard, as back-pressured ones do). Each
    # frame costs vocoder and host time in the turn it is made; frames for audio seconds ahead of playback lengthen
    # the turns that newcomers' first audio waits on. With nobody needy (a lone batch request) nothing is paced.
    # Codes, chunk boundaries and audio are unchanged: only when frames are made. None = off.
    pace_lead_s: float | None = 1.5
    # "all": any decoding stream under prefill_hold_below_s holds new prompts; "low": only streams of sessions that
    # asked for latency low (their 2-frame first chunk leaves the least audio queued). H200 without holds: 300
    # normal-latency streams' p95 first audio 148-187 ms (176-259 ms with them), low-latency streams underran. With
    # pacing, 300 streams: p95 123 ms with "low" against 165 ms with "all" on one machine, 152 ms with "low" on a
    # slower one, no underruns; near capacity (384) "low" underran 2.7 % and 14.5 % (0 % with "all").
    prefill_hold_for: str = "low"
    # Hold a growth step of the chunk schedule (keep sending the previous size) while the client's buffer would not
    # last until the larger chunk is decoded at the current turn time (Worker._held_growth). Unseeded streams only.
    grow_chunks_with_buffer: bool = True
    # Segments whose leftover frames (the tail after the last full chunk) are vocoded per turn, driest clients first;
    # the rest wait a turn (their stream starts its next segment after that). H200: turns where dozens of
    # segments ended spent 20–133 ms vocoding their tails, stalling every stream. None = all in the turn they end.
    max_tails_per_turn: int | None = 16
    # refuse new sessions while decoding turns average more than this share of a frame's duration, i.e. while the
    # streams already running fall behind real time (streaming.realtime_admission). None = off.
    admission_turn_fraction: float | None = None
    # with the admission on: the share of a frame the capacity estimate fits the streams with work into, when it
    # should be tighter than admission_turn_fraction (2/3: what streams whose chunks still grow need). None = the same.
    admission_capacity_fraction: float | None = None

    def __post_init__(self) -> None:
        if self.max_tails_per_turn is not None and self.max_tails_per_turn < 1:
            raise ValueError("max_tails_per_turn must be at least 1 (None: no limit)")
        if self.pace_lead_s is not None and self.pace_lead_s <= PACE_NEEDY_S:
            raise ValueError(f"pace_lead_s must be above {PACE_NEEDY_S} s, the lead under which a stream is needy")

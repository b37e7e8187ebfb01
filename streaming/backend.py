"""The engine's only door into `model/`: loads a checkpoint folder and exposes the few operations the worker needs.

Owns device/dtype choice, the DualAR stepper (KV rows, graph-captured decode), the streaming vocoder (one state
slot per session), prompt tokens, reference encoding and warm-up. Everything here runs on the worker thread.
Knows nothing about sessions, queues or asyncio; callers speak in rows, slots, token tensors and numpy arrays.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from importlib import resources
from pathlib import Path

import numpy as np
import torch

from model import compiled_regions, decode_attention, gemv, launch_overlap, saved_regions
from model.audio_prep import to_codec_audio
from model.checkpoint import load_dual_ar
from model.codec_checkpoint import load_codec
from model.host_staging import PinnedStaging
from model.prompt import PromptBuilder, history_is_append
from model.stepper import DecodeStepper, RowSampling, half_step_buckets, power_of_two_buckets
from model.text_normalize import UNREADABLE, get_normalizer
from model.vocoder import FireflyCodec
from model.vocoder_graphs import GraphedVocoder
from model.vocoder_stream import StreamingDecoder

from .chunking import all_chunk_sizes, call_groups
from .config import COMPILE_MAX_BATCH_AUTO, BackendConfig
from .device_times import DeviceTimes
from .engine_api import ModelInfo
from .gc_pauses import freeze_new_objects, freeze_startup_objects
from .sampling_defaults import SamplingDefaults
from .text_support import check_readable

log = logging.getLogger(__name__)

# Re-exported for the rest of streaming/, so that this module stays its only door into model/.
__all__ = ["Backend", "ModelInfo", "RowSampling", "default_checkpoint", "history_is_append"]

# Optional metadata file in a checkpoint folder (fishgate's own; official folders don't have it).
METADATA_FILE = "fishgate.json"
# Pinned host memory the worker's small host→device copies go through between two synchronisations (vocoder codes
# and slots, row permutations; a turn at 512 rows stages ~0.4 MB at most): model.host_staging
STAGING_BYTES = 4 << 20
# upstream's inference engine passes max_length=4096 to generate_long (history window size)
HISTORY_MAX_LENGTH = 4096
# Attention-length buckets on GPU (positions); the full cache length is always added.
GPU_LENGTH_BUCKETS = (512, 1024, 2048, 4096)
# Largest vocoder batch per call: throughput saturates by 64 x 24 frames (ANCHORS: 1,033x at 64 vs 1,070x at 256)
# while activation memory keeps growing (a 512-row graph ran an H200 out of memory).
VOCODER_MAX_BATCH = 64
# KV rows that hold voice prefixes (system + references) shared by sessions using the same voice.
PREFIX_ROWS = 8
# Voices whose prompt-prefix tokens the worker keeps built (Backend.prefix_tokens): ~50 KB each for a 650-frame voice.
PREFIX_TOKENS_CACHE = 64
# Row-positions of KV one batched prefill pass may gather into scratch (rows × longest end): 16,384 is 1.6 GB for the
# full-size model in bf16; larger batches are split into several passes.
PREFILL_SCRATCH_POSITIONS = 16_384
# Prompts per graph-captured prefill pass (row buckets 1, 2, 4). H200: a pass of 8 prompts of 64 tokens 4.66 ms
# against 3.86 ms for 4 (0.58 against 0.96 ms a prompt), but end to end at 300 streams 8 rows gave p95 first audio
# 251 ms against 198-238 ms with 4 (one server each; 2026-12-02, docs/archive/benchmark-log.md): no gain end to end.
PREFILL_MAX_ROWS = 4
# Compiled decode and first-frame buckets above one row share one compilation per attention length with a symbolic
# batch size instead of one per (bucket, length) (one row stays static: dynamo specialises size 1, and the GEMV
# kernels serve it). H200, full-size model (bench/step.py, 2026-12-07): the step at 2, 3, 4, 6 and 8 rows took 2.92,
# 2.93, 2.93, 2.97 and 2.89 ms symbolic against 2.88, 3.05, 3.06, 3.54 and 3.42 ms static, for one cold compile of
# 25 s against 44 s for the static ones. Inductor picks a symbolic compilation's kernels at the first bucket it runs,
# so an engine compiling buckets past SYMBOLIC_SMALL_BATCHES rows (the throughput profile, up to 512) keeps those
# small buckets static and its symbolic compilation starting above them, as its 300-stream figures were measured
# (there, 28 static compiles of ~16 s each on a cold H200 became 4, and the step at 384 rows went 19.6 → 13.3-13.6 ms
# against the uncompiled one).
SYMBOLIC_SMALL_BATCHES = 8
# model.saved_regions' files, in inductor's cache folder (--compile-cache-dir): deleted with it
SAVED_REGIONS_FOLDER = "fishgate-regions"


def symbolic_batch_above(compile_max_batch: int) -> int:
    """Compiled buckets above this many rows share a symbolic-batch compilation (see SYMBOLIC_SMALL_BATCHES)."""
    return 1 if compile_max_batch <= SYMBOLIC_SMALL_BATCHES else SYMBOLIC_SMALL_BATCHES


def default_checkpoint() -> Path:
    """The embedded default model shipped inside the package (model/default_model)."""
    return Path(str(resources.files("model") / "default_model"))


class Backend:
    def __init__(self, config: BackendConfig) -> None:
        self.config = config
        folder = config.checkpoint or default_checkpoint()
        self.device = _pick_device(config.device)
        compiles = self.device.type == "cuda" or (config.compile_max_batch or 0) > 0  # Triton kernels or inductor
        if config.compile_cache_dir is not None and compiles:
            use_compile_cache(config.compile_cache_dir)  # before the first Triton kernel compiles (the self-checks)
        # before the kernels' self-checks, which then launch as the step will (process-wide, as gemv.MODE)
        launch_overlap.MODE = "auto" if config.programmatic_launch else "off"
        self.programmatic_launch = launch_overlap.enabled(self.device)
        if self.device.type == "cuda":
            why_off = "off (--programmatic-launch off, a GPU before Hopper, or a Triton before 3.3)"
            log.info("programmatic dependent launch for the step's Triton kernels: %s",
                     "on" if self.programmatic_launch else why_off)  # fmt: skip
        if self.device.type == "cpu" and config.cpu_threads is not None:
            torch.set_num_threads(config.cpu_threads)  # process-wide: the engine is the process's torch user
        dtype = torch.float32 if self.device.type == "cpu" else torch.bfloat16
        self.timings_s: dict[str, float] = {}
        # vocoder calls made and the frames they ran, padding rows of graph buckets included (worker thread only;
        # against the frames the worker asked for, the share of vocoder work spent on padding)
        self.vocode_calls = 0
        self.graphs_missing = 0  # see count_missing_graphs; set by the worker after warm-up and each idle capture
        self.vocode_frames_run = 0
        # the GPU's time on the turn's prefill, step and vocoder work (CUDA events; the vocoder's beside the step when
        # it runs there), and what the vocoder's graphs took alone when timed at capture: the vocoder's two differ
        # by the cost of sharing the GPU
        self.device_times = DeviceTimes(self.device.type == "cuda")
        self.vocode_graph_ms = 0.0
        self._staging = PinnedStaging(STAGING_BYTES, self.device) if self.device.type == "cuda" else None
        # the vocoder's codes and slots have their own staging buffer: its copies are read on the vocoder's stream
        self._vocoder_staging = PinnedStaging(STAGING_BYTES, self.device) if self.device.type == "cuda" else None

        t0 = time.perf_counter()
        load_s: dict[str, float] = {}
        loaded = load_dual_ar(folder, device=self.device, dtype=dtype, max_seq_len=config.max_seq_len, timings_s=load_s)
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        t_fuse = time.perf_counter()
        self.model.fuse_feed_forward()  # one GEMV for w1 and w3 (same dot products; layers.FeedForward)
        load_s["fuse"] = time.perf_counter() - t_fuse
        # the DualAR's load by part (H200, 1.3 GB from a warm page cache: read 0.2-0.4 s, to the device
        # 0.2-0.3 s, fuse 0.01-0.02 s; the rest of the 4.8-10.9 s is the attention kernel's self-check below)
        for part, seconds in load_s.items():
            self.timings_s[f"load_weights_dual_ar_{part}"] = seconds
        invariant = self.device.type == "cpu" if config.batch_invariant is None else config.batch_invariant
        self.model.set_batch_invariant(invariant)
        self.batch_invariant = invariant
        kernel_runs = not invariant and self.device.type == "cuda" and decode_attention.supported(self.device)
        if config.length_attention and not kernel_runs:
            raise ValueError(
                "--length-attention on needs a CUDA GPU with Triton and no batch-invariant mode; use auto or off"
            )
        auto = config.length_attention is None and config.cuda_graphs
        self.length_attention = kernel_runs and bool(config.length_attention or auto)
        if self.length_attention:  # on a GPU it was never run on, the kernel proves itself before it is used
            t_check = time.perf_counter()
            c = self.model.config
            shapes = {
                (c.head_dim, c.n_head // c.n_local_heads),
                (c.fast_head_dim, c.fast_n_head // c.fast_n_local_heads),
            }
            problems = (decode_attention.self_check(self.device, dtype, d, g) for d, g in sorted(shapes))  # both stacks
            problem = next((p for p in problems if p is not None), None)
            if problem is not None and not auto:
                raise ValueError(f"--length-attention on: the kernel's self-check failed ({problem}); use auto or off")
            if problem is not None:  # the default must never be what stops a start
                log.warning("the length-aware decode attention is off on this GPU (its self-check: %s)", problem)
                self.length_attention = False
            self.timings_s["load_weights_kernel_check"] = time.perf_counter() - t_check
        self.model.use_length_attention(self.length_attention)
        t1 = time.perf_counter()
        # the codec decodes in fp32 on CPU and bf16 on GPU; the encoder (references) always runs fp32
        self.codec = load_codec(folder, device=self.device, dtype=dtype, with_encoder=False)
        self._encoder_folder = folder
        self._encoder: FireflyCodec | None = None  # loaded on first use (reference uploads)
        self._encoder_lock = threading.Lock()
        self._encoder_stream: torch.cuda.Stream | None = None
        self.timings_s["load_weights"] = time.perf_counter() - t0
        # its parts: the DualAR with the attention kernel's self-check, the codec (H200: DualAR 4.8-10.9 s, of it
        # the check 4.4-10.1 s — then its first call of the custom op imported torch._dynamo and torch._inductor;
        # eager calls skip the op since, so a compiling server pays that import at its first capture instead, and
        # one that compiles nothing never; codec 0.2-0.3 s)
        self.timings_s["load_weights_dual_ar"] = t1 - t0
        self.timings_s["load_weights_codec"] = self.timings_s["load_weights"] - (t1 - t0)

        meta = _read_metadata(folder)
        c = self.model.config
        # rows: [0, max_sessions) sessions, then one scratch row for swaps, then the voice-prefix rows
        self.session_rows = config.max_sessions + 1
        self.prefix_rows = list(range(self.session_rows, self.session_rows + PREFIX_ROWS))
        graphs = self.device.type == "cuda" and config.cuda_graphs
        self.compile_max_batch = (
            (COMPILE_MAX_BATCH_AUTO if graphs else 0) if config.compile_max_batch is None else config.compile_max_batch
        )
        self._choose_gemv_kernels(config, invariant, dtype)
        if self.compile_max_batch > 0:
            from torch._inductor.runtime.cache_dir_utils import cache_dir

            # each compiled variant saved whole beside inductor's cache: later starts load it without tracing
            saved_regions.save_in(Path(cache_dir()) / SAVED_REGIONS_FOLDER)
            log.info(
                "the decode step of batches up to %d is compiled with torch.compile before its graphs are captured "
                "(about 3 minutes on a first start with an empty cache in %s, much less from a warm one; "
                "--compile-max-batch 0 skips it)",
                self.compile_max_batch, cache_dir(),
            )  # fmt: skip
        self.graph_prefill = (
            self.device.type == "cuda" and config.cuda_graphs and not invariant
            if config.graph_prefill is None
            else config.graph_prefill
        )
        self.stepper = DecodeStepper(
            self.model,
            self.session_rows + PREFIX_ROWS,
            max_batch=self.session_rows,
            max_seq_len=config.max_seq_len,
            use_cuda_graphs=config.cuda_graphs,
            # a decode step through the length-aware kernel reads each row's keys up to its own position whatever the
            # bucket, so one length (the cache's) serves every position: 4x fewer decode graphs to capture at start-up
            length_buckets=None if invariant or self.length_attention else list(GPU_LENGTH_BUCKETS),
            prefill_length_buckets=None if invariant else list(GPU_LENGTH_BUCKETS),
            fixed_batch=invariant,
            first_frame_scratch_row=self.session_rows - 1 if config.graph_first_frames else None,
            prefill_scratch_row=self.session_rows - 1 if self.graph_prefill else None,
            prefill_row_buckets=power_of_two_buckets(PREFILL_MAX_ROWS),
            compile_backend="inductor" if self.compile_max_batch > 0 else None,
            compile_max_batch=self.compile_max_batch or None,
            tune_single_row=config.tune_single_row,
            defer_compile=config.compile_after_ready,
            symbolic_batch_above=symbolic_batch_above(self.compile_max_batch),
        )
        # on GPU: twice the slots, the upper half being scratch for the padding rows of graph-captured batches
        self.vocoder_batch = min(VOCODER_MAX_BATCH, config.max_sessions)
        bucket_rule = half_step_buckets if config.vocoder_half_step_buckets else power_of_two_buckets
        self.vocoder_buckets = bucket_rule(self.vocoder_batch)  # the graphs' batch sizes (GPU)
        # On a GPU the vocoder keeps activations, state and conv weights channels-last (time-major), cuDNN's
        # tensor-core layout: H200, bf16 graphs, one row of 8 frames 2.21 → 1.35 ms, 64 × 24 frames 50.2 → 29.5 ms
        # against channels-first (2026-12-02; docs/archive/benchmark-log.md). The CPU keeps channels-first.
        self.vocoder = StreamingDecoder(
            self.codec,
            max_slots=config.max_sessions + (self.vocoder_batch if graphs else 0),
            channels_last=self.device.type == "cuda",
        )
        self.overlap_vocoder = graphs if config.vocoder_overlap is None else config.vocoder_overlap
        self.vocoder_stream = (
            torch.cuda.Stream(self.device) if self.overlap_vocoder and self.device.type == "cuda" else None
        )
        self._vocoder_in_flight = 0  # launched vocoder calls whose audio is not collected yet (vocode_launch)
        self.vocoder_graphs = None
        if graphs:
            self.vocoder_graphs = GraphedVocoder(
                self.vocoder, config.max_sessions, self.vocoder_buckets, reroute=not self.batch_invariant
            )
        self.builder = PromptBuilder(self.tokenizer, c.num_codebooks)
        self._prefix_tokens: collections.OrderedDict[bytes, torch.Tensor] = collections.OrderedDict()
        self._normalize = get_normalizer(meta.get("text_normalizer"))
        self._unreadable = UNREADABLE.get(meta.get("text_normalizer") or "")  # None: reads every script
        self.im_end_id = self.tokenizer.im_end_id
        self.max_seq_len = self.stepper.max_seq_len
        self.history_max_length = min(HISTORY_MAX_LENGTH, self.max_seq_len)
        self.info = ModelInfo(
            name=str(meta.get("name") or folder.name),
            untrained=bool(meta.get("untrained", False)),
            max_frames_per_char=meta.get("max_frames_per_char"),
            sample_rate_hz=self.codec.config.spec_transform.sample_rate,
            samples_per_frame=self.codec.config.samples_per_frame,
            num_codebooks=c.num_codebooks,
            max_seq_len=self.max_seq_len,
            device=str(self.device),
            dtype=str(dtype).removeprefix("torch."),
            sampling=SamplingDefaults.from_metadata(meta.get("sampling"), str(folder / METADATA_FILE)),
        )
        log.info(
            "loaded %s from %s on %s (%s) in %.2f s%s",
            self.info.name, folder, self.device, self.info.dtype, self.timings_s["load_weights"],
            " — UNTRAINED random weights: output is noise" if self.info.untrained else "",
        )  # fmt: skip

    # ---- prompts ---------------------------------------------------------------------------------------------------
    def model_text(self, text: str) -> str:
        """The text as the model was trained to read it (the folder's text_normalizer, if it declares one)."""
        return self._normalize(text) if self._normalize is not None else text

    def prefix_tokens(self, references: Sequence[tuple[str, np.ndarray]]) -> torch.Tensor | None:
        """The prompt prefix (system + references) of a voice: (1+nc, T) int tensor, shared, do not modify.

        Built once per distinct voice (an LRU of PREFIX_TOKENS_CACHE): normalising and tokenising a ~650-frame voice
        took ~4 ms of the worker thread per new session (py-spy, H200 server: ~5 % of the worker at 256 streams)."""
        if not references:
            return None
        digest = hashlib.sha256()
        for text, codes in references:
            flat = np.ascontiguousarray(codes)
            digest.update(f"{len(text)}:{text}|{flat.dtype.str}{flat.shape}|".encode())
            digest.update(flat.tobytes())
        key = digest.digest()
        hit = self._prefix_tokens.get(key)
        if hit is not None:
            self._prefix_tokens.move_to_end(key)
            return hit
        refs = [(self.model_text(text), torch.from_numpy(codes)) for text, codes in references]
        prefix = self.builder.prefix(refs)  # raises ValueError for codes this model cannot read: not cached
        assert prefix is not None  # references are not empty
        self._prefix_tokens[key] = prefix
        if len(self._prefix_tokens) > PREFIX_TOKENS_CACHE:
            self._prefix_tokens.popitem(last=False)
        return prefix

    def segment_tokens(self, model_text: str) -> torch.Tensor:
        """Prompt tokens of one segment; `model_text` is already `model_text(text)`."""
        return self.builder.target(model_text)

    def check_text(self, text: str) -> None:
        """UnsupportedLanguage if the model cannot read `text` (streaming.text_support); read-only, any thread."""
        check_readable(text, self._unreadable)

    def prepare_segment(self, text: str) -> tuple[str, torch.Tensor]:
        """A segment's model text and prompt tokens (UnsupportedLanguage for text the model cannot read). Read-only use
        of the normaliser and tokeniser: safe from any thread (the engine prepares segments on the caller's,
        Engine._prepare)."""
        self.check_text(text)
        model_text = self.model_text(text)
        return model_text, self.segment_tokens(model_text)

    # ---- decoding ----------------------------------------------------------------------------------------------------
    def set_sampling(self, row: int, sampling: RowSampling) -> None:
        self.stepper.set_sampling(row, sampling)

    def set_noise_step(self, row: int, step: int) -> None:
        self.stepper.set_noise_step(row, step)

    def set_row_position(self, row: int, position: int) -> None:
        self.stepper.set_position(row, position)

    def prefill_many(
        self, rows: Sequence[int], prompts: Sequence[torch.Tensor], start_positions: Sequence[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Several rows' prompt chunks in one call: (B, vocab) logits and (B, fast_dim) hidden of their last tokens.

        Batch-invariant engines prefill row by row (a batched pass attends over the batch's longest length, which
        changes summation order); the others run one right-padded batch: one pass instead of B. With graph_prefill
        the stepper runs either through its bucketed static passes (model.prefill_graphs) where the prompts fit."""
        with self.device_times.span("prefill"):
            return self._prefill_many(rows, prompts, start_positions)

    def _choose_gemv_kernels(self, config: BackendConfig, invariant: bool, dtype: torch.dtype) -> None:
        """model.gemv's kernels for the compiled one-row step (gemv.MODE, process-wide: one engine a process), where
        they run: on by default for a compiling CUDA engine (not batch-invariant) whose GPU passes their self-check
        at the model's product shapes; `on` refuses to start elsewhere or when the check fails."""
        runs = not invariant and self.device.type == "cuda" and gemv.AVAILABLE
        if config.gemv_kernels and not runs:
            raise ValueError(
                "--gemv-kernels on needs a CUDA GPU with Triton and no batch-invariant mode; use auto or off"
            )
        auto = config.gemv_kernels is None and self.compile_max_batch > 0
        self.gemv_kernels = runs and bool(config.gemv_kernels or auto)
        if config.gemv_configs is not None:  # read even where the kernels are off: a bad file is named at start-up
            try:
                count = gemv.load_configs(str(config.gemv_configs))
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise ValueError(
                    f"--gemv-configs {config.gemv_configs}: not a bench.gemv_sweep result ({type(e).__name__}: {e}); "
                    "write one with `python -m bench.gemv_sweep --out FILE` or leave the flag out"
                ) from e
            log.info("%d GEMV launch configs from %s", count, config.gemv_configs)
        if self.gemv_kernels:
            t_check = time.perf_counter()
            problem = gemv.self_check(self.device, dtype, self.model.one_row_products())
            if problem is not None and config.gemv_kernels:
                raise ValueError(f"--gemv-kernels on: the kernels' self-check failed ({problem}); use auto or off")
            if problem is not None:  # the default must never be what stops a start
                log.warning("the one-row GEMV kernels are off on this GPU (their self-check: %s)", problem)
                self.gemv_kernels = False
            self.timings_s["gemv_kernel_check"] = time.perf_counter() - t_check
        gemv.MODE = "auto" if self.gemv_kernels else "off"

    def _prefill_many(
        self, rows: Sequence[int], prompts: Sequence[torch.Tensor], start_positions: Sequence[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if len(rows) == 1 or self.batch_invariant:
            outs = [self.stepper.prefill(r, p, s) for r, p, s in zip(rows, prompts, start_positions, strict=True)]
            return torch.stack([o[0] for o in outs]), torch.stack([o[1] for o in outs])
        # a pass gathers its rows' KV up to its longest end into scratch: keep that under PREFILL_SCRATCH_POSITIONS
        groups: list[list[int]] = [[]]
        group_end = 0  # the longest end in the last group
        for i, (p, s) in enumerate(zip(prompts, start_positions, strict=True)):
            end = s + p.shape[-1]
            if groups[-1] and (len(groups[-1]) + 1) * (max(group_end, end) + 1) > PREFILL_SCRATCH_POSITIONS:
                groups.append([])
                group_end = 0
            groups[-1].append(i)
            group_end = max(group_end, end)
        outs = [
            self.stepper.prefill_many([rows[i] for i in g], [prompts[i] for i in g], [start_positions[i] for i in g])
            for g in groups
        ]
        return torch.cat([o[0] for o in outs]), torch.cat([o[1] for o in outs])

    def start_segments(
        self, rows: Sequence[int], logits: torch.Tensor, hidden: torch.Tensor, next_positions: Sequence[int]
    ) -> np.ndarray:
        """First frames (B, 1+nc) of several rows in one batched sample (each row's draw is its own). Batch-invariant
        GPU engines sample row by row: the fast stack's kernels, and so its rounding, depend on the batch size."""
        if self.batch_invariant and self.device.type != "cpu" and len(rows) > 1:
            return np.concatenate(
                [self.start_segments([r], logits[i : i + 1], hidden[i : i + 1], [p])
                 for i, (r, p) in enumerate(zip(rows, next_positions, strict=True))]
            )  # fmt: skip
        with self.device_times.span("prefill"):  # the first frames count with the prompts' passes
            frames = self.stepper.start_segments(list(rows), logits, hidden, list(next_positions)).cpu().numpy()
        self.device_times.settle()
        return frames

    def step(
        self, rows: int, commit: Sequence[bool], max_pos: int, while_running: Callable[[], None] | None = None
    ) -> np.ndarray:
        """One decode step over rows [0, rows); `commit[i]` says whether row i advances. Returns (rows, 1+nc).
        `while_running` runs once the step is queued, before the host waits for it (see DecodeStepper.step)."""
        self.stepper.set_commit(list(commit))
        with self.device_times.span("step"):
            frames = self.stepper.step(rows, max_pos, while_running).numpy()
        self._release_staging()  # the step synchronised the stream: every staged copy has been read
        self.device_times.settle()
        return frames

    def swap_rows(self, a: int, b: int, length_a: int, length_b: int) -> None:
        self.stepper.swap_rows(a, b, length_a, length_b, spare=self.session_rows - 1)

    def permute_rows(self, dst: list[int], src: list[int], length: int) -> None:
        rows = [self._to_device(torch.tensor(r, dtype=torch.long), self._staging) for r in (dst, src)]
        self.stepper.permute_rows(rows[0], rows[1], length)

    def copy_prefix(self, src: int, dst: int, length: int) -> None:
        """Copy KV positions [0, length) of row src into row dst (a cached voice prefix)."""
        self.stepper.cache.move_slot(src, dst, length)
        self.stepper.set_position(dst, length)

    # ---- vocoder -----------------------------------------------------------------------------------------------------
    def reset_vocoder(self, slot: int) -> None:
        with self._on_vocoder_stream():  # ordered with the slot's chunks queued there
            self.vocoder.reset(torch.tensor([slot], device=self.device))

    @torch.inference_mode()
    def vocode(self, slots: Sequence[int], codes: Sequence[np.ndarray]) -> list[np.ndarray]:
        """Continue each slot's audio with its codes (nc, F); one batched call per chunk length (per slot when
        batch-invariant). Returns float32 PCM arrays (F·samples_per_frame,). Waits for the audio."""
        launched = self._launch_vocode(slots, codes)
        out = self._audio_out(codes, launched)
        if launched and self._vocoder_in_flight == 0:
            self._release_vocoder_staging()  # the copies out synchronised the stream
        return out

    def vocode_launch(self, slots: Sequence[int], codes: Sequence[np.ndarray]) -> Callable[[], list[np.ndarray]]:
        """`vocode` without waiting: queues the calls and returns what collects their audio. With `vocoder_stream`
        the calls run there, beside whatever the caller queues next on the default stream (the decode step); the
        caller collects every launch before the vocoder's state is touched otherwise (reset, graph capture).
        Without one (CPU; overlap off) the audio is decoded now, through `vocode`."""
        if self.vocoder_stream is None:
            audio = self.vocode(slots, codes)
            return lambda: audio
        stream = self.vocoder_stream
        with torch.inference_mode(), torch.cuda.stream(stream):
            launched = self._launch_vocode(slots, codes)
        self._vocoder_in_flight += 1

        def collect() -> list[np.ndarray]:
            # Copied out into ordinary memory, waiting on the vocoder's stream only. The first version copied into
            # fresh pinned memory without blocking (one event per launch): an H200 server then stalled one turn for
            # 15.7 s at 300 streams (the shared cuBLAS workspace, probably; not isolated; 2026-12-02).
            with torch.cuda.stream(stream):
                out = self._audio_out(codes, launched)
            self._vocoder_in_flight -= 1
            if self._vocoder_in_flight == 0:
                self._release_vocoder_staging()  # every staged copy of every launch has been read
            return out

        return collect

    def _audio_out(self, codes: Sequence[np.ndarray], calls: list[tuple[list[int], torch.Tensor]]) -> list[np.ndarray]:
        """Each chunk's audio, in the order of `codes`, from the launched calls' (chunk indices, audio rows), copied to
        the host (a wait on the current stream)."""
        spf = self.info.samples_per_frame
        out: list[np.ndarray | None] = [None] * len(codes)
        for batch, audio_t in calls:
            audio = audio_t.cpu().numpy()
            for j, i in enumerate(batch):
                out[i] = audio[j, : codes[i].shape[1] * spf]
        self.device_times.settle()
        return [a for a in out if a is not None]

    def _launch_vocode(self, slots: Sequence[int], codes: Sequence[np.ndarray]) -> list[tuple[list[int], torch.Tensor]]:
        """Queue the calls of `vocode` on the current stream: (indices into slots, audio on the device) per call."""
        step = 1 if self.batch_invariant else self.vocoder_batch
        sizes = [c.shape[1] for c in codes]
        # every call is launched before the first result is read, so the device runs them back to back and the
        # turn waits once; each result is copied out at once (a graph's output is overwritten by its next replay)
        launched: list[tuple[list[int], torch.Tensor]] = []
        with self.device_times.span("vocode"):
            for frames, members in call_groups(sizes, 0, step):  # one call per chunk length (and `step` rows)
                for batch in (members[k : k + step] for k in range(0, len(members), step)):
                    stacked = np.stack([codes[i] for i in batch])  # (B, nc, frames)
                    codes_t = self._to_device(torch.from_numpy(stacked), self._vocoder_staging)
                    slots_t = self._to_device(torch.tensor([slots[i] for i in batch]), self._vocoder_staging)
                    if self.vocoder_graphs is not None:  # a graph's output buffer is reused: copy it out
                        audio = self.vocoder_graphs.decode(codes_t, slots_t).to(torch.float32, copy=True)
                        rows_run = self.vocoder_graphs.last_rows_run
                        self.vocode_graph_ms += self.vocoder_graphs.last_replay_ms
                    else:
                        audio = self.vocoder.decode(codes_t, slots_t).to(torch.float32)
                        rows_run = len(batch)
                    launched.append((batch, audio))
                    self.vocode_calls += 1
                    self.vocode_frames_run += rows_run * frames  # graph padding rows included
        return launched

    def _on_vocoder_stream(self) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(self.vocoder_stream) if self.vocoder_stream is not None else contextlib.nullcontext()

    @staticmethod
    def _to_device(t: torch.Tensor, staging: PinnedStaging | None) -> torch.Tensor:
        """A host tensor on the engine's device through `staging` (None: on CPU, `t` itself) without waiting for
        queued work: a blocking host→device copy synchronises the stream first (serialising a turn's vocoder calls)."""
        if staging is None:
            return t
        return staging.to_device(t)

    def _release_staging(self) -> None:
        if self._staging is not None:
            self._staging.release()

    def _release_vocoder_staging(self) -> None:
        if self._vocoder_staging is not None:
            self._vocoder_staging.release()

    # ---- reference voices ------------------------------------------------------------------------------------------
    def encode_reference(self, audio: np.ndarray, sample_rate_hz: int) -> np.ndarray:
        """Reference audio (samples,) or (samples, channels) at any rate → codes (nc, T) int64 (fp32 encoder).

        Runs on the caller's thread, off the decode loop: the encoder is its own fp32 model instance (no tensor is
        shared with the worker), on its own CUDA stream; one encode at a time.
        """
        with self._encoder_lock:
            if self._encoder is None:
                self._encoder = load_codec(
                    self._encoder_folder, device=self.device, dtype=torch.float32, with_encoder=True
                )
                self._encoder_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
            mono = to_codec_audio(audio, sample_rate_hz, self.info.sample_rate_hz)
            stream = self._encoder_stream
            with torch.inference_mode(), torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                codes = self._encoder.encode(torch.from_numpy(mono).unsqueeze(0))[0]
                return codes[: self.info.num_codebooks].cpu().numpy().astype(np.int64)

    # ---- start-up ----------------------------------------------------------------------------------------------------
    def capture_graphs(self) -> int:
        t0 = time.perf_counter()
        # What loading built is frozen before the first capture, and each start-up capture's objects as soon as it is
        # done: otherwise every full collection during start-up walks all captures so far (H200: 13
        # collections growing from 85 to 784 ms, 6.8 s of a cold start and 2.3 s of a warm one).
        freeze_startup_objects()
        n = self.stepper.capture_all(self.config.graphs_up_front, after_each=freeze_new_objects)
        prefill, rows = self.stepper.static_prefill, self.config.prefill_graphs_up_front
        if prefill is not None and rows > 0:
            t1 = time.perf_counter()
            prefill.capture_up_to(rows, after_each=freeze_new_objects)
            self.timings_s["capture_prefill"] = time.perf_counter() - t1
        self.timings_s["capture_graphs"] = time.perf_counter() - t0
        for kind, seconds in self.stepper.capture_seconds.items():  # its parts (model.stepper capture_seconds)
            self.timings_s[f"capture_{kind}"] = seconds
        return n

    def capture_idle_graph(self, row_positions: Sequence[int]) -> bool:
        """Capture one decode graph still missing (the worker calls this when it has nothing else to do), among those
        whose attention length covers every row's position now (`row_positions`: the worker's mirror); once none is,
        one prefill graph still missing (with graph_prefill); then one batched vocoder graph (warm-up captures the
        one-row ones only). Otherwise each of those is captured on first use, in the middle of a turn: a stall of
        every stream for its eager warm-up runs (~0.1–0.3 s at 64 rows on an H200). A vocoder capture writes spare
        slots only (model.vocoder_graphs), so it is safe between turns."""
        try:
            if self.stepper.capture_next(row_positions):
                return True
            if self.vocoder_graphs is not None:
                missing = self.vocoder_graphs.missing(all_chunk_sizes())
                if missing:
                    self.vocoder_graphs.capture(*missing[0])
                    return True
            return False
        finally:
            self.graphs_missing = self.count_missing_graphs()

    def graphs_captured(self) -> int:
        """Decode, first-frame, prefill and vocoder graphs captured so far (a turn that grows this paid a capture)."""
        return self.stepper.graphs_recorded + (self.vocoder_graphs.captures if self.vocoder_graphs is not None else 0)

    def count_missing_graphs(self) -> int:
        """Decode, prefill and vocoder graphs not captured yet (0 on CPU). Worker thread only: others read the
        `graphs_missing` it leaves after each idle capture (the /metrics gauge a benchmark waits on before loading)."""
        n = len(self.stepper.missing_graphs()) + len(self.stepper.missing_first_frame_graphs())
        n += len(self.stepper.pending_upgrades())  # captured uncompiled, compiled later (compile_after_ready)
        if self.stepper.static_prefill is not None:
            n += len(self.stepper.static_prefill.missing_graphs())
        if self.vocoder_graphs is not None:
            n += len(self.vocoder_graphs.missing(all_chunk_sizes()))
        return n

    @staticmethod
    def compile_cache_counts() -> dict[str, int]:
        """How this process's compiles used the on-disk caches (model.compiled_regions.cache_counts)."""
        return compiled_regions.cache_counts()

    def synchronize(self) -> None:
        """Wait until the engine's device has finished all work queued so far (nothing to wait for on CPU)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def gpu_memory_bytes(self) -> int:
        """Bytes the caching allocator holds on the engine's GPU (0 on CPU); safe to read from any thread."""
        return int(torch.cuda.memory_allocated(self.device)) if self.device.type == "cuda" else 0

    @property
    def clamped_codes(self) -> int:
        """Codes the vocoder clamped into range so far (reads a device counter: a sync, call rarely)."""
        return int(self.codec.clamped_codes.item())


def use_compile_cache(folder: Path) -> None:
    """Keep this process's compiled code in `folder`: inductor's caches, the saved regions beside them and, unless
    TRITON_CACHE_DIR is exported, Triton's cache of every kernel (inductor's and model's own, otherwise under
    ~/.triton), so that a deployment keeps one folder across restarts."""
    folder.mkdir(parents=True, exist_ok=True)
    # assigned, not defaulted: inductor writes its default into the environment the first time it asks
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder)
    os.environ.setdefault("TRITON_CACHE_DIR", str(folder / "triton"))


def _pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was requested but no CUDA device is available; use --device cpu")
    return device


def _read_metadata(folder: Path) -> dict:
    path = folder / METADATA_FILE
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return data

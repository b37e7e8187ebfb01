"""Batched, graph-capturable DualAR decoding over many rows: per-row device state and one step function.

Owns the KV caches and every per-row tensor the decode step reads or updates (last frame, position, repetition
window, noise seed and counter, sampling parameters, commit flag) at fixed addresses, so one CUDA graph per batch
bucket (and attention-length bucket) replays over rows [0, B) with no host work but filling the commit flags.
A step advances only rows whose commit flag is set; other rows in the bucket (idle sessions, free rows, stalled
streams) compute and discard. Knows nothing about sessions or text: the engine maps sessions to rows.
Optionally the step's repeated regions are compiled (torch.compile per block, sampler and noise hash, static shapes)
before capture: inductor fuses the thousands of small kernels of a step; the CUDA graph still removes the launches
(see docs/BENCHMARKS.md).
Segment-first frames and (optionally) prefill passes also run through static buffers and graphs in the same pool.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from .compiled_regions import compiled
from .dual_ar import DualARTransformer
from .frame import PENALTY_WINDOW_FRAMES, NoiseFn, SamplingTensors, frame_noise, sample_frame
from .graph_timing import cheapest_plan, replay_ms
from .prefill_graphs import PREFILL_ROW_BUCKETS, StaticPrefill


@dataclass(frozen=True, slots=True)
class RowSampling:
    temperature: float
    top_p: float
    repetition_penalty: float
    seed: int


def power_of_two_buckets(limit: int) -> list[int]:
    """1, 2, 4, … up to and including `limit` (which need not be a power of two)."""
    out, b = [], 1
    while b < limit:
        out.append(b)
        b *= 2
    out.append(limit)
    return out


def half_step_buckets(limit: int, from_rows: int = 2) -> list[int]:
    """Powers of two, plus 1.5× each power of two from `from_rows` on, up to and including `limit`. From 2 rows
    (1, 2, 3, 4, 6, 8, 12, 16, …) a call padded to the next bucket runs under a third of padding rows instead of up
    to a half (33 rows: 48 instead of 64)."""
    sizes = set(power_of_two_buckets(limit))
    b = from_rows
    while b * 3 // 2 < limit:
        sizes.add(b * 3 // 2)
        b *= 2
    return sorted(sizes)


# Above this many rows a decode graph also comes at 1.5× each power of two (128, 192, 256, 384, 512, 768, …): a step's
# cost grows with its rows, and 300 streams padded to a 512-row graph ran ~8 ms a step for padding (H200: 27.7 ms at
# 512 rows against ~20 ms interpolated at 384); three more graphs per length bucket up to 1,024 rows.
HALF_STEP_BUCKETS_FROM = 128


def decode_batch_buckets(limit: int) -> list[int]:
    """The decode graphs' batch buckets: half steps from HALF_STEP_BUCKETS_FROM rows on."""
    return half_step_buckets(limit, HALF_STEP_BUCKETS_FROM)


def _length_grid(buckets: Sequence[int] | None, full: int) -> list[int]:
    """Attention-length buckets capped at the cache length `full`, which is always one of them."""
    return sorted({min(b, full) for b in (buckets or [full])} | {full})


def capturable_buckets(missing: list[tuple[int, int]], row_positions: Sequence[int]) -> list[tuple[int, int]]:
    """The (batch, length) buckets of `missing` whose step over rows [0, batch) stays inside the attention length:
    every one of those rows' positions is below it."""
    return [(b, n) for b, n in missing if max(row_positions[:b], default=0) < n]


# A step runs in a larger captured bucket than its own when that bucket's graph replayed in under this share of the
# own one's time at capture. Inductor's kernels for some batch sizes are slower than for larger ones (H200:
# 64 rows 5.46-5.69 ms, 96 rows 6.68, 128 rows 4.93-4.94: at 64 rows two of the sampler's vocabulary reductions took
# 1.6 ms). Replay times repeat within ~1-2 %; the margin keeps noise from moving a step.
ROUTE_BELOW = 0.95
TIMED_REPLAYS = 5  # replays timed after each decode capture (after one untimed), on the capture's zeroed commit flags


def fastest_bucket(own: int, replay_ms: dict[int, float]) -> int:
    """The batch bucket a step of bucket `own` runs in: the captured bucket ≥ own that replayed fastest, where that is
    under ROUTE_BELOW of own's time; else own (also when own was not timed). `replay_ms`: bucket → ms at one
    attention length. A step cannot be split, so only larger buckets, each replayed once, are candidates."""
    larger = {bucket: ms for bucket, ms in replay_ms.items() if bucket >= own}
    return cheapest_plan(own, own, larger, ROUTE_BELOW)[0]


# start_segments batches (prompts finishing in one turn) captured as graphs up to this size; larger ones run eagerly
FIRST_FRAME_MAX_BATCH = 16


class DecodeStepper:
    def __init__(
        self,
        model: DualARTransformer,
        n_rows: int,
        *,
        max_seq_len: int | None = None,
        use_cuda_graphs: bool = False,
        length_buckets: list[int] | None = None,
        prefill_length_buckets: list[int] | None = None,
        prefill_row_buckets: Sequence[int] = PREFILL_ROW_BUCKETS,
        max_batch: int | None = None,
        fixed_batch: bool = False,
        first_frame_scratch_row: int | None = None,
        prefill_scratch_row: int | None = None,
        compile_backend: str | None = None,
        compile_max_batch: int | None = None,
        tune_single_row: bool = False,
        symbolic_batch_above: int | None = None,
        defer_compile: bool = False,
    ) -> None:
        """`compile_backend` ("inductor"; "eager" only checks tracing) runs the step's regions compiled (see
        model.compiled_regions) for batch buckets up to `compile_max_batch` (default: all); each region compiles
        once per shape, on its first use or capture. `tune_single_row` compiles the one-row bucket's regions with
        `compiled_regions.TUNED_OPTIONS` (GEMVs as tuned Triton reductions; CUDA devices only). Compiled buckets
        above `symbolic_batch_above` rows share one compilation per remaining shape with a symbolic batch size
        (None: every bucket static). Inductor's on-disk cache (TORCHINDUCTOR_CACHE_DIR, set by the caller) makes
        later starts cheaper.
        `fixed_batch`: every graph-captured step runs all `max_batch` rows (batch-invariant mode on a GPU, where the
        kernels cuBLAS picks, and so a row's rounding, depend on the batch size).
        `first_frame_scratch_row`: a row no stream reads while first frames are sampled; given, `start_segments` runs
        through fixed-size buffers padded to a batch bucket (padding rows write that row only), one CUDA graph per
        bucket where graphs are on (eager, ~1,500 kernels a call, it cost tens of ms a request on the H200).
        `prefill_scratch_row`: likewise for prefill (see model.prefill_graphs): given, `prefill` and `prefill_many`
        run through buffers padded to (rows, chunk, attention length) buckets where the prompts fit one, one graph
        per bucket captured on first use or in idle time; prompts that fit none run the plain eager pass.
        `prefill_length_buckets`: those passes' attention lengths (default: `length_buckets`). A model whose decode
        attention stops at each row's length (`use_length_attention`) needs one decode length only, the full cache,
        while prefill still attends over a bucket through SDPA. `prefill_row_buckets`: prompts per static pass.
        `defer_compile`: every graph whose regions would compile is first captured uncompiled (plain PyTorch, no
        dynamo: fractions of a second each), and replaced by its compiled capture later, one at a time through
        `capture_next` (idle time), so start-up never waits for compilation (`pending_upgrades`)."""
        self.model = model
        c = model.config
        self.n_rows = n_rows
        self.max_seq_len = min(max_seq_len or c.max_seq_len, c.max_seq_len)
        self.cache = model.make_cache(n_rows, self.max_seq_len)
        self.fast_cache = model.make_fast_cache(n_rows)
        # batch-invariant runs attend over one fixed length; otherwise the smallest bucket covering all rows
        full = self.cache.max_seq_len
        self.length_buckets = _length_grid(length_buckets, full)
        self.prefill_length_buckets = (
            self.length_buckets if prefill_length_buckets is None else _length_grid(prefill_length_buckets, full)
        )
        # decode batches cover rows [0, bucket); rows past max_batch (e.g. cached voice prefixes) never decode
        self.batch_buckets = [max_batch or n_rows] if fixed_batch else decode_batch_buckets(max_batch or n_rows)
        device = model.embeddings.weight.device
        self.device = device
        width = 1 + c.num_codebooks

        def zeros(*shape: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dtype, device=device)

        self.frame = zeros(n_rows, width)  # last sampled frame, to be fed at `pos`
        self.pos = zeros(n_rows)
        self.window = zeros(n_rows, width, PENALTY_WINDOW_FRAMES)  # ring buffer of loop frames
        self.loop_step = zeros(n_rows)  # frames produced by decode steps in the current segment
        self.seed = zeros(n_rows)
        self.noise_step = zeros(n_rows)  # per-stream noise counter (never reset within a session)
        self.temperature = zeros(n_rows, dtype=torch.float32)
        self.top_p = zeros(n_rows, dtype=torch.float32)
        self.repetition_penalty = zeros(n_rows, dtype=torch.float32)
        self.commit = zeros(n_rows, dtype=torch.bool)
        self.out = zeros(n_rows, width)
        self.use_cuda_graphs = use_cuda_graphs and device.type == "cuda"
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        # each decode graph's replay time at capture, ms (CUDA): steps route to a faster larger bucket (fastest_bucket)
        self.replay_ms: dict[tuple[int, int], float] = {}
        self.routed_steps = 0  # steps run in a larger bucket than their own because it replayed faster
        # the (batch bucket, attention length) the last step ran at: a step reads every row's keys up to the length
        # bucket, so one row past a bucket edge moves the whole batch to the next (a /metrics gauge)
        self.last_bucket = (0, 0)
        # what a turn may pay for without it showing in the phases' names (the slow-turn log and /metrics): graphs
        # captured (decode, first frames, prefill; at start-up, in idle time or on first use) and prompt passes that
        # fit no static prefill bucket and ran eagerly (~3,000 kernel launches, ~0.1 s on the H200)
        self.graphs_recorded = 0
        # seconds spent capturing (compiles included) by kind of graph: decode_static, decode_symbolic (compiled with
        # a symbolic batch), decode_eager (not compiled), first_frames; start-up's capture phase split (/metrics)
        self.capture_seconds: dict[str, float] = collections.defaultdict(float)
        self.eager_prefills = 0
        self._pool = torch.cuda.graph_pool_handle() if self.use_cuda_graphs else None
        self.first_frame_scratch_row = first_frame_scratch_row
        self.first_frame_buckets = power_of_two_buckets(min(FIRST_FRAME_MAX_BATCH, max_batch or n_rows))
        self._first_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        most = self.first_frame_buckets[-1]
        dtype = model.embeddings.weight.dtype
        self._ff_rows, self._ff_positions = zeros(most), zeros(most)  # static inputs and output of those graphs
        # inference tensors, as the sampler's inputs are everywhere else (prefill's and the decode step's outputs): a
        # plain tensor here gave the fast stack's layer 0 at codebook 0 a compiled variant of its own, so the variant
        # every later call shares was first traced at layer 1, whose k/v views start past offset 1. With a symbolic
        # batch dynamo guards such an offset as >= 2 (0 and 1 specialise, unguarded), and the variant refused layer 0
        # at codebook 1 (model.saved_regions: one refusal and one torch.compile at every engine start)
        with torch.inference_mode():
            self._ff_logits = zeros(most, c.vocab_size, dtype=dtype)  # ≤ 16 rows: 3.3 MB for the official vocab, bf16
            self._ff_hidden = zeros(most, c.fast_dim, dtype=dtype)
        self._ff_out = zeros(most, width)
        self.static_prefill = (
            StaticPrefill(
                model, self.cache, prefill_scratch_row, self.prefill_length_buckets,
                record=self._record if self.use_cuda_graphs else None, row_buckets=prefill_row_buckets,
            )
            if prefill_scratch_row is not None
            else None
        )  # fmt: skip
        # pinned host mirrors: the commit flags go up and the new frames come down without an extra sync
        pin = device.type == "cuda"
        self._commit_host = torch.zeros(n_rows, dtype=torch.bool, pin_memory=pin)
        self._out_host = torch.zeros(n_rows, width, dtype=torch.int64, pin_memory=pin)
        self.compile_backend = compile_backend
        self.compile_max_batch = compile_max_batch or n_rows
        self.tune_single_row = tune_single_row and device.type == "cuda"
        self.symbolic_batch_above = symbolic_batch_above
        self.defer_compile = defer_compile
        # graphs captured uncompiled that compile later (defer_compile): ("decode", batch, length), ("first", batch, 0)
        self._uncompiled: set[tuple[str, int, int]] = set()
        self._capturing_uncompiled = False  # inside such a capture: every region runs eagerly

    # ---- row state (host calls, outside graphs) ----------------------------------------------------------------------
    def set_sampling(self, row: int, s: RowSampling) -> None:
        self.temperature[row] = s.temperature
        self.top_p[row] = s.top_p
        self.repetition_penalty[row] = s.repetition_penalty
        self.seed[row] = s.seed

    def set_noise_step(self, row: int, step: int) -> None:
        self.noise_step[row] = step

    def set_position(self, row: int, position: int) -> None:
        """Where the row's next token is written: idle decode writes land there, past its valid positions."""
        self.pos[row] = position

    @torch.inference_mode()
    def prefill(self, row: int, tokens: torch.Tensor, start_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Write tokens (1+nc, T) into `row` from `start_pos`; returns the last position's (logits, fast hidden)."""
        if self.static_prefill is not None:
            out = self.static_prefill.prefill_many([row], [tokens], [start_pos])
            if out is not None:
                return out[0][0], out[1][0]
            self.eager_prefills += 1
        return self.model.prefill(tokens.to(self.device), self.cache, row, start_pos)

    @torch.inference_mode()
    def prefill_many(
        self, rows: list[int], prompts: list[torch.Tensor], start_positions: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`prefill` of several rows in one batched pass (see DualARTransformer.prefill_many): (B, vocab), (B, fast)."""
        if self.static_prefill is not None:
            out = self.static_prefill.prefill_many(rows, prompts, start_positions)
            if out is not None:
                return out
            self.eager_prefills += 1
        return self.model.prefill_many([p.to(self.device) for p in prompts], self.cache, rows, start_positions)

    @torch.inference_mode()
    def start_segments(
        self, rows: list[int], logits: torch.Tensor, hidden: torch.Tensor, next_positions: list[int]
    ) -> torch.Tensor:
        """Sample each row's segment-first frame from its prefill output (no repetition penalty, as upstream), all rows
        in one batched sample: logits (B, vocab), hidden (B, fast_dim). Each row's arithmetic is its own (per-row
        sampling parameters and noise; batch-invariant layers where the model has them), so a row draws the same
        frame alone or beside others. The rows then hold that frame at their next position, an empty window, and are
        ready for decode steps. Returns frames (B, 1+nc) on the device."""
        if self.first_frame_scratch_row is not None and len(rows) <= self.first_frame_buckets[-1]:
            return self._start_segments_static(rows, logits, hidden, next_positions)
        index = torch.tensor(rows, device=self.device)
        return self._first_frames(index, logits, hidden, torch.tensor(next_positions, device=self.device))

    def _first_frames(
        self, index: torch.Tensor, logits: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """The arithmetic of start_segments for rows `index` (tensors only: capturable)."""
        params = SamplingTensors(self.temperature[index], self.top_p[index], self.repetition_penalty[index])
        frames = sample_frame(
            self.model, logits, hidden, self.model.make_fast_cache(index.shape[0]), params,
            self._noise(self.seed[index], self.noise_step[index], logits.shape[-1]),
        )  # fmt: skip
        self.frame[index] = frames
        self.pos[index] = positions
        self.window.index_fill_(0, index, 0)
        self.loop_step.index_fill_(0, index, 0)
        self.noise_step[index] += 1
        return frames

    def _start_segments_static(
        self, rows: list[int], logits: torch.Tensor, hidden: torch.Tensor, next_positions: list[int]
    ) -> torch.Tensor:
        """start_segments through the static buffers, padded to a batch bucket with the scratch row."""
        assert self.first_frame_scratch_row is not None
        n = len(rows)
        bucket = self.first_frame_buckets[bisect.bisect_left(self.first_frame_buckets, n)]
        pad = [self.first_frame_scratch_row] * (bucket - n)
        self._ff_rows[:bucket].copy_(torch.tensor(rows + pad))
        self._ff_positions[:bucket].copy_(torch.tensor(next_positions + [0] * len(pad)))
        self._ff_logits[:n].copy_(logits)
        self._ff_hidden[:n].copy_(hidden)
        if self.use_cuda_graphs:
            graph = self._first_graphs.get(bucket)
            if graph is None:
                graph = self._capture_first_frames(bucket)
            graph.replay()
        else:
            self._run_first_frames(bucket)
        return self._ff_out[:n].clone()

    def _run_first_frames(self, bucket: int) -> None:
        rows, positions = self._ff_rows[:bucket], self._ff_positions[:bucket]
        with self._compiled_for(bucket):
            out = self._first_frames(rows, self._ff_logits[:bucket], self._ff_hidden[:bucket], positions)
        self._ff_out[:bucket] = out

    @torch.inference_mode()
    def _capture_first_frames(self, bucket: int, *, compile_now: bool = False) -> torch.cuda.CUDAGraph:
        """Capture the first-frame sample for one batch bucket; warm-up runs write the scratch row only, at position 0
        (the static buffers still hold the last real call's positions when this runs in idle time: the scratch row
        left at one of them past a short attention length made the next decode capture write out of range)."""
        assert self.first_frame_scratch_row is not None
        rows, positions = self._ff_rows[:bucket].clone(), self._ff_positions[:bucket].clone()
        self._ff_rows[:bucket].fill_(self.first_frame_scratch_row)
        self._ff_positions[:bucket].zero_()
        uncompiled = self._defers(bucket) and not compile_now
        t0 = time.perf_counter()
        with self._uncompiled_capture(uncompiled):
            graph = self._record(lambda: self._run_first_frames(bucket))
        self.capture_seconds["first_frames"] += time.perf_counter() - t0
        self._ff_rows[:bucket].copy_(rows)
        self._ff_positions[:bucket].copy_(positions)
        self._first_graphs[bucket] = graph
        self._track_uncompiled(("first", bucket, 0), uncompiled)
        return graph

    def start_segment(self, row: int, logits: torch.Tensor, hidden: torch.Tensor, next_pos: int) -> torch.Tensor:
        """`start_segments` for one row: logits (vocab,), hidden (fast_dim,) → its frame (1+nc,)."""
        return self.start_segments([row], logits.unsqueeze(0), hidden.unsqueeze(0), [next_pos])[0]

    def move_row(self, src: int, dst: int, length: int) -> None:
        """Move a stream from row src to row dst (KV positions [0, length) and all per-row state)."""
        if src == dst:
            return
        self.cache.move_slot(src, dst, length)
        for t in self._row_tensors():
            t[dst] = t[src]

    def swap_rows(self, a: int, b: int, length_a: int, length_b: int, spare: int) -> None:
        """Exchange two rows through a free `spare` row, which is left at position 0: the spare can be a padding row
        of a decode step (a batch bucket that reaches it), which writes K/V at its position and must stay inside the
        step's attention length (the engine's host mirror of the spare's position is 0)."""
        self.move_row(a, spare, length_a)
        self.move_row(b, a, length_b)
        self.move_row(spare, b, length_a)
        self.pos[spare] = 0

    def permute_rows(self, dst: torch.Tensor, src: torch.Tensor, length: int) -> None:
        """Row dst[i] takes the stream of row src[i] (KV positions [0, length) and all per-row state), for all i at
        once: a turn's swaps composed into one permutation (the worker's segment ends), ~11 device ops in all
        instead of ~33 per swap. Rows outside dst keep theirs. dst and src: row indices on the stepper's device."""
        if dst.numel() == 0:
            return
        self.cache.permute_slots(dst, src, length)
        for t in self._row_tensors():
            t[dst] = t[src]

    def _row_tensors(self) -> list[torch.Tensor]:
        return [
            self.frame, self.pos, self.window, self.loop_step, self.seed, self.noise_step,
            self.temperature, self.top_p, self.repetition_penalty,
        ]  # fmt: skip

    # ---- the step ----------------------------------------------------------------------------------------------------
    def bucket_for(self, rows: int, max_pos: int) -> tuple[int, int]:
        """(batch bucket ≥ rows, attention-length bucket > max_pos). Without graphs or compilation (static shapes)
        the batch is exactly `rows`: padding rows would only cost time (5 rows of the default model on CPU: 17.7 ms
        a step instead of 21.2 ms at bucket 8)."""
        static = self.use_cuda_graphs or self.compile_backend is not None
        b = self.batch_buckets[bisect.bisect_left(self.batch_buckets, rows)] if static else rows
        n = self.length_buckets[bisect.bisect_right(self.length_buckets, max_pos)]
        return b, n

    def route(self, bucket: int, attn_len: int) -> int:
        """The bucket a step of (bucket, attn_len) runs in (`fastest_bucket` among the timed graphs). Only at the full
        cache length: a larger bucket also steps rows past `rows` (free or idle rows, commit off), which write K/V at
        their positions, and only the full length is sure to hold every row's position."""
        if attn_len != self.cache.max_seq_len or not self.replay_ms:
            return bucket
        return fastest_bucket(bucket, {b: ms for (b, n), ms in self.replay_ms.items() if n == attn_len})

    def _noise(self, seed: torch.Tensor, step: torch.Tensor, vocab: int) -> NoiseFn:
        c = self.model.config
        return frame_noise(seed, step, vocab, c.num_codebooks, c.codebook_size)

    def _step_impl(self, rows: int, attn_len: int) -> None:
        """Advance committed rows in [0, rows) by one frame; every write goes to fixed-address tensors."""
        c = self.model.config
        frame, pos, commit = self.frame[:rows], self.pos[:rows], self.commit[:rows]
        logits, hidden = self.model.decode_slow(frame, self.cache, pos, attn_len)
        seed, step = self.seed[:rows], self.noise_step[:rows]
        params = SamplingTensors(self.temperature[:rows], self.top_p[:rows], self.repetition_penalty[:rows])
        new = sample_frame(
            self.model, logits, hidden, self.fast_cache, params, self._noise(seed, step, logits.shape[-1]),
            window=self.window[:rows],
        )  # fmt: skip
        keep = commit.unsqueeze(1)
        self.out[:rows] = new
        frame.copy_(torch.where(keep, new, frame))
        slot = (self.loop_step[:rows] % PENALTY_WINDOW_FRAMES).view(rows, 1, 1).expand(rows, 1 + c.num_codebooks, 1)
        old = torch.gather(self.window[:rows], 2, slot)
        self.window[:rows].scatter_(2, slot, torch.where(keep.unsqueeze(2), new.unsqueeze(2), old))
        inc = commit.to(torch.int64)
        pos.add_(inc)
        self.loop_step[:rows].add_(inc)
        step.add_(inc)

    def _compile_backend_for(self, rows: int) -> str | None:
        if self._capturing_uncompiled:
            return None
        return self.compile_backend if rows <= self.compile_max_batch else None

    def _defers(self, rows: int) -> bool:
        """Whether a capture of this bucket now goes uncompiled first (defer_compile, regions that would compile)."""
        return self.defer_compile and self._compile_backend_for(rows) is not None

    def _track_uncompiled(self, key: tuple[str, int, int], uncompiled: bool) -> None:
        """Note a graph just captured: uncompiled ones wait for their compiled capture (`pending_upgrades`)."""
        if uncompiled:
            self._uncompiled.add(key)
        else:
            self._uncompiled.discard(key)

    @contextlib.contextmanager
    def _uncompiled_capture(self, on: bool) -> Iterator[None]:
        saved, self._capturing_uncompiled = self._capturing_uncompiled, on or self._capturing_uncompiled
        try:
            yield
        finally:
            self._capturing_uncompiled = saved

    def _compiled_for(self, rows: int) -> contextlib.AbstractContextManager[None]:
        """How a bucket's regions run: eagerly, compiled static, tuned (one row) or with a symbolic batch."""
        above = self.symbolic_batch_above
        symbolic = rows if above is not None and rows > max(above, 1) else None
        return compiled(
            self._compile_backend_for(rows), tuned=self.tune_single_row and rows == 1, symbolic_batch=symbolic
        )

    def _capture_kind(self, rows: int) -> str:
        if self._compile_backend_for(rows) is None:
            return "decode_eager"
        above = self.symbolic_batch_above
        return "decode_symbolic" if above is not None and rows > max(above, 1) else "decode_static"

    def _run_step(self, rows: int, attn_len: int) -> None:
        """The step for one bucket: its regions compiled where asked for, else eager PyTorch."""
        with self._compiled_for(rows):
            self._step_impl(rows, attn_len)

    @torch.inference_mode()
    def set_commit(self, flags: list[bool]) -> None:
        """Rows [0, len(flags)) advance where flags say so at the next step; every other row does not (a step runs
        a whole batch bucket, so stale flags past len(flags) would advance rows the caller does not track).
        One async copy from pinned memory."""
        self._commit_host.zero_()
        self._commit_host[: len(flags)] = torch.tensor(flags, dtype=torch.bool)
        self.commit.copy_(self._commit_host, non_blocking=True)

    @torch.inference_mode()
    def step(self, rows: int, max_pos: int, while_running: Callable[[], None] | None = None) -> torch.Tensor:
        """One decode step for rows [0, rows) (set the commit flags first). Returns new frames (rows, 1+nc) on the
        host — the step's only device→host copy and its only sync. Positions must stay below `max_seq_len`.
        `while_running` is called once the step is queued on the device, before the host waits for it (the engine
        collects the vocoder's audio there, decoded on another stream meanwhile)."""
        own, attn_len = self.bucket_for(rows, max_pos)
        bucket = self.route(own, attn_len)
        self.routed_steps += bucket != own
        self.last_bucket = (bucket, attn_len)
        if self.use_cuda_graphs:
            graph = self._graphs.get((bucket, attn_len))
            if graph is None:
                graph = self.capture(bucket, attn_len)
            graph.replay()
        else:
            self._run_step(bucket, attn_len)
        if self.out.device.type == "cpu":
            if while_running is not None:
                while_running()
            return self.out[:rows].clone()  # a copy: `out` is overwritten by the next step
        self._out_host[:rows].copy_(self.out[:rows], non_blocking=True)
        if while_running is not None:
            while_running()
        torch.cuda.current_stream(self.out.device).synchronize()
        return self._out_host[:rows].clone()

    @torch.inference_mode()
    def capture(self, bucket: int, attn_len: int, *, compile_now: bool = False) -> torch.cuda.CUDAGraph:
        """Capture the step for one (batch bucket, attention length); state is saved and restored around warm-up.
        With defer_compile the regions run uncompiled unless `compile_now` (the later replacement)."""
        saved = [t.clone() for t in self._row_tensors()]
        commit = self.commit.clone()
        self.commit.zero_()  # warm-up and capture runs must not advance anything
        uncompiled = self._defers(bucket) and not compile_now
        t0 = time.perf_counter()
        with self._uncompiled_capture(uncompiled):
            graph = self._record(lambda: self._run_step(bucket, attn_len))
            # inside: an uncompiled capture counts as decode_eager
            self.capture_seconds[self._capture_kind(bucket)] += time.perf_counter() - t0
        if self.device.type == "cuda":  # timed while commit is zeroed: the replays redo the warm-up's writes
            self.replay_ms[(bucket, attn_len)] = replay_ms(graph, TIMED_REPLAYS)
        for t, s in zip(self._row_tensors(), saved, strict=True):
            t.copy_(s)
        self.commit.copy_(commit)
        self._graphs[(bucket, attn_len)] = graph
        self._track_uncompiled(("decode", bucket, attn_len), uncompiled)
        return graph

    def _record(self, run: Callable[[], None]) -> torch.cuda.CUDAGraph:
        """`run` twice on a side stream (warm-up; the first run also compiles, when compiling), then captured into
        a graph in the stepper's memory pool. The warm-up runs execute: the caller makes them harmless."""
        self.graphs_recorded += 1
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                run()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            run()
        return graph

    def capture_all(self, max_batch: int | None = None, after_each: Callable[[], object] | None = None) -> int:
        """Capture every decode (batch, length) bucket and first-frame bucket up front (cold start), or only those of
        batch ≤ `max_batch` (the rest can follow in idle time through `capture_next`, or on first use); returns how
        many decode graphs exist. `after_each` runs after every capture (the engine freezes what it built out of
        later garbage collections: streaming.gc_pauses)."""
        if self.use_cuda_graphs:
            for b, n in self.missing_graphs():
                if max_batch is None or b <= max_batch:
                    self.capture(b, n)
                    if after_each is not None:
                        after_each()
            for b in self.missing_first_frame_graphs():  # compiled like the step: seconds each even from a warm cache
                if max_batch is None or b <= max_batch:
                    self._capture_first_frames(b)
                    if after_each is not None:
                        after_each()
        return len(self._graphs)

    def missing_graphs(self) -> list[tuple[int, int]]:
        """(batch, length) buckets not captured yet, small batches first (empty without CUDA graphs)."""
        if not self.use_cuda_graphs:
            return []
        grid = [(b, n) for b in self.batch_buckets for n in self.length_buckets]
        return [key for key in grid if key not in self._graphs]

    def missing_first_frame_graphs(self) -> list[int]:
        """First-frame batch buckets not captured yet, small first (empty without graphs or static first frames)."""
        if not self.use_cuda_graphs or self.first_frame_scratch_row is None:
            return []
        return [b for b in self.first_frame_buckets if b not in self._first_graphs]

    def capture_next(self, row_positions: Sequence[int]) -> bool:
        """Capture one missing decode bucket (for idle time), else one missing first-frame bucket, else replace one
        graph captured uncompiled by its compiled capture (defer_compile), else capture one missing prefill bucket;
        False when none is missing or none can be captured now.

        Warm-up and capture run the step over rows [0, batch) without advancing them, which still writes each row's
        K/V at its position: harmless at a row's next position, but out of the bucket's attention length when an open
        session's row is already past it (an index assert on CUDA that kills the process). So only buckets whose
        length covers the current `row_positions` (the host mirror of `pos`) are captured; the rest wait. First-frame
        and prefill captures write the scratch row only: always safe between turns."""
        capturable = capturable_buckets(self.missing_graphs(), row_positions)
        if capturable:
            self.capture(*capturable[0])
            return True
        first_frames = self.missing_first_frame_graphs()
        if first_frames:
            self._capture_first_frames(first_frames[0])
            return True
        if self._compile_next(row_positions):
            return True
        return self.static_prefill is not None and self.static_prefill.capture_next()

    def pending_upgrades(self) -> list[tuple[str, int, int]]:
        """Graphs captured uncompiled that still wait for their compiled capture (defer_compile), small batches first,
        decode before first frames."""
        return sorted(self._uncompiled, key=lambda k: (k[0] != "decode", k[1], k[2]))

    def _compile_next(self, row_positions: Sequence[int]) -> bool:
        """Replace one uncompiled graph by its compiled capture; decode graphs only where capture_next's position
        rule allows (their warm-up runs write rows [0, batch) at their positions)."""
        pending = self.pending_upgrades()
        decode = capturable_buckets([(b, n) for kind, b, n in pending if kind == "decode"], row_positions)
        if decode:
            self.capture(*decode[0], compile_now=True)
            return True
        first = [b for kind, b, _ in pending if kind == "first"]
        if first:
            self._capture_first_frames(first[0], compile_now=True)
            return True
        return False

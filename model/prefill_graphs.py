"""Prefill passes through fixed-address buffers padded to buckets, so that each bucket can replay as one CUDA graph.

An eager prefill pass of the full-size model is ~3,000 kernel launches whatever its size (~120 ms a request on the
H200, docs/archive/benchmark-log.md). Here a pass is `DualARTransformer.prefill_rows` over the leading block of
static buffers
(tokens, positions, row indices, last-token indices in; logits and fast hidden out), one block shape per
(rows, chunk, attention length) bucket: one CUDA graph per bucket where graphs are on, the same padded arithmetic run
eagerly where they are not (CPU, where the tests check it against the plain `prefill_many`).

Padding is `prefill_many`'s: a prompt shorter than the chunk bucket is followed by padding tokens at its row's first
position after the prompt (the row's next write overwrites them before anything reads them), so that position must
lie inside the attention bucket and the context. Rows missing from a rows bucket gather and scatter `scratch_row`,
which no stream reads. A call that fits no bucket returns None and the caller runs the eager `prefill_many`.
Graphs are captured on first use, one at a time in idle time (`capture_next`), or those of few rows at start-up
(`capture_up_to`: the engine's `prefill_graphs_up_front`).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence

import torch

from .dual_ar import DualARTransformer, right_pad
from .kv_cache import KVCache

# prompts per pass (a call with more rows runs several passes; the default: StaticPrefill's row_buckets) and tokens
# per prompt per pass; the worker writes prompts in chunks of at most the largest chunk bucket
# (streaming.worker.WorkerLimits.prefill_chunk_tokens)
PREFILL_ROW_BUCKETS = (1, 2, 4)
PREFILL_CHUNK_BUCKETS = (64, 128, 256)

Bucket = tuple[int, int, int]  # (rows, chunk tokens, attention length)
# runs a pass twice to warm up, then captures it into a graph (DecodeStepper._record: the decode graphs' pool)
Recorder = Callable[[Callable[[], None]], torch.cuda.CUDAGraph]


class StaticPrefill:
    def __init__(
        self,
        model: DualARTransformer,
        cache: KVCache,
        scratch_row: int,
        length_buckets: Sequence[int],
        record: Recorder | None = None,
        row_buckets: Sequence[int] = PREFILL_ROW_BUCKETS,
    ) -> None:
        """`length_buckets`: attention lengths (the decode stepper's; the largest no more than the cache's).
        `record`: capture passes as CUDA graphs through it; None runs them eagerly. `row_buckets`: prompts per pass
        (H200: a pass of 8 short prompts 4.66 ms against 3.86 ms for 4, so 0.58 against 0.96 ms a prompt)."""
        self.row_buckets = sorted(row_buckets)
        self.model = model
        self.cache = cache
        self.scratch_row = scratch_row
        self.length_buckets = sorted(length_buckets)
        # every position a pass writes (padding included) stays below this, as in prefill_many
        self.limit = min(cache.max_seq_len, model.config.max_seq_len)
        self._record = record
        self.graphs: dict[Bucket, torch.cuda.CUDAGraph] = {}
        c = model.config
        device, dtype = cache.k.device, model.embeddings.weight.dtype
        rows, chunk = self.row_buckets[-1], PREFILL_CHUNK_BUCKETS[-1]
        self.tokens = torch.zeros(rows, 1 + c.num_codebooks, chunk, dtype=torch.int64, device=device)
        self.positions = torch.zeros(rows, chunk, dtype=torch.int64, device=device)
        self.rows = torch.zeros(rows, dtype=torch.int64, device=device)
        self.last = torch.zeros(rows, dtype=torch.int64, device=device)  # each row's last prompt token in the chunk
        self.logits = torch.zeros(rows, c.vocab_size, dtype=dtype, device=device)
        self.hidden = torch.zeros(rows, c.fast_dim, dtype=dtype, device=device)

    def bucket_for(self, lengths: Sequence[int], ends: Sequence[int]) -> Bucket | None:
        """The bucket of one pass over prompts of `lengths` ending at `ends` (start + length, where padding writes),
        or None: too many rows or tokens for the largest bucket, or an end at or past the context or every bucket."""
        if not lengths or len(lengths) > self.row_buckets[-1] or max(lengths) > PREFILL_CHUNK_BUCKETS[-1]:
            return None
        end = max(ends)
        length = bisect.bisect_right(self.length_buckets, end)
        if end >= self.limit or length == len(self.length_buckets):
            return None
        rows = self.row_buckets[bisect.bisect_left(self.row_buckets, len(lengths))]
        chunk = PREFILL_CHUNK_BUCKETS[bisect.bisect_left(PREFILL_CHUNK_BUCKETS, max(lengths))]
        return rows, chunk, self.length_buckets[length]

    @torch.inference_mode()
    def prefill_many(
        self, rows: Sequence[int], prompts: Sequence[torch.Tensor], start_positions: Sequence[int]
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`DualARTransformer.prefill_many` through the buckets, in passes of at most the largest rows bucket (rows
        never read each other's KV, so splitting changes nothing): (B, vocab) logits and (B, fast_dim) hidden, or
        None when some pass fits no bucket (nothing is written then)."""
        most = self.row_buckets[-1]
        groups = [range(i, min(i + most, len(rows))) for i in range(0, len(rows), most)]
        lengths = [p.shape[-1] for p in prompts]
        ends = [s + n for s, n in zip(start_positions, lengths, strict=True)]
        buckets = [self.bucket_for([lengths[i] for i in g], [ends[i] for i in g]) for g in groups]
        if not groups or None in buckets:
            return None
        outs = [
            self._pass(bucket, [rows[i] for i in g], [prompts[i] for i in g], [start_positions[i] for i in g])
            for bucket, g in zip(buckets, groups, strict=True)
            if bucket is not None
        ]
        return torch.cat([o[0] for o in outs]), torch.cat([o[1] for o in outs])

    def _pass(
        self, bucket: Bucket, rows: list[int], prompts: list[torch.Tensor], start_positions: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n_rows, chunk, _ = bucket
        # a missing graph is captured before the inputs are filled in: its runs then write the scratch row only
        graph = self._graph(bucket) if self._record is not None else None
        n = len(rows)
        positions = torch.zeros(n_rows, chunk, dtype=torch.int64)  # padding rows: position 0 of the scratch row
        tokens = self.tokens[:n_rows, :, :chunk]
        tokens.zero_()
        right_pad(prompts, start_positions, tokens, positions)
        self.positions[:n_rows, :chunk].copy_(positions)
        self.rows[:n_rows].copy_(torch.tensor(rows + [self.scratch_row] * (n_rows - n)))
        self.last[:n_rows].copy_(torch.tensor([p.shape[-1] - 1 for p in prompts] + [0] * (n_rows - n)))
        if graph is not None:
            graph.replay()
        else:
            self._run(bucket)
        return self.logits[:n].clone(), self.hidden[:n].clone()  # copies: the buffers are the next pass's

    def _run(self, bucket: Bucket) -> None:
        """One pass over the buffers' block of `bucket` (tensors only: capturable)."""
        n_rows, chunk, attn_len = bucket
        logits, hidden = self.model.prefill_rows(
            self.tokens[:n_rows, :, :chunk], self.cache, self.rows[:n_rows], self.positions[:n_rows, :chunk],
            self.last[:n_rows], attn_len,
        )  # fmt: skip
        self.logits[:n_rows].copy_(logits)
        self.hidden[:n_rows].copy_(hidden)

    def _graph(self, bucket: Bucket) -> torch.cuda.CUDAGraph:
        graph = self.graphs.get(bucket)
        return graph if graph is not None else self.capture(bucket)

    @torch.inference_mode()
    def capture(self, bucket: Bucket) -> torch.cuda.CUDAGraph:
        """Capture one bucket's pass. Warm-up and capture runs execute: every row of the block points at the scratch
        row, with zero tokens at position 0, so they write nothing a stream reads."""
        assert self._record is not None, "graphs are off"
        n_rows, chunk, _ = bucket
        self.rows[:n_rows].fill_(self.scratch_row)
        self.tokens[:n_rows, :, :chunk].zero_()
        self.positions[:n_rows, :chunk].zero_()
        self.last[:n_rows].zero_()
        graph = self._record(lambda: self._run(bucket))
        self.graphs[bucket] = graph
        return graph

    def missing_graphs(self) -> list[Bucket]:
        """Buckets not captured yet, the likeliest first (one row, short contexts, short chunks); empty without
        graphs."""
        if self._record is None:
            return []
        grid = [(r, c, n) for r in self.row_buckets for n in self.length_buckets for c in PREFILL_CHUNK_BUCKETS]
        return [bucket for bucket in grid if bucket not in self.graphs]

    def capture_up_to(self, max_rows: int, after_each: Callable[[], object] | None = None) -> int:
        """Capture every missing bucket of at most `max_rows` prompts (start-up: a first request's prompt then replays
        graphs instead of capturing them inside its turns); `after_each` runs after each capture. Returns how many
        were captured (0 without graphs)."""
        todo = [bucket for bucket in self.missing_graphs() if bucket[0] <= max_rows]
        for bucket in todo:
            self.capture(bucket)
            if after_each is not None:
                after_each()
        return len(todo)

    def capture_next(self) -> bool:
        """Capture one missing bucket (for idle time: it touches the scratch row only); False when none is missing."""
        missing = self.missing_graphs()
        if missing:
            self.capture(missing[0])
        return bool(missing)

"""CUDA-graph replay of the streaming vocoder: one graph per (batch bucket, chunk frames), batched across sessions.

Eager decoding of a small chunk costs ~17 ms of launches on an H200 against ~2.7 ms replayed (bench/NOTES.md).
A call with B sessions runs the graph of the smallest bucket ≥ B; the padding rows decode into spare state slots
that no session owns (slots [n_sessions, n_sessions + padding)), so real streams are untouched. Graphs are captured
on first use or ahead of time with `capture` (the engine: one-row graphs at warm-up, the rest in idle time, see
`missing`). On CPU this module is not used: the caller decodes eagerly.
"""

from __future__ import annotations

import bisect

import torch

from .compiled_regions import compiled
from .vocoder_stream import StreamingDecoder


class GraphedVocoder:
    def __init__(
        self,
        decoder: StreamingDecoder,
        n_sessions: int,
        batch_buckets: list[int],
        compile_backend: str | None = None,
        cudnn_benchmark: bool = False,
    ) -> None:
        """`compile_backend` ("inductor"; "eager" only checks tracing): each (bucket, frames) graph captures the
        chunk decode compiled by torch.compile (model.compiled_regions) instead of eager PyTorch.
        `cudnn_benchmark`: cuDNN times its algorithms for each conv shape while a graph is captured (seconds per
        graph) instead of trusting its heuristic, which gave two of the channels-last layout's dilated convs a 92 ms
        kernel at 64 × 24 frames on an H200 (run 15: 274 → 87 ms a call)."""
        if decoder.max_slots < n_sessions + max(batch_buckets) - 1:
            raise ValueError("the streaming decoder needs spare slots for padding rows (max_slots ≥ 2·n_sessions)")
        self.decoder = decoder
        self.n_sessions = n_sessions
        self.buckets = sorted(batch_buckets)
        self.rows = decoder.codec.config.quantizer.n_groups * decoder.codec.config.quantizer.n_codebooks
        self.compile_backend = compile_backend
        self.cudnn_benchmark = cudnn_benchmark
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._pool = torch.cuda.graph_pool_handle()

    def missing(self, frame_sizes: list[int]) -> list[tuple[int, int]]:
        """(bucket, frames) graphs not captured yet for these chunk sizes, small buckets first."""
        return [(b, f) for b in self.buckets for f in sorted(frame_sizes) if (b, f) not in self._graphs]

    def bucket(self, batch: int) -> int:
        return self.buckets[bisect.bisect_left(self.buckets, batch)]

    @torch.inference_mode()
    def capture(self, bucket: int, frames: int) -> None:
        if (bucket, frames) in self._graphs:
            return
        device = self.decoder.device
        codes = torch.zeros(bucket, self.rows, frames, dtype=torch.int64, device=device)
        spare = torch.arange(self.n_sessions, self.n_sessions + bucket, device=device)
        slots = spare.clone()
        saved = self.decoder.state[spare].clone()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        benchmark = torch.backends.cudnn.benchmark
        torch.backends.cudnn.benchmark = benchmark or self.cudnn_benchmark
        try:
            with compiled(self.compile_backend):
                with torch.cuda.stream(stream):
                    for _ in range(2):  # warm-up; the first call also compiles, when compiling (and times convs)
                        self.decoder.decode(codes, slots)
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self._pool):
                    out = self.decoder.decode(codes, slots)
        finally:
            torch.backends.cudnn.benchmark = benchmark
        self.decoder.state[spare] = saved
        self._graphs[(bucket, frames)] = (graph, codes, slots, out)

    @torch.inference_mode()
    def decode(self, codes: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """codes (B, rows, F) and slots (B,) on the device → audio (B, F·spf), via the bucket's graph. The audio is a
        view of the graph's static output, overwritten by the next call of the same shape: copy it to keep it."""
        batch, _, frames = codes.shape
        bucket = self.bucket(batch)
        if (bucket, frames) not in self._graphs:
            self.capture(bucket, frames)
        graph, codes_in, slots_in, out = self._graphs[(bucket, frames)]
        codes_in[:batch].copy_(codes)
        slots_in[:batch].copy_(slots)
        if bucket > batch:  # padding rows write to spare slots nobody owns
            slots_in[batch:].copy_(torch.arange(self.n_sessions, self.n_sessions + bucket - batch, device=slots.device))
        graph.replay()
        return out[:batch]

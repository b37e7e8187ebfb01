"""CUDA-graph replay of the streaming vocoder: one graph per (batch bucket, chunk frames), batched across sessions.

Eager decoding of a small chunk costs ~17 ms of launches on an H200 against ~2.7 ms replayed
(docs/archive/benchmark-log.md).
A call with B sessions runs the graph of the smallest bucket ≥ B; the padding rows decode into spare state slots
that no session owns (slots [n_sessions, n_sessions + padding)), so real streams are untouched. Graphs are captured
on first use or ahead of time with `capture` (the engine: one-row graphs at warm-up, the rest in idle time, see
`missing`). On CPU this module is not used: the caller decodes eagerly.

Each graph is timed when it is captured (a few replays). A call runs on whichever captured graph of its chunk size
is cheapest: normally its own bucket, but where the conv library's heuristic picked a pathological kernel for a shape,
a larger bucket (more padding rows) or several replays of a smaller one. H200, untuned channels-last layout:
24 × 24 frames 80.5 ms against 22.7 ms for 48 × 24; 64 × 8 73.3 ms against 5.5 ms for 32 × 8 (`cheapest_plan`).
"""

from __future__ import annotations

import bisect
import logging

import torch

from .compiled_regions import compiled
from .graph_timing import cheapest_plan, replay_ms
from .vocoder_stream import StreamingDecoder

log = logging.getLogger(__name__)

TIMING_REPLAYS = 3  # replays timed after a graph is captured (its spare-slot state is restored after)
# another plan must be at least this much cheaper than the call's own bucket: timing noise never reroutes a call (a
# healthy graph is never slower than padding to a larger one or splitting into several; the pathological ones are 3-13×)
REROUTE_BELOW = 0.7


class GraphedVocoder:
    def __init__(
        self,
        decoder: StreamingDecoder,
        n_sessions: int,
        batch_buckets: list[int],
        compile_backend: str | None = None,
        reroute: bool = True,
    ) -> None:
        """`compile_backend` ("inductor"; "eager" only checks tracing): each (bucket, frames) graph captures the
        chunk decode compiled by torch.compile (model.compiled_regions) instead of eager PyTorch.
        `reroute=False`: every call runs its own bucket's graph (batch-invariant decoding must not change kernels
        with the load)."""
        if decoder.max_slots < n_sessions + max(batch_buckets) - 1:
            raise ValueError("the streaming decoder needs spare slots for padding rows (max_slots ≥ 2·n_sessions)")
        self.decoder = decoder
        self.n_sessions = n_sessions
        self.buckets = sorted(batch_buckets)
        self.rows = decoder.codec.config.quantizer.n_groups * decoder.codec.config.quantizer.n_codebooks
        self.compile_backend = compile_backend
        self.reroute = reroute
        # (bucket, frames) → (graph, its static codes, slots, audio)
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._pool = torch.cuda.graph_pool_handle()
        # Warm-ups and captures run on a stream of their own. torch.cuda.graph's default capture stream is shared by
        # every graph of the process, and cuBLAS's workspace is chosen by the capturing stream and baked into the
        # graph: a vocoder graph replayed beside a decode step (Backend.vocoder_stream) would then share the step's
        # workspace. A high-priority stream: torch's pool never hands it out as the default capture stream.
        self._capture_stream = torch.cuda.Stream(priority=-1)
        self.replay_ms: dict[tuple[int, int], float] = {}  # each captured graph's replay time
        self.last_rows_run = 0  # rows the last decode ran, padding included (for the caller's accounting)
        self.last_replay_ms = 0.0  # what the last decode's replays took when timed alone at capture (`replay_ms`)
        self.rerouted_calls = 0  # calls run on another bucket's graph than their own (`plan`)
        self.captures = 0  # graphs captured (at start-up, in idle time, or on first use inside a turn)
        self._rerouted: set[tuple[int, int]] = set()  # (batch, frames) shapes whose reroute was logged

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
        stream = self._capture_stream
        stream.wait_stream(torch.cuda.current_stream())
        with compiled(self.compile_backend):
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm-up; the first call also compiles, when compiling
                    self.decoder.decode(codes, slots)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool, stream=stream):
                out = self.decoder.decode(codes, slots)
        self.captures += 1
        # timed on the spare slots, whose state is restored next
        self.replay_ms[(bucket, frames)] = replay_ms(graph, TIMING_REPLAYS)
        self.decoder.state[spare] = saved
        self._graphs[(bucket, frames)] = (graph, codes, slots, out)

    def plan(self, batch: int, frames: int) -> tuple[int, int]:
        """(bucket, replays) for a call of `batch` rows (see `cheapest_plan`); only captured graphs are candidates."""
        own = self.bucket(batch)
        if not self.reroute:
            return own, 1
        times = {b: ms for (b, f), ms in self.replay_ms.items() if f == frames}
        bucket, replays = cheapest_plan(batch, own, times, REROUTE_BELOW)
        if (bucket, replays) != (own, 1) and (batch, frames) not in self._rerouted:
            self._rerouted.add((batch, frames))
            log.info(
                "vocoder: %d × %d frames runs as %d × the %d-row graph (%.1f ms) instead of its own %d-row graph "
                "(%.1f ms)", batch, frames, replays, bucket, replays * times[bucket], own, times[own],
            )  # fmt: skip
        return bucket, replays

    @torch.inference_mode()
    def decode(self, codes: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """codes (B, rows, F) and slots (B,) on the device → audio (B, F·spf), via the cheapest captured graph (its own
        bucket's, captured now if missing, unless `plan` finds a faster one). The audio may be a view of a graph's
        static output, overwritten by the next call of the same shape: copy it to keep it."""
        batch, _, frames = codes.shape
        own = self.bucket(batch)
        if (own, frames) not in self._graphs:
            self.capture(own, frames)
        bucket, replays = self.plan(batch, frames)
        self.last_rows_run = bucket * replays
        self.last_replay_ms = replays * self.replay_ms.get((bucket, frames), 0.0)
        self.rerouted_calls += bucket != own
        if replays == 1:
            return self._replay(bucket, codes, slots)
        return torch.cat(
            [
                self._replay(bucket, codes[i : i + bucket], slots[i : i + bucket]).clone()
                for i in range(0, batch, bucket)
            ]
        )

    def _replay(self, bucket: int, codes: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        graph, codes_in, slots_in, out = self._graphs[(bucket, codes.shape[-1])]
        batch = codes.shape[0]
        codes_in[:batch].copy_(codes)
        slots_in[:batch].copy_(slots)
        if bucket > batch:  # padding rows write to spare slots nobody owns
            slots_in[batch:].copy_(torch.arange(self.n_sessions, self.n_sessions + bucket - batch, device=slots.device))
        graph.replay()
        return out[:batch]

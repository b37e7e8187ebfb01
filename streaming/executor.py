"""The executor: carries the scheduler's plans out on the model, and owns all device state the worker uses.

It holds the backend (the only door into `model/`), the KV-row table with each row's host mirror of its write
position, the voice-prefix rows, and the deferred row swaps of a step. It writes prompt chunks, starts segments,
steps the decode batch and launches vocoder calls. Device fields are written only by their owners (the stepper sets
its own positions through `Backend.set_row_position`). Policy lives in `streaming.scheduler`; sessions, events and
the turn's order live in `streaming.worker`. Runs on the worker thread.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import numpy as np
import torch

from .backend import Backend, RowSampling, history_is_append
from .rows import RowTable
from .stream_state import PrefillJob, Stream


class Executor:
    def __init__(self, backend: Backend) -> None:
        self.b = backend
        self.rows = RowTable(backend.session_rows)
        # host mirror of the stepper's positions: each row's write position (= its count of valid KV positions)
        self.row_pos = [0] * backend.stepper.n_rows
        # voice prefixes (system + references) already in a KV row: key → (row, length), least recently used first
        self.prefix_cache: collections.OrderedDict[bytes, tuple[int, int]] = collections.OrderedDict()
        self.free_prefix_rows = list(backend.prefix_rows)
        self._pending_swaps: list[tuple[int, int]] | None = None  # see apply_swaps

    # ---- rows --------------------------------------------------------------------------------------------------------
    def open_row(self, session: int) -> int:
        row = self.rows.open(session)
        self._set_position(row, 0)
        return row

    def close_row(self, session: int) -> None:
        if self._pending_swaps is not None:  # device writes by row follow: the rows must be where the table says
            self.flush_swaps()  # (the rest of this step's swaps then apply one by one)
        self.leave_batch(session)
        self._set_position(self.rows.row[session], 0)  # the device position stays equal to its host mirror
        self.rows.close(session)

    def join_batch(self, st: Stream) -> None:
        """A stream whose first frame is sampled joins the decode batch (rows [0, active))."""
        sid = st.session.id
        self.row_pos[self.rows.row[sid]] = st.prompt_end  # its row may have moved in a swap since its prefill
        self.apply_swaps(self.rows.activate(sid))

    def leave_batch(self, session: int) -> None:
        self.apply_swaps(self.rows.deactivate(session))

    def _set_position(self, row: int, position: int) -> None:
        self.row_pos[row] = position
        self.b.set_row_position(row, position)

    def apply_swaps(self, swaps: list[tuple[int, int]]) -> None:
        """Mirror RowTable swaps on the device; row_pos[r] is also the count of valid KV positions of row r. Inside
        `swaps_deferred` the device part waits, then moves every row of the step's swaps at once."""
        for a, b in swaps:
            if self._pending_swaps is not None:
                self._pending_swaps.append((a, b))
            else:
                self.b.swap_rows(a, b, self.row_pos[a], self.row_pos[b])
            self.row_pos[a], self.row_pos[b] = self.row_pos[b], self.row_pos[a]

    @contextmanager
    def swaps_deferred(self) -> Iterator[None]:
        """While a step's frames are accepted, segments that end swap rows; the device moves them all at once after
        (one permutation instead of ~33 device ops per swap through the spare row: dozens of segments ending in one
        turn made steps of 45–114 ms on an H200)."""
        self._pending_swaps = []
        try:
            yield
        finally:
            self.flush_swaps()

    def flush_swaps(self) -> None:
        swaps, self._pending_swaps = self._pending_swaps or [], None
        holds: dict[int, int] = {}  # row → the row whose stream it holds now
        for a, b in swaps:
            holds[a], holds[b] = holds.get(b, b), holds.get(a, a)
        moved = [(dst, src) for dst, src in holds.items() if dst != src]
        if moved:
            length = max(self.row_pos[dst] for dst, _ in moved)  # the mirror is already permuted
            self.b.permute_rows([d for d, _ in moved], [s for _, s in moved], length)

    # ---- prompts -----------------------------------------------------------------------------------------------------
    def segment_prompt(self, st: Stream, seg_tokens: torch.Tensor, condition: bool) -> tuple[torch.Tensor, int]:
        """Tokens to write and where: append to the row when that equals upstream's prompt, else rebuild."""
        parts = [*st.history, seg_tokens]
        if condition and st.history and st.last_frame is not None:
            budget = self.b.builder.history_budget(st.prefix, self.b.history_max_length)
            if history_is_append([p.shape[1] for p in parts], budget):
                last = torch.from_numpy(st.last_frame).to(torch.int32).view(-1, 1)
                return torch.cat([last, seg_tokens], dim=1), st.cache_len
            prompt = self.b.builder.segment_prompt(st.prefix, parts, self.b.history_max_length)
        else:
            prompt = seg_tokens if st.prefix is None else torch.cat([st.prefix, seg_tokens], dim=1)
            if not condition:
                st.history = []  # each segment stands alone
        if st.prefix is not None and not st.prefix_cached:
            self._reuse_prefix(st)
        # reuse the cached prefix when the new prompt starts with it
        if st.prefix_cached and st.prefix is not None and st.cache_len >= st.prefix_len:
            return prompt[:, st.prefix_len :], st.prefix_len
        return prompt, 0

    def write_prompts(self, batch: Sequence[tuple[Stream, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the next `take` tokens of each stream's prompt in one backend call; the logits and hidden states of
        each prompt's last written position (read by `start_segments` for the prompts that are complete)."""
        rows = [self.rows.row[st.session.id] for st, _ in batch]
        jobs: list[PrefillJob] = []
        for st, _ in batch:
            assert st.prefill is not None, "only streams with a prompt to write are planned"
            jobs.append(st.prefill)
        logits, hidden = self.b.prefill_many(
            rows,
            [job.tokens[:, job.done : job.done + take] for job, (_, take) in zip(jobs, batch, strict=True)],
            [job.next_pos for job in jobs],
        )
        for (st, take), row, job in zip(batch, rows, jobs, strict=True):
            job.done += take
            if st.prefix is not None and job.start_pos == 0 and job.done >= st.prefix_len and not st.prefix_cached:
                st.prefix_cached = True
                self._remember_prefix(st, row)
            self._set_position(row, job.next_pos)  # idle decode writes land past the valid positions
        return logits, hidden

    def _reuse_prefix(self, st: Stream) -> None:
        """Copy a cached voice prefix into this stream's row instead of prefilling it again."""
        hit = self.prefix_cache.get(st.prefix_key)
        if hit is None:
            return
        src, length = hit
        self.prefix_cache.move_to_end(st.prefix_key)
        row = self.rows.row[st.session.id]
        self.b.copy_prefix(src, row, length)
        self.row_pos[row] = length
        st.prefix_cached = True
        st.cache_len = length

    def _remember_prefix(self, st: Stream, row: int) -> None:
        """Keep a just-prefilled voice prefix in a prefix row (least recently used one evicted)."""
        if st.prefix_key in self.prefix_cache or not self.b.prefix_rows:
            return
        if self.free_prefix_rows:
            dst = self.free_prefix_rows.pop()
        else:
            _, (dst, _) = self.prefix_cache.popitem(last=False)
        self.b.copy_prefix(row, dst, st.prefix_len)
        self.row_pos[dst] = st.prefix_len
        self.prefix_cache[st.prefix_key] = (dst, st.prefix_len)

    # ---- decoding ----------------------------------------------------------------------------------------------------
    def start_segments(self, streams: Sequence[Stream], logits: torch.Tensor, hidden: torch.Tensor) -> np.ndarray:
        """Sample the first frames of streams whose prompts are written, in one call (before they join the batch)."""
        rows = [self.rows.row[st.session.id] for st in streams]
        for st, row in zip(streams, rows, strict=True):
            s = st.session.settings
            self.b.set_sampling(row, RowSampling(s.temperature, s.top_p, s.repetition_penalty, st.seed))
            self.b.set_noise_step(row, st.noise_step)
        return self.b.start_segments(rows, logits, hidden, [st.prompt_end for st in streams])

    def step(self, commit: list[bool], collect: Callable[[], None] | None) -> np.ndarray:
        """Advance rows [0, active) by one frame where `commit` says so (the others compute and discard); `collect`
        runs while the device works (the vocoder's audio of this turn)."""
        active = self.rows.active
        bucket, _ = self.b.stepper.bucket_for(active, 0)
        frames = self.b.step(active, commit, max(self.row_pos[:bucket]), collect)
        for r in range(active):
            self.row_pos[r] += commit[r]
        return frames

    # ---- vocoder -----------------------------------------------------------------------------------------------------
    def launch_vocode(self, chunks: Sequence[tuple[Stream, int, bool]]) -> Callable[[], list[np.ndarray]]:
        """Take each chunk's frames off its stream's queue and launch their vocoding in one backend call; returns
        what waits for the audio."""
        slots, codes = [], []
        for st, size, _ in chunks:
            slots.append(st.slot)
            codes.append(np.stack(st.vocoder_queue[:size], axis=1))  # (nc, F)
            del st.vocoder_queue[:size]
        return self.b.vocode_launch(slots, codes)

"""What the worker remembers about one session (a "stream"): its prompt history, current segment and vocoder queue.

Pure state and small pure helpers (no torch at run time); touched only by the worker thread. The worker drives
it, the scheduler reads it. Token tensors are kept on the CPU; the KV row holds their positions [0, cache_len) on
the device.
"""

from __future__ import annotations

import collections
import math
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

import numpy as np

from .chunking import ChunkSchedule
from .session import Session

if TYPE_CHECKING:
    import torch


class Phase(Enum):
    IDLE = "idle"  # no segment in flight (waiting for text)
    PREFILL = "prefill"  # prompt tokens being written into the KV row (possibly over several loop turns)
    DECODE = "decode"  # in the decode batch


@dataclass
class PrefillJob:
    tokens: torch.Tensor  # (1+nc, T) still to write
    start_pos: int
    done: int = 0  # tokens written so far

    @property
    def next_pos(self) -> int:
        return self.start_pos + self.done

    @property
    def remaining(self) -> int:
        return self.tokens.shape[1] - self.done


@dataclass
class Segment:
    """A segment being generated. Its frames (1+nc codes each, incl. a final <|im_end|> frame) are written into one
    array allocated at the first frame, so ending a segment slices instead of stacking hundreds of small arrays (on
    the H200, turns where dozens of segments ended spent 20–40 ms in frame handling and segment ends)."""

    utterance: int
    text: str
    max_frames: int
    count: int = 0
    _buffer: np.ndarray | None = None  # (max_frames, 1+nc)

    def append(self, frame: np.ndarray) -> None:
        if self._buffer is None:
            self._buffer = np.empty((max(self.max_frames, 1), frame.shape[0]), dtype=frame.dtype)
        self._buffer[self.count] = frame
        self.count += 1

    @property
    def frames(self) -> np.ndarray:
        """(count, 1+nc): a view of the frames so far."""
        if self._buffer is None:
            return np.empty((0, 0), dtype=np.int64)
        return self._buffer[: self.count]


@dataclass
class FirstAudioMarks:
    """Monotonic times on an utterance's way to its first audio (worker side)."""

    text_at: float  # its text reached the worker
    started_at: float | None = None  # its first segment started (prompt queued)
    decoding_at: float | None = None  # that segment's first frame was sampled


@dataclass
class Stream:
    session: Session
    slot: int  # vocoder state slot (stable for the session's life); KV rows move (see RowTable)
    seed: int
    schedule: ChunkSchedule
    prefix: torch.Tensor | None  # system + references, or None
    prefix_key: bytes = b""  # identifies the prefix in the worker's voice-prefix cache
    phase: Phase = Phase.IDLE
    # (utterance, text, (model text, segment tokens) when prepared off the worker thread, else None)
    pending: collections.deque[tuple[int, str, Any]] = field(default_factory=collections.deque)
    ended_utterances: set[int] = field(default_factory=set)
    failed_utterances: set[int] = field(default_factory=set)
    history: list[torch.Tensor] = field(default_factory=list)  # [seg0, gen0, …] of the current utterance
    history_utterance: int = -1
    cache_len: int = 0  # valid KV positions of the row
    prefix_cached: bool = False  # the row holds the prefix at [0, len(prefix))
    last_frame: np.ndarray | None = None  # generated but never fed (needed to append the next segment)
    segment: Segment | None = None
    # the utterance of an ended segment whose last queued frames wait to be vocoded (Worker._flush_tails), else None
    tail_utterance: int | None = None
    prefill: PrefillJob | None = None
    prompt_end: int = 0  # position after the current segment's prompt
    noise_step: int = 0
    vocoder_queue: list[np.ndarray] = field(default_factory=list)  # codes (nc,) awaiting the vocoder
    chunk_index: int = 0
    utterance_samples: int = 0
    utterance_started_s: float | None = None  # wall clock of the utterance's first audio
    # utterance → its way to first audio so far; dropped at its first audio (WorkerStats.first_audio_*), a cancel,
    # a failure or its end
    first_audio_marks: dict[int, FirstAudioMarks] = field(default_factory=dict)
    stalled_since: float | None = None
    closed: bool = False

    @property
    def prefix_len(self) -> int:
        return 0 if self.prefix is None else self.prefix.shape[1]

    def frames_cap(self, text: str, max_new_tokens: int, frames_per_char: float | None) -> int:
        """Per-segment frame budget: max_new_tokens, capped for untrained models by the text length."""
        if frames_per_char is None:
            return max_new_tokens
        return min(max_new_tokens, math.ceil(frames_per_char * len(text)) + 4)

    def client_buffer_s(self, sample_rate_hz: int, now: float | None = None) -> float:
        """Audio the client should still have buffered if it plays in real time from the first chunk on, waiting
        whenever it runs dry (negative: it has been dry that long)."""
        if self.utterance_started_s is None:
            return 0.0
        elapsed = (now if now is not None else time.monotonic()) - self.utterance_started_s
        return self.utterance_samples / sample_rate_hz - elapsed

    def count_sent_audio(self, samples: int, sample_rate_hz: int, now: float) -> None:
        """Audio posted to the client. A player that ran dry waited and resumes with this chunk, so a gap moves the
        playback clock on instead of leaving the estimate short by the gap for the rest of the utterance (which
        would restart the chunk schedule and trigger refills and prefill holds long after the client caught up)."""
        if self.utterance_started_s is None:
            self.utterance_started_s = now
        else:
            self.utterance_started_s += max(0.0, -self.client_buffer_s(sample_rate_hz, now))
        self.utterance_samples += samples

    def start_utterance_history(self, utterance: int) -> None:
        """A new utterance starts with a fresh history (the prefix stays cached in the row)."""
        if self.history_utterance != utterance:
            self.history = []
            self.history_utterance = utterance
            self.cache_len = self.prefix_len if self.prefix_cached else 0
            self.last_frame = None
            self.utterance_samples = 0
            self.utterance_started_s = None
            self.chunk_index = 0

"""A session as the async side sees it: speak text, end or cancel utterances, and read events.

Owns the thread boundary: commands go to the engine's bounded command queue; events come back from the worker
through `Outbox` (one `loop.call_soon_threadsafe` per flush) into a local deque. Backpressure is counted, not
blocked: the worker stalls a session whose undelivered audio exceeds the engine's limit (`posted − consumed`, each
counter written by one thread only). Knows nothing about models or the wire.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .chunking import Latency
from .errors import SessionClosed, TextTooLong


@dataclass(frozen=True, slots=True)
class Voice:
    """Reference voices of a session: (transcript, codes (nc, T)) pairs, or none (the model's own voice)."""

    references: tuple[tuple[str, np.ndarray], ...] = ()


@dataclass(frozen=True, slots=True)
class SynthesisSettings:
    temperature: float = 0.7
    top_p: float = 0.7
    repetition_penalty: float = 1.2
    max_new_tokens: int = 1024  # frames per text segment, as Fish
    seed: int | None = None  # None: a random seed per session
    condition_on_previous_chunks: bool = True
    latency: Latency = Latency.BALANCED
    max_audio_s: float = 600.0  # per-utterance audio cap


# ---- events (worker → session) ---------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class AudioChunk:
    utterance: int
    pcm: np.ndarray  # float32 mono at the model's sample rate


@dataclass(frozen=True, slots=True)
class SegmentDone:
    utterance: int
    text: str
    frames: int  # frames vocoded for this segment
    ended_by: str  # "end_token" | "max_new_tokens" | "max_audio"
    codes: np.ndarray  # (nc, frames) the codes that were vocoded (for offline checks and `synth`)


@dataclass(frozen=True, slots=True)
class UtteranceDone:
    utterance: int
    reason: str  # "stop" | "max_audio" | "error" (a segment failed; a SessionError came before)
    audio_samples: int


@dataclass(frozen=True, slots=True)
class Cancelled:
    utterance: int


@dataclass(frozen=True, slots=True)
class SessionError:
    code: str
    message: str
    utterance: int | None = None
    fatal: bool = False  # True: the session is closed


Event = AudioChunk | SegmentDone | UtteranceDone | Cancelled | SessionError


# ---- commands (session → worker) -------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Speak:
    session: int
    utterance: int
    text: str
    # (model text, segment tokens) worked out off the worker thread (Engine._send), or None: the worker does it
    prepared: tuple[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class EndUtterance:
    session: int
    utterance: int


@dataclass(frozen=True, slots=True)
class Cancel:
    session: int
    utterance: int


@dataclass(frozen=True, slots=True)
class Close:
    session: int


log = logging.getLogger(__name__)

_session_ids = itertools.count(1)


@dataclass(eq=False)
class Session:
    """Handle returned by Engine.open_session; use from one event loop."""

    voice: Voice
    settings: SynthesisSettings
    _send: Callable[[object], None]
    _loop: asyncio.AbstractEventLoop
    id: int = field(default_factory=lambda: next(_session_ids))
    utterance: int = 0
    closed: bool = False
    posted_samples: int = 0  # written by the worker only
    consumed_samples: int = 0  # written by the event loop only
    _events: collections.deque[Event] = field(default_factory=collections.deque)
    _wakeup: asyncio.Event = field(default_factory=asyncio.Event)
    _dropped_utterances: set[int] = field(default_factory=set)
    _close_sent: bool = False  # the engine was told (Close): its capacity is free again
    max_queued_chars: int = 50_000  # text sent to speak() but not yet spoken, all utterances together
    _queued_chars: dict[int, int] = field(default_factory=dict)  # per utterance; event loop only

    # -- commands --
    def speak(self, text: str) -> int:
        """Queue text (one segment) for the current utterance; returns the utterance number. Text waiting to be
        spoken is capped at `max_queued_chars` (TextTooLong beyond: wait for the audio to catch up)."""
        self._check_open()
        speakable = bool(text.strip())  # the worker ignores blank text: it is not queued work, no SegmentDone frees it
        if speakable:
            self.check_room(len(text))
        self._send(Speak(self.id, self.utterance, text))
        if speakable:
            self._queued_chars[self.utterance] = self._queued_chars.get(self.utterance, 0) + len(text)
        return self.utterance

    def check_room(self, chars: int) -> None:
        """TextTooLong unless `chars` more characters fit under `max_queued_chars` (a caller about to split text into
        several speak() calls checks it whole first, so that no part of it is queued)."""
        queued = self.queued_chars
        if queued + chars > self.max_queued_chars:
            raise TextTooLong(
                f"{queued} characters of this session are still waiting to be spoken and at most "
                f"{self.max_queued_chars} may wait (--max-queued-chars); send more once the audio catches up"
            )

    @property
    def queued_chars(self) -> int:
        """Text sent to speak() whose segment has not finished yet."""
        return sum(self._queued_chars.values())

    def end_utterance(self) -> int:
        """No more text for this utterance: its audio finishes, then UtteranceDone. The next speak() starts anew."""
        self._check_open()
        utt = self.utterance
        self._send(EndUtterance(self.id, utt))
        self.utterance += 1
        return utt

    def cancel(self, utterance: int | None = None) -> int:
        """Barge-in: stop generating now, drop queued text and undelivered audio; Cancelled follows.

        Cancels the current utterance, or an earlier one that `end_utterance` closed but whose audio still flows.
        """
        self._check_open()
        utt = self.utterance if utterance is None else utterance
        self._dropped_utterances.add(utt)
        kept: collections.deque[Event] = collections.deque()
        for ev in self._events:
            if isinstance(ev, AudioChunk) and ev.utterance == utt:
                self.consumed_samples += len(ev.pcm)
            else:
                kept.append(ev)
        self._events = kept
        self._send(Cancel(self.id, utt))
        if utt == self.utterance:
            self.utterance += 1
        return utt

    def close(self) -> None:
        self.closed = True
        if not self._close_sent:
            self._close_sent = True
            self._send(Close(self.id))

    def _check_open(self) -> None:
        if self.closed:
            raise SessionClosed("this session is closed; open a new one")

    # -- events --
    @property
    def undelivered_samples(self) -> int:
        return self.posted_samples - self.consumed_samples

    async def next_event(self) -> Event:
        while not self._events:
            self._wakeup.clear()
            await self._wakeup.wait()
        ev = self._events.popleft()
        if isinstance(ev, AudioChunk):
            self.consumed_samples += len(ev.pcm)
        return ev

    def deliver(self, ev: Event) -> None:
        """Worker → loop (called via call_soon_threadsafe)."""
        if isinstance(ev, AudioChunk) and ev.utterance in self._dropped_utterances:
            self.consumed_samples += len(ev.pcm)
            return
        if isinstance(ev, SegmentDone):
            left = self._queued_chars.get(ev.utterance, 0) - len(ev.text)
            if left > 0:
                self._queued_chars[ev.utterance] = left
            else:
                self._queued_chars.pop(ev.utterance, None)
        elif isinstance(ev, UtteranceDone | Cancelled):  # whatever of it was still queued is dropped
            self._queued_chars.pop(ev.utterance, None)
        if isinstance(ev, SessionError) and ev.fatal:
            # the worker has dropped the stream; the engine's session count must drop too, whether or not the owner
            # ever calls close() (a stalled client's session used to hold its capacity for good)
            self.close()
        self._events.append(ev)
        self._wakeup.set()

    def count_posted(self, ev: Event) -> None:
        """Worker thread (through `Outbox.post`): the audio now on its way counts against the back-pressure limit
        from this moment."""
        if isinstance(ev, AudioChunk):
            self.posted_samples += len(ev.pcm)


class Outbox:
    """The worker's events on their way to the sessions' event loops: collected while the worker works, then handed
    over by `flush` in one call per loop — one wake-up of the server's loop a flush instead of one per event (an H200
    profile at 384 streams: 2.8 % of the worker's samples went to writing the loop's wake-up pipe, 5.8 % of the
    loop's to reading it). Each session's events keep their order. Worker thread only."""

    def __init__(self) -> None:
        self._items: list[tuple[Session, Event]] = []

    def post(self, session: Session, ev: Event) -> None:
        session.count_posted(ev)
        self._items.append((session, ev))

    def __len__(self) -> int:
        return len(self._items)

    def flush(self) -> None:
        if not self._items:
            return
        items, self._items = self._items, []
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Session, Event]]] = {}
        for session, ev in items:
            by_loop.setdefault(session._loop, []).append((session, ev))
        for loop, batch in by_loop.items():
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody is listening any more
                loop.call_soon_threadsafe(_deliver_all, batch)


def _deliver_all(batch: list[tuple[Session, Event]]) -> None:
    """Loop thread: deliver a flush's events in order; one that fails is logged and the others still arrive (as
    when each event was its own callback)."""
    for session, ev in batch:
        try:
            session.deliver(ev)
        except Exception:
            log.exception("delivering %s to session %s failed", type(ev).__name__, session.id)

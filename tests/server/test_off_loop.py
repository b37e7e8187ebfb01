"""Large bodies and frames are decoded on a worker thread, small ones on the event loop (server.http_common)."""

from __future__ import annotations

import asyncio
import threading

from server.http_common import OFF_LOOP_BYTES, off_loop_if_large


def test_only_large_inputs_leave_the_event_loop() -> None:
    async def main():
        loop_thread = threading.current_thread()
        small = await off_loop_if_large(OFF_LOOP_BYTES, threading.current_thread)
        large = await off_loop_if_large(OFF_LOOP_BYTES + 1, threading.current_thread)
        return loop_thread, small, large

    loop_thread, small, large = asyncio.run(main())
    assert small is loop_thread and large is not loop_thread


def test_light_audio_is_encoded_on_the_loop_and_the_rest_on_a_thread(monkeypatch) -> None:
    """Raw or WAV chunks at the vocoder's rate stay on the loop (no thread hand-off per chunk); resampling, time-
    stretching, compressed formats and oversized chunks go to a worker thread. The bytes are the same either way."""
    import numpy as np

    from server.http_common import INLINE_ENCODE_SAMPLES, encode_audio
    from streaming.audio_out import AudioOutput, OutputFormat

    where: list[bool] = []  # True: pushed on the loop's thread
    loop_thread: list[threading.Thread] = []
    real_push = AudioOutput.push

    def push(self, pcm):
        where.append(threading.current_thread() is loop_thread[0])
        return real_push(self, pcm)

    monkeypatch.setattr(AudioOutput, "push", push)
    pcm = (np.random.default_rng(0).standard_normal(4096) * 0.3).astype(np.float32)
    cases = {
        "pcm": (OutputFormat(format="pcm"), pcm, True),
        "wav": (OutputFormat(format="wav"), pcm, True),
        "resampled": (OutputFormat(format="pcm", sample_rate_hz=24_000), pcm, False),
        "stretched": (OutputFormat(format="pcm", speed=1.5), pcm, False),
        "mp3": (OutputFormat(format="mp3"), pcm, False),
        "oversized": (OutputFormat(format="pcm"), np.zeros(INLINE_ENCODE_SAMPLES + 1, np.float32), False),
    }

    async def main() -> None:
        loop_thread.append(threading.current_thread())
        for name, (fmt, x, on_loop) in cases.items():
            where.clear()
            got = await encode_audio(AudioOutput(fmt), x)
            assert where == [on_loop], name
            assert got == real_push(AudioOutput(fmt), x), name  # a fresh pipeline, pushed directly

    asyncio.run(main())

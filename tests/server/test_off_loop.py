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

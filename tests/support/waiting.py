"""Polling a condition from a coroutine, with a deadline."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


async def wait_until(condition: Callable[[], bool], what: str = "the condition",
                     timeout: float = 10.0, interval: float = 0.005) -> None:
    """Polls `condition()` on the running event loop until it holds; fails after `timeout` s."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        assert loop.time() < deadline, f"timed out after {timeout} s waiting for {what}"
        await asyncio.sleep(interval)

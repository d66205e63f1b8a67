"""Work moved off an asyncio event loop onto a thread.

A copy, checksum or decode of megabytes holds a loop for milliseconds, and every other
request on it waits; a small one is cheaper on the loop than the hop to a thread and
back (~50-100 µs here). One threshold for all of them, so the trade-off is decided (and
re-measured) in one place.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

OFFLOAD_FROM = 1 << 20
"""Bytes of work from which a service runs it on a thread rather than on its loop. Read
as `offload.OFFLOAD_FROM` at the call (not imported by name), so a test can lower it."""


async def offload(
    fn: Callable[..., T], *args: Any, abandoned: Callable[[asyncio.Future[T]], None] | None = None
) -> T:
    """fn(*args) on a worker thread, awaited.

    A thread cannot be stopped: when the caller is cancelled, fn runs on. `abandoned`
    is then called with its future once it has ended, to release what fn was using
    (buffers it writes into) or made (a buffer it returns), which the cancelled caller
    can no longer do; it is not called when the caller gets the outcome."""
    work = asyncio.ensure_future(asyncio.to_thread(fn, *args))
    try:
        return await asyncio.shield(work)
    except asyncio.CancelledError:
        work.add_done_callback(abandoned or _retrieve)
        raise


def _retrieve(fut: asyncio.Future[Any]) -> None:
    # Nobody awaits it any more: its failure is read here, not reported as never read.
    if not fut.cancelled():
        fut.exception()

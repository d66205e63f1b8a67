"""An asyncio event loop on a daemon thread, driven from synchronous callers.

The inference engine calls the worker engine from its own thread; lower tiers (disk,
remote, peers) are asyncio code. This thread owns the loop; callers hand it
coroutines and wait on the result with a deadline.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable, Coroutine
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class LoopThread:
    """Runs one asyncio loop (uvloop when installed) until `stop()`."""

    def __init__(self, name: str = "kvmesh-loop") -> None:
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        # Set by stop() before the loop cancels what it runs: a caller whose wait ends
        # in that cancel tells a shutdown from a cancel meant for it.
        self._stopping = False
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()
        self._ready.wait()

    def _main(self) -> None:
        try:
            import uvloop

            loop = uvloop.new_event_loop()
        except ImportError:
            loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        self._loop = loop
        self._ready.set()
        try:
            loop.run_forever()
        finally:
            self._stopping = True
            pending = asyncio.all_tasks(loop)
            for task in pending:
                task.cancel()
            if pending:
                loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        assert self._loop is not None
        return self._loop

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    @property
    def stopping(self) -> bool:
        """Whether the loop was told to stop (or ended): work on it is being cancelled."""
        return self._stopping or not self._thread.is_alive()

    def in_loop_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule a coroutine; the returned future can be waited on from any thread."""
        if not self.running:
            coro.close()
            raise RuntimeError("the engine's event loop is stopped")
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(
        self,
        coro: Coroutine[Any, Any, T],
        timeout: float | None,
        orphan: Callable[[T], None] | None = None,
    ) -> T:
        """Run a coroutine on the loop and wait for it; on timeout it is cancelled.

        A result that was there when the wait ended is returned, though the future may
        not say so yet (the loop marks it done a turn later). One that comes after it,
        before the cancellation lands, goes to `orphan`: results that hold references
        (a get's buffers) need someone to drop them."""
        if self.in_loop_thread():
            coro.close()
            raise RuntimeError("LoopThread.run called from the loop thread would deadlock")
        if not self.running:
            coro.close()  # never started: not a "never awaited" warning at shutdown
            raise RuntimeError("the engine's event loop is stopped")
        handoff = _Handoff(orphan)
        fut = self.submit(handoff.wrap(coro))
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError:
            done, value = handoff.abandon()
            if done:
                return value  # type: ignore[return-value]
            fut.cancel()
            raise TimeoutError(f"engine operation did not finish within {timeout}s") from None

    def call_soon(self, fn: Any, *args: Any) -> None:
        self.loop.call_soon_threadsafe(fn, *args)

    def stop(self, timeout: float = 5.0) -> None:
        """Cancel what runs on the loop, stop it and join the thread."""
        self._stopping = True
        if self._thread.is_alive() and self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout)
        if self._thread.is_alive():
            raise RuntimeError(f"event loop thread did not stop within {timeout}s")


class _Handoff(Generic[T]):
    """A coroutine's result, handed over once: to the caller while it waits, else to
    `orphan`."""

    def __init__(self, orphan: Callable[[T], None] | None) -> None:
        self._orphan = orphan
        self._lock = threading.Lock()
        self._abandoned = False
        self._done = False
        self._value: T | None = None

    async def wrap(self, coro: Coroutine[Any, Any, T]) -> T:
        value = await coro
        with self._lock:
            abandoned = self._abandoned
            if not abandoned:
                self._done, self._value = True, value
        if abandoned and self._orphan is not None:
            self._orphan(value)
        return value

    def abandon(self) -> tuple[bool, T | None]:
        """The caller gives up: (True, the result) if it was there already."""
        with self._lock:
            self._abandoned = True
            return self._done, self._value

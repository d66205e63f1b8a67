"""A function over items on a thread pool, every job ended before the caller goes on.

Jobs that read or write a caller's buffers (a codec's segments, a transfer's pages)
must not outlive the call: a caller that gets an error, or is cancelled, hands those
buffers back next, and a job still running would then read freed memory or write into
another chunk's page. So once one job fails the ones not yet started are cancelled,
the running ones are waited for, and only then is the first failure (in item order)
raised; a cancelled async caller likewise waits for the running jobs before its
CancelledError goes on. A job is bounded work on memory (a hash, a decode), so the
wait is short.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

T = TypeVar("T")


class LazyPool:
    """A ThreadPoolExecutor made on first use (an import starts no threads), and made
    again in a forked child, where the parent's worker threads do not exist and a
    job submitted to its pool would never run."""

    def __init__(self, workers: Callable[[], int], name: str) -> None:
        self._workers = workers
        self._name = name
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._pid = 0
        self._lock = threading.Lock()
        # A fork while another thread holds the lock leaves it held for good in the
        # child: the child starts from a fresh one.
        os.register_at_fork(after_in_child=self._fresh_lock)

    def _fresh_lock(self) -> None:
        self._lock = threading.Lock()

    def get(self) -> concurrent.futures.ThreadPoolExecutor:
        pool = self._pool
        if pool is None or self._pid != os.getpid():
            with self._lock:
                pool = self._pool
                if pool is None or self._pid != os.getpid():
                    pool = concurrent.futures.ThreadPoolExecutor(
                        max(1, self._workers()), self._name
                    )
                    self._pool, self._pid = pool, os.getpid()
        return pool


def map_all(
    pool: concurrent.futures.Executor, fn: Callable[[Any], T], items: Sequence[Any]
) -> list[T]:
    """[fn(item) for item in items] on pool, blocking; see the module doc."""
    futures = [pool.submit(fn, item) for item in items]
    done, _ = concurrent.futures.wait(futures, return_when=concurrent.futures.FIRST_EXCEPTION)
    if any(f.exception() is not None for f in done):
        _cancel_unstarted(futures)
    concurrent.futures.wait(futures)
    return _outcome(futures)


async def map_all_async(
    pool: concurrent.futures.Executor, fn: Callable[[Any], T], items: Sequence[Any]
) -> list[T]:
    """[fn(item) for item in items] on pool, awaited; see the module doc."""
    futures = [pool.submit(fn, item) for item in items]
    # asyncio.wait never cancels what it waits on, and a wrapper is only cancelled
    # here when its job was, so no wrapper stops waiting while its job still runs.
    wrappers = [asyncio.wrap_future(f) for f in futures]
    pending: set[asyncio.Future[T]] = set(wrappers)
    cancelled: asyncio.CancelledError | None = None
    when = asyncio.FIRST_EXCEPTION
    while pending:
        try:
            done, pending = await asyncio.wait(pending, return_when=when)
        except asyncio.CancelledError as exc:
            cancelled = exc
            _cancel_unstarted(futures)
            when = asyncio.ALL_COMPLETED
            continue
        if any(not w.cancelled() and w.exception() is not None for w in done):
            _cancel_unstarted(futures)
            when = asyncio.ALL_COMPLETED
    for w in wrappers:  # read, so none is reported as an exception never retrieved
        if not w.cancelled():
            w.exception()
    if cancelled is not None:
        raise cancelled
    return _outcome(futures)


def _cancel_unstarted(futures: Iterable[concurrent.futures.Future[Any]]) -> None:
    for f in futures:
        f.cancel()  # a no-op on a job that has started: it runs to its end


def _outcome(futures: Sequence[concurrent.futures.Future[T]]) -> list[T]:
    for f in futures:
        if not f.cancelled():
            exc = f.exception()
            if exc is not None:
                raise exc
    return [f.result() for f in futures]

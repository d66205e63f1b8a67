"""A thread pool that runs the most urgent queued task first.

Each task has a priority (lower runs first) and, within a priority, runs in the order it
was submitted. The disk tier uses three: a read someone waits for (prefetch) before a
delete that frees space before a put that can wait. A task that already runs is never
interrupted: the priorities order the queue, not the threads.

`submit` never blocks and returns a `concurrent.futures.Future`, so asyncio code awaits
it with `asyncio.wrap_future` while the work runs on a pool thread.
"""

from __future__ import annotations

import concurrent.futures
import heapq
import itertools
import threading
from collections.abc import Callable, Iterable
from enum import IntEnum
from typing import Any


class Priority(IntEnum):
    PREFETCH = 0
    DELETE = 1
    PUT = 2


class PriorityExecutor:
    """`threads` workers over one priority queue."""

    def __init__(self, threads: int, name: str = "kvmesh-disk-io") -> None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self.threads = threads
        self._queue: list[tuple[int, int, concurrent.futures.Future, Callable, tuple]] = []
        self._seq = itertools.count()
        self._cond = threading.Condition()
        self._closed = False
        self._running = 0
        self._queued_by_priority: dict[int, int] = {}
        self._threads = [
            threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True)
            for i in range(threads)
        ]
        for t in self._threads:
            t.start()

    def submit(
        self, priority: int, fn: Callable[..., Any], *args: Any
    ) -> concurrent.futures.Future:
        """Queue fn(*args); RuntimeError once shut down."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            if self._closed:
                raise RuntimeError("submit on a shut down PriorityExecutor")
            heapq.heappush(self._queue, (int(priority), next(self._seq), fut, fn, args))
            self._queued_by_priority[priority] = self._queued_by_priority.get(priority, 0) + 1
            self._cond.notify()
        return fut

    def queued(self, priority: int | None = None) -> int:
        """Tasks waiting (of one priority, or all)."""
        with self._cond:
            if priority is None:
                return len(self._queue)
            return self._queued_by_priority.get(priority, 0)

    @property
    def busy(self) -> int:
        """Tasks running now."""
        return self._running

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return  # closed and drained
                priority, _, fut, fn, args = heapq.heappop(self._queue)
                self._queued_by_priority[priority] -= 1
                self._running += 1
            try:
                if fut.set_running_or_notify_cancel():
                    try:
                        result = fn(*args)
                    except BaseException as exc:
                        fut.set_exception(exc)
                    else:
                        fut.set_result(result)
            finally:
                with self._cond:
                    self._running -= 1
                    self._cond.notify_all()

    def wait_idle(
        self, timeout: float | None = None, priorities: Iterable[int] | None = None
    ) -> bool:
        """Wait until nothing (of the given priorities) is queued and nothing runs."""
        wanted = None if priorities is None else {int(p) for p in priorities}

        def idle() -> bool:
            if self._running:
                return False
            if wanted is None:
                return not self._queue
            return not any(self._queued_by_priority.get(p, 0) for p in wanted)

        with self._cond:
            return self._cond.wait_for(idle, timeout)

    def shutdown(self, cancel: Iterable[int] = (), timeout: float | None = 30.0) -> None:
        """Stop taking tasks; cancel the queued ones of the `cancel` priorities (their
        futures' callbacks run), let the rest and the running ones finish, join."""
        drop = {int(p) for p in cancel}
        cancelled: list[concurrent.futures.Future] = []
        with self._cond:
            self._closed = True
            keep = []
            for item in self._queue:
                if item[0] in drop:
                    cancelled.append(item[2])
                    self._queued_by_priority[item[0]] -= 1
                else:
                    keep.append(item)
            heapq.heapify(keep)
            self._queue = keep
            self._cond.notify_all()
        for fut in cancelled:
            fut.cancel()
        for t in self._threads:
            t.join(timeout)

"""Pins taken by a lookup, held until the matching retrieve, a cleanup, or a deadline.

A scheduler counts cached tokens at one moment and loads them later; pinning keeps
what it counted from being evicted in between. A request that never comes back
(aborted, preempted, crashed scheduler) must not hold memory forever, hence the
deadline.
"""

from __future__ import annotations

import heapq
import threading
import time
from collections.abc import Callable, Hashable, Sequence

from kvmesh.common.observability import get_logger

log = get_logger(__name__)

UnpinFn = Callable[[Sequence[Hashable]], None]


class LookupPins:
    """lookup id → pinned keys, released once (by retrieve, cleanup, or expiry)."""

    def __init__(self, unpin: UnpinFn, timeout_s: float) -> None:
        self._unpin = unpin
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._held: dict[str, tuple[float, list[Hashable]]] = {}
        self._deadlines: list[tuple[float, str]] = []  # heap; stale entries skipped

    def hold(self, lookup_id: str, keys: Sequence[Hashable]) -> None:
        """Record pins already taken for lookup_id; a second lookup with the same id
        replaces the first (its pins are released)."""
        deadline = time.monotonic() + self._timeout_s
        with self._lock:
            old = self._held.pop(lookup_id, None)
            self._held[lookup_id] = (deadline, list(keys))
            heapq.heappush(self._deadlines, (deadline, lookup_id))
        if old:
            self._unpin(old[1])

    def release(self, lookup_id: str) -> int:
        """Release the pins of lookup_id; returns how many keys were released."""
        with self._lock:
            entry = self._held.pop(lookup_id, None)
        if entry is None:
            return 0
        if entry[1]:
            self._unpin(entry[1])
        return len(entry[1])

    def expire(self, now: float | None = None) -> int:
        """Release every lookup whose deadline passed; returns how many lookups."""
        now = time.monotonic() if now is None else now
        expired: list[tuple[str, list[Hashable]]] = []
        with self._lock:
            while self._deadlines and self._deadlines[0][0] <= now:
                deadline, lookup_id = heapq.heappop(self._deadlines)
                entry = self._held.get(lookup_id)
                # A released or re-issued lookup leaves a stale heap entry behind.
                if entry is not None and entry[0] == deadline:
                    expired.append((lookup_id, self._held.pop(lookup_id)[1]))
        for lookup_id, keys in expired:
            # Its retrieve never came (aborted, or computed by the engine itself).
            log.debug("lookup pins expired", lookup_id=lookup_id, chunks=len(keys))
            self._unpin(keys)
        return len(expired)

    def release_all(self) -> None:
        with self._lock:
            held = [keys for _, keys in self._held.values()]
            self._held.clear()
            self._deadlines.clear()
        for keys in held:
            self._unpin(keys)

    def __contains__(self, lookup_id: str) -> bool:
        return lookup_id in self._held

    def __len__(self) -> int:
        return len(self._held)

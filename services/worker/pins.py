"""Pins taken by a lookup, held until the matching retrieve, a cleanup, or a deadline.

A scheduler counts cached tokens at one moment and loads them later; pinning keeps
what it counted from being evicted in between. A request that never comes back
(aborted, preempted, crashed scheduler) must not hold memory forever, hence the
deadline.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
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
        # Oldest deadline first: every hold gets the same timeout, so holding (again)
        # moves a lookup to the end and the expired ones are always at the front.
        self._held: OrderedDict[str, tuple[float, list[Hashable]]] = OrderedDict()

    def hold(self, lookup_id: str, keys: Sequence[Hashable]) -> None:
        """Record pins already taken for lookup_id; a second lookup with the same id
        replaces the first (its pins are released)."""
        with self._lock:
            deadline = time.monotonic() + self._timeout_s
            old = self._held.pop(lookup_id, None)
            self._held[lookup_id] = (deadline, list(keys))
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
            while self._held:
                lookup_id, (deadline, keys) = next(iter(self._held.items()))
                if deadline > now:
                    break
                del self._held[lookup_id]
                expired.append((lookup_id, keys))
        for lookup_id, keys in expired:
            # Its retrieve never came (aborted, or computed by the engine itself).
            log.debug("lookup pins expired", lookup_id=lookup_id, chunks=len(keys))
            self._unpin(keys)
        return len(expired)

    def release_all(self) -> None:
        with self._lock:
            held = [keys for _, keys in self._held.values()]
            self._held.clear()
        for keys in held:
            self._unpin(keys)

    def __contains__(self, lookup_id: str) -> bool:
        return lookup_id in self._held

    def __len__(self) -> int:
        return len(self._held)

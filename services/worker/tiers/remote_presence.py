"""What the worker already knows about the remote's keys, so lookups skip round trips.

The inference engine's scheduler asks "how much of this prompt is cached?" every step
for every waiting request, synchronously. A remote round trip per ask would put the
network on the scheduler's critical path, so the remote tier remembers answers:

- **present** (for `present_ttl_s`): keys this worker stored, fetched or saw exist. The
  TTL bounds how long a key evicted by the remote is still counted as a hit (a stale
  hit costs one failed get, and the engine then recomputes).
- **absent** (for `absent_ttl_s`): keys the remote said it does not have; short, so a
  chunk another worker stores shows up within that time.

Bounded to `max_keys` entries (least recently set dropped first); thread-safe.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Sequence

from kvmesh.common.keys import ChunkKey


class PresenceCache:
    def __init__(self, max_keys: int, present_ttl_s: float, absent_ttl_s: float) -> None:
        self.max_keys = max_keys
        self.present_ttl_s = present_ttl_s
        self.absent_ttl_s = absent_ttl_s
        self._known: OrderedDict[ChunkKey, tuple[bool, float]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._known)

    def _state_locked(self, key: ChunkKey, now: float) -> bool | None:
        item = self._known.get(key)
        if item is None:
            return None
        present, expires = item
        if now >= expires:
            del self._known[key]
            return None
        return present

    def get(self, key: ChunkKey) -> bool | None:
        """True/False if known and fresh, None if unknown."""
        with self._lock:
            return self._state_locked(key, time.monotonic())

    def prefix(self, keys: Sequence[ChunkKey]) -> tuple[int, bool | None]:
        """(how many keys from the first are known present, what is known of the next)."""
        now = time.monotonic()
        with self._lock:
            for i, key in enumerate(keys):
                state = self._state_locked(key, now)
                if state is not True:
                    return i, state
        return len(keys), None

    def set(self, key: ChunkKey, present: bool) -> None:
        self.update((key,), (present,))

    def update(self, keys: Sequence[ChunkKey], present: Sequence[bool]) -> None:
        now = time.monotonic()
        with self._lock:
            known = self._known
            for key, here in zip(keys, present, strict=True):
                ttl = self.present_ttl_s if here else self.absent_ttl_s
                if ttl <= 0:
                    known.pop(key, None)
                    continue
                known[key] = (here, now + ttl)
                known.move_to_end(key)
            while len(known) > self.max_keys:
                known.popitem(last=False)

    def discard(self, key: ChunkKey) -> None:
        with self._lock:
            self._known.pop(key, None)

    def clear(self) -> None:
        with self._lock:
            self._known.clear()

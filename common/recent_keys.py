"""A bounded memory of recently seen keys, for telling "evicted" from "never stored".

Both the worker's tiers and the cache-server count a miss of a key they once held and
evicted apart from a miss of a key they never had. Remembering every evicted key would
grow without bound, so only the last `capacity` are kept (insertion order, oldest
forgotten first): memory use is fixed, and a key evicted longer ago than the memory
reaches is reported as never stored.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)

# About 100 bytes of key and dict slot each: ~6.5 MiB at most per memory.
DEFAULT_CAPACITY = 1 << 16


class RecentKeys(Generic[K]):
    """A set of the last `capacity` keys added; thread-safe."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity must be > 0, got {capacity}")
        self.capacity = capacity
        self._keys: OrderedDict[K, None] = OrderedDict()
        self._lock = threading.Lock()

    def add(self, key: K) -> None:
        with self._lock:
            self._keys[key] = None
            self._keys.move_to_end(key)
            if len(self._keys) > self.capacity:
                self._keys.popitem(last=False)

    def discard(self, key: K) -> None:
        with self._lock:
            self._keys.pop(key, None)

    def clear(self) -> None:
        with self._lock:
            self._keys.clear()

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._keys

    def __len__(self) -> int:
        # Under the lock: between an add and its eviction the dict holds one too many.
        with self._lock:
            return len(self._keys)

    def snapshot(self) -> list[K]:
        """The keys, oldest first (a copy)."""
        with self._lock:
            return list(self._keys)

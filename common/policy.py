"""Eviction policies: which cached keys a tier gives up first when it needs room.

A policy only orders keys; the tier owns the objects. The tier reports what happens
(`on_insert`, `on_access` on a hit, `on_remove` whenever a key leaves, evicted or
deleted; `on_restore` for a key found at start, such as a disk file from an earlier
run) and asks `victims(n, can_evict)` for up to n keys in eviction order, skipping
those `can_evict` rejects (pinned or referenced objects are never candidates).
`victims` only proposes: the tier removes what it actually evicts and calls
`on_remove` for each.

Not thread-safe: the tier calls a policy under its own lock, which it holds anyway to
keep its key → object map consistent. `can_evict` must not change the policy.

Every operation is O(1); `victims` is O(keys inspected), which is n unless keys at the
front of the order are skipped. A key reported twice to `on_insert` counts as an
access; `on_access`/`on_remove` of an unknown key raise KeyError, because the tier
and its policy disagreeing is a bug worth surfacing.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Iterator
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)

POLICY_NAMES = ("fifo", "lfu", "lru", "mru")


class EvictionPolicy(ABC, Generic[K]):
    """The interface tiers use; subclasses define the order by `_eviction_order`."""

    name: str

    @abstractmethod
    def on_insert(self, key: K) -> None:
        """A new key was stored (an already present key counts as an access)."""

    @abstractmethod
    def on_restore(self, key: K) -> None:
        """A key found rather than stored (a file left by an earlier run, seen by a
        re-index): older than every key this run stored, and newer than the keys
        restored before it (restore oldest first). It takes the place the policy
        gives old keys (first to go for LRU, FIFO and LFU, last for MRU) until used.
        A present key is left as is."""

    @abstractmethod
    def on_access(self, key: K) -> None:
        """A hit or touch on a present key."""

    @abstractmethod
    def on_remove(self, key: K) -> None:
        """The key left the tier (evicted or deleted)."""

    @abstractmethod
    def _eviction_order(self) -> Iterator[K]:
        """Every key, first to evict first."""

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __contains__(self, key: object) -> bool: ...

    def victims(self, n_needed: int, can_evict: Callable[[K], bool]) -> list[K]:
        """Up to n_needed keys in eviction order, skipping those can_evict rejects.

        Fewer (possibly none) come back when not enough keys are evictable.
        """
        out: list[K] = []
        if n_needed <= 0:
            return out
        for key in self._eviction_order():
            if can_evict(key):
                out.append(key)
                if len(out) == n_needed:
                    break
        return out

    def __iter__(self) -> Iterator[K]:
        """Keys in eviction order (for inspection and tests)."""
        return self._eviction_order()


class _RecencyPolicy(EvictionPolicy[K]):
    """Keys in a dict kept in recency order: oldest first, a touch moves a key last.
    Restored keys wait in a dict of their own, older than all of them, until used."""

    def __init__(self) -> None:
        # A dict keeps insertion order; popping and re-adding a key moves it to the end,
        # which costs the same as OrderedDict.move_to_end with less memory per key.
        self._keys: dict[K, None] = {}
        self._found: dict[K, None] = {}

    def on_insert(self, key: K) -> None:
        keys = self._keys
        keys.pop(key, None)
        if self._found:
            self._found.pop(key, None)
        keys[key] = None

    def on_restore(self, key: K) -> None:
        if key not in self._keys:
            self._found.setdefault(key, None)

    def on_access(self, key: K) -> None:
        keys = self._keys
        try:
            del keys[key]
        except KeyError:  # a restored key, used for the first time
            del self._found[key]
        keys[key] = None

    def on_remove(self, key: K) -> None:
        try:
            del self._keys[key]
        except KeyError:
            del self._found[key]

    def __len__(self) -> int:
        return len(self._keys) + len(self._found)

    def __contains__(self, key: object) -> bool:
        return key in self._keys or key in self._found


class LRUPolicy(_RecencyPolicy[K]):
    """Least recently used first: the default, good when recent prefixes recur."""

    name = "lru"

    def _eviction_order(self) -> Iterator[K]:
        return itertools.chain(self._found, self._keys)


class MRUPolicy(_RecencyPolicy[K]):
    """Most recently used first: for cyclic scans larger than the cache, where the
    key just used is the one needed last."""

    name = "mru"

    def _eviction_order(self) -> Iterator[K]:
        return itertools.chain(reversed(self._keys), reversed(self._found))


class FIFOPolicy(EvictionPolicy[K]):
    """First inserted first out; accesses do not change the order."""

    name = "fifo"

    def __init__(self) -> None:
        self._keys: dict[K, None] = {}
        self._found: dict[K, None] = {}  # restored: arrived before every key of _keys

    def on_insert(self, key: K) -> None:
        # A re-insert keeps the key's place: FIFO ages by first arrival.
        if key not in self._found:
            self._keys.setdefault(key, None)

    def on_restore(self, key: K) -> None:
        if key not in self._keys:
            self._found.setdefault(key, None)

    def on_access(self, key: K) -> None:
        if key not in self._keys and key not in self._found:
            raise KeyError(key)

    def on_remove(self, key: K) -> None:
        try:
            del self._keys[key]
        except KeyError:
            del self._found[key]

    def _eviction_order(self) -> Iterator[K]:
        return itertools.chain(self._found, self._keys)

    def __len__(self) -> int:
        return len(self._keys) + len(self._found)

    def __contains__(self, key: object) -> bool:
        return key in self._keys or key in self._found


class _FreqBucket(Generic[K]):
    """The keys used exactly `freq` times, least recent first; a node of a list of
    buckets kept in increasing frequency."""

    __slots__ = ("freq", "keys", "next", "prev")

    def __init__(self, freq: int) -> None:
        self.freq = freq
        self.keys: dict[K, None] = {}
        self.prev: _FreqBucket[K] | None = None
        self.next: _FreqBucket[K] | None = None


class LFUPolicy(EvictionPolicy[K]):
    """Least frequently used first; among equal counts, the least recently used.

    O(1): buckets of equal frequency form a linked list in increasing frequency, and
    an access moves a key from its bucket to the next one (made if missing). A key's
    place in its bucket is when it reached that count, i.e. its last use, which gives
    the recency tie-break for free.
    """

    name = "lfu"

    def __init__(self) -> None:
        self._bucket_of: dict[K, _FreqBucket[K]] = {}
        self._head: _FreqBucket[K] | None = None  # the lowest frequency

    def frequency(self, key: K) -> int:
        """How many times the key was inserted or accessed (KeyError if absent)."""
        return self._bucket_of[key].freq

    def on_insert(self, key: K) -> None:
        if key in self._bucket_of:
            self.on_access(key)
            return
        head = self._head
        # After the restored keys' bucket (frequency 0), if there is one.
        self._add(key, self._bucket(head if head is not None and head.freq == 0 else None, 1))

    def on_restore(self, key: K) -> None:
        # Frequency 0: not used this run, so before every key stored in it (frequency 1
        # and up); its first use takes it to 1.
        if key not in self._bucket_of:
            self._add(key, self._bucket(None, 0))

    def on_access(self, key: K) -> None:
        bucket = self._bucket_of[key]
        nxt = bucket.next
        if nxt is None or nxt.freq != bucket.freq + 1:  # else the common case, inline
            nxt = self._bucket(bucket, bucket.freq + 1)
        nxt.keys[key] = None
        self._bucket_of[key] = nxt
        del bucket.keys[key]
        if not bucket.keys:
            self._unlink(bucket)

    def _bucket(self, prev: _FreqBucket[K] | None, freq: int) -> _FreqBucket[K]:
        """The bucket of freq right after prev (None: at the head), made if missing."""
        nxt = self._head if prev is None else prev.next
        if nxt is not None and nxt.freq == freq:
            return nxt
        bucket: _FreqBucket[K] = _FreqBucket(freq)
        bucket.prev, bucket.next = prev, nxt
        if nxt is not None:
            nxt.prev = bucket
        if prev is None:
            self._head = bucket
        else:
            prev.next = bucket
        return bucket

    def _add(self, key: K, bucket: _FreqBucket[K]) -> None:
        bucket.keys[key] = None
        self._bucket_of[key] = bucket

    def on_remove(self, key: K) -> None:
        bucket = self._bucket_of.pop(key)
        del bucket.keys[key]
        if not bucket.keys:
            self._unlink(bucket)

    def _unlink(self, bucket: _FreqBucket[K]) -> None:
        if bucket.prev is None:
            self._head = bucket.next
        else:
            bucket.prev.next = bucket.next
        if bucket.next is not None:
            bucket.next.prev = bucket.prev

    def _eviction_order(self) -> Iterator[K]:
        bucket = self._head
        while bucket is not None:
            yield from bucket.keys
            bucket = bucket.next

    def __len__(self) -> int:
        return len(self._bucket_of)

    def __contains__(self, key: object) -> bool:
        return key in self._bucket_of


_POLICIES: dict[str, type[EvictionPolicy]] = {
    "fifo": FIFOPolicy,
    "lfu": LFUPolicy,
    "lru": LRUPolicy,
    "mru": MRUPolicy,
}


def make_policy(name: str) -> EvictionPolicy:
    """A fresh policy by name: "lru", "lfu", "fifo" or "mru" (case-insensitive)."""
    cls = _POLICIES.get(name.lower()) if isinstance(name, str) else None
    if cls is None:
        raise ValueError(
            f"unknown eviction policy {name!r}; valid choices: {', '.join(POLICY_NAMES)}"
        )
    return cls()

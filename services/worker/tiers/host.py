"""L1: chunks held in the host memory pool, which is also the engine's allocator.

The pool's page is the unit of storage, so inserting never fragments. When the pool
is full, allocation evicts by the configured policy, never a pinned or referenced
chunk; when nothing can be evicted it waits for a free page up to a deadline.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

import torch

from kvmesh.common.keys import ChunkKey
from kvmesh.common.memory import HostMemoryPool, MemoryFormat, MemoryObj
from kvmesh.common.observability import Metrics
from kvmesh.common.policy import make_policy
from kvmesh.services.worker.tiers.base import Allocator
from kvmesh.services.worker.tiers.misses import MissReason, TierMisses

EvictFn = Callable[[ChunkKey, MemoryObj], None]


class AllocationError(RuntimeError):
    """No page could be freed before the deadline: everything is pinned or in use."""


class HostTier:
    """A map ChunkKey → MemoryObj over one HostMemoryPool, with policy eviction."""

    name = "l1"

    def __init__(
        self,
        pool: HostMemoryPool,
        policy: str = "lru",
        alloc_timeout_s: float = 1.0,
        on_evict: EvictFn | None = None,
        metrics: Metrics | None = None,
    ) -> None:
        self.pool = pool
        self._policy = make_policy(policy)
        self._objs: dict[ChunkKey, MemoryObj] = {}
        self._lock = threading.Lock()
        self._alloc_timeout_s = alloc_timeout_s
        self._on_evict = on_evict
        self.evictions = 0
        self.misses = TierMisses(self.name, metrics)

    # -- allocation ---------------------------------------------------------------
    def allocate(
        self, shape: torch.Size | Sequence[int], dtype: torch.dtype, fmt: MemoryFormat
    ) -> MemoryObj:
        """A fresh object from the pool, evicting or waiting as needed.

        Raises AllocationError when no page frees up within the configured deadline.
        """
        obj = self.pool.allocate(shape, dtype, fmt)
        if obj is not None:
            return obj
        deadline = time.monotonic() + self._alloc_timeout_s
        while True:
            if self._evict(1):
                obj = self.pool.allocate(shape, dtype, fmt)
                if obj is not None:
                    return obj
                continue
            left = deadline - time.monotonic()
            if left <= 0:
                raise AllocationError(
                    f"L1 is full: no page of {self.pool.page_size} bytes could be freed "
                    f"within {self._alloc_timeout_s}s ({len(self._objs)} chunks held, "
                    "all pinned or in use)"
                )
            # A page may come back from a reader finishing with it, not only by eviction.
            self.pool.wait_for_free(min(left, 0.05))
            obj = self.pool.allocate(shape, dtype, fmt)
            if obj is not None:
                return obj

    def try_allocate(
        self, shape: torch.Size | Sequence[int], dtype: torch.dtype, fmt: MemoryFormat
    ) -> MemoryObj | None:
        """`allocate` without the wait, for a caller on an event loop: a free page, or
        one that evicting makes, else None."""
        while True:
            obj = self.pool.allocate(shape, dtype, fmt)
            if obj is not None or not self._evict(1):
                return obj

    def allocate_free(
        self, n: int, shape: torch.Size | Sequence[int], dtype: torch.dtype, fmt: MemoryFormat
    ) -> list[MemoryObj] | None:
        """n fresh objects from free pages under one lock, or None (nothing taken) when
        fewer are free. It never evicts or waits: a caller that gets None allocates one
        object at a time with `allocate`, inserting each before the next, since holding
        pages outside the map would keep eviction from freeing them."""
        return self.pool.allocate_batch(n, shape, dtype, fmt)

    def make_room(self, n: int, keep: Sequence[ChunkKey] = ()) -> bool:
        """Evict, in one pass, what it takes to have n free pages; whether there are.

        keep (chunks the caller is about to touch) are accessed first, in order, so the
        policy never picks them. It does not wait: pages whose chunks are still in use
        elsewhere come back later, and a caller that gets False allocates one object
        at a time with `allocate`, which waits for them.
        """
        deficit = n - self.pool.free_pages
        if deficit <= 0:
            return True
        if keep:
            with self._lock:
                for key in keep:
                    if key in self._objs:
                        self._policy.on_access(key)
        self._evict(deficit)
        return self.pool.free_pages >= n

    def _evict(self, n: int) -> int:
        with self._lock:
            victims = self._policy.victims(n, lambda k: self._objs[k].can_evict)
            evicted = [(k, self._objs.pop(k)) for k in victims]
            for k, _ in evicted:
                self._policy.on_remove(k)
            self.evictions += len(evicted)
        for key, obj in evicted:
            self.misses.evicted.add(key)
            obj.ref_down()
            if self._on_evict is not None:
                self._on_evict(key, obj)
        return len(evicted)

    # -- the Tier interface -----------------------------------------------------------
    def insert(self, key: ChunkKey, obj: MemoryObj) -> bool:
        """Take over the caller's reference to obj; False (and the reference dropped)
        if the key is already here."""
        with self._lock:
            if key in self._objs:
                self._policy.on_access(key)
                dup = True
            else:
                self._objs[key] = obj
                self._policy.on_insert(key)
                dup = False
        if dup:
            obj.ref_down()
        else:
            self.misses.evicted.discard(key)
        return not dup

    def insert_run(self, keys: Sequence[ChunkKey], objs: Sequence[MemoryObj | None]) -> list[bool]:
        """`insert` of each (key, obj) in order under one lock, where an obj of None
        means the caller found the key already held: it is touched instead, as `touch`
        would, so the policy sees the accesses in the same order as one call per key.
        Returns, for each obj, whether it went in (a False one's reference is dropped).
        """
        policy = self._policy
        held = self._objs
        dups: list[MemoryObj] = []
        added: list[bool] = []
        new_keys: list[ChunkKey] = []
        with self._lock:
            for key, obj in zip(keys, objs, strict=True):
                if obj is None:
                    if key in held:
                        policy.on_access(key)
                elif key in held:
                    policy.on_access(key)
                    dups.append(obj)
                    added.append(False)
                else:
                    held[key] = obj
                    policy.on_insert(key)
                    added.append(True)
                    new_keys.append(key)
        for obj in dups:
            obj.ref_down()
        evicted = self.misses.evicted
        for key in new_keys:
            evicted.discard(key)
        return added

    def held(self, keys: Sequence[ChunkKey]) -> list[bool]:
        """Whether each key is here, under one lock; touches nothing."""
        with self._lock:
            objs = self._objs
            return [key in objs for key in keys]

    def submit_put(self, key: ChunkKey, obj: MemoryObj) -> None:
        # L1 shares the engine's objects rather than copying them.
        obj.ref_up()
        self.insert(key, obj)

    def contains(self, key: ChunkKey, pin: bool = False) -> bool:
        with self._lock:
            obj = self._objs.get(key)
            if obj is None:
                return False
            if pin:
                obj.pin()
            return True

    def batched_contains(self, keys: Sequence[ChunkKey], pin: bool = False) -> int:
        n = 0
        with self._lock:
            objs = self._objs
            for key in keys:
                obj = objs.get(key)
                if obj is None:
                    break
                if pin:
                    obj.pin()
                n += 1
        return n

    def get(self, key: ChunkKey, allocator: Allocator | None = None) -> MemoryObj | None:
        with self._lock:
            obj = self._objs.get(key)
            if obj is None:
                return None
            obj.ref_up()
            self._policy.on_access(key)
        return obj

    def get_prefix(self, keys: Sequence[ChunkKey]) -> list[MemoryObj]:
        """The objects of the longest prefix of keys held here, one reference each."""
        out: list[MemoryObj] = []
        with self._lock:
            for key in keys:
                obj = self._objs.get(key)
                if obj is None:
                    break
                obj.ref_up()
                self._policy.on_access(key)
                out.append(obj)
        return out

    async def aget(self, key: ChunkKey, allocator: Allocator | None = None) -> MemoryObj | None:
        return self.get(key)

    def miss_reason(self, key: ChunkKey) -> MissReason | None:
        """Why a get of key would miss here (evicted, not stored), None if it is held."""
        with self._lock:
            if key in self._objs:
                return None
        return self.misses.absent(key)

    def remove(self, key: ChunkKey, force: bool = False) -> bool:
        """Drop the chunk unless it is pinned (or force)."""
        with self._lock:
            obj = self._objs.get(key)
            if obj is None or (obj.is_pinned and not force):
                return False
            del self._objs[key]
            self._policy.on_remove(key)
        obj.ref_down()
        return True

    def clear(self, removed: Callable[[ChunkKey], None] | None = None) -> int:
        """Drop every unpinned chunk; removed(key) is called after each one goes (before
        the next: a store of that key meanwhile then reports it after its removal)."""
        with self._lock:
            keys = [k for k, o in self._objs.items() if not o.is_pinned]
        n = 0
        for k in keys:
            if self.remove(k):
                n += 1
                if removed is not None:
                    removed(k)
        return n

    def pin(self, key: ChunkKey) -> bool:
        with self._lock:
            obj = self._objs.get(key)
            if obj is None:
                return False
            obj.pin()
            return True

    def unpin(self, key: ChunkKey) -> bool:
        with self._lock:
            obj = self._objs.get(key)
            if obj is None or not obj.is_pinned:
                return False
            obj.unpin()
            return True

    def touch(self, key: ChunkKey) -> None:
        with self._lock:
            if key in self._objs:
                self._policy.on_access(key)

    def keys(self) -> list[ChunkKey]:
        with self._lock:
            return list(self._objs)

    def __len__(self) -> int:
        return len(self._objs)

    @property
    def used_bytes(self) -> int:
        return self.pool.used_bytes

    def flush(self, timeout: float | None = None) -> bool:
        return True  # puts into host memory end before submit_put returns

    def close(self) -> None:
        with self._lock:
            objs = list(self._objs.values())
            self._objs.clear()
        for obj in objs:
            while obj.is_pinned:
                obj.unpin()
            obj.ref_down()

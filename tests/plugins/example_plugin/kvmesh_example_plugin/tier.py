"""`memdict`: a tier holding copies of chunks in a dict, bounded by `max_chunks`.

It stores the bytes with their xxh3 digest and returns a miss when they no longer
match, as every kvmesh tier must: a plugin never hands back wrong KV.
"""

from __future__ import annotations

import asyncio
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch
import xxhash

from kvmesh.common.keys import ChunkKey
from kvmesh.common.memory import MemoryObj
from kvmesh.services.worker.tiers.base import Allocator
from kvmesh.services.worker.tiers.plugin import TierContext


class MemDictTier:
    def __init__(self, context: TierContext) -> None:
        self.name = context.name
        self.max_chunks = int(context.options.get("max_chunks", 1024))
        self._chunks: OrderedDict[ChunkKey, tuple[bytes, int, Any, Any, Any]] = OrderedDict()
        self._pinned: set[ChunkKey] = set()
        self._lock = threading.Lock()
        self.puts = self.gets = self.hits = 0
        self._puts = context.metrics.counter("memdict_puts_total", "Chunks put in memdict")

    def contains(self, key: ChunkKey, pin: bool = False) -> bool:
        return self.batched_contains([key], pin) == 1

    def batched_contains(self, keys: Sequence[ChunkKey], pin: bool = False) -> int:
        n = 0
        with self._lock:
            for key in keys:
                if key not in self._chunks:
                    break
                if pin:
                    self._pinned.add(key)
                n += 1
        return n

    def submit_put(self, key: ChunkKey, obj: MemoryObj) -> None:
        data = obj.raw.numpy().tobytes()
        with self._lock:
            self._chunks[key] = (
                data,
                xxhash.xxh3_64_intdigest(data),
                obj.shape,
                obj.dtype,
                obj.fmt,
            )
            self._chunks.move_to_end(key)
            while len(self._chunks) > self.max_chunks:
                victim = next((k for k in self._chunks if k not in self._pinned), None)
                if victim is None:
                    break
                del self._chunks[victim]
            self.puts += 1
        self._puts.inc()

    def get(self, key: ChunkKey, allocator: Allocator) -> MemoryObj | None:
        with self._lock:
            self.gets += 1
            found = self._chunks.get(key)
        if found is None:
            return None
        data, digest, shape, dtype, fmt = found
        if xxhash.xxh3_64_intdigest(data) != digest:
            return None
        obj = allocator.allocate(torch.Size(shape), dtype, fmt)
        if obj is None:
            return None
        obj.raw.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        with self._lock:
            self.hits += 1
        return obj

    async def aget(self, key: ChunkKey, allocator: Allocator) -> MemoryObj | None:
        # The checksum and the copy are per-byte work: a thread, not the engine's loop.
        return await asyncio.to_thread(self.get, key, allocator)

    def remove(self, key: ChunkKey) -> bool:
        with self._lock:
            self._pinned.discard(key)
            return self._chunks.pop(key, None) is not None

    def clear(self) -> int:
        with self._lock:
            victims = [k for k in self._chunks if k not in self._pinned]
            for k in victims:
                del self._chunks[k]
        return len(victims)

    def pin(self, key: ChunkKey) -> bool:
        with self._lock:
            if key not in self._chunks:
                return False
            self._pinned.add(key)
            return True

    def unpin(self, key: ChunkKey) -> bool:
        with self._lock:
            was = key in self._pinned
            self._pinned.discard(key)
            return was

    def touch(self, key: ChunkKey) -> None:
        with self._lock:
            if key in self._chunks:
                self._chunks.move_to_end(key)

    def flush(self, timeout: float | None = None) -> bool:
        return True  # puts are synchronous

    def close(self) -> None:
        with self._lock:
            self._chunks.clear()

    def corrupt(self, key: ChunkKey) -> None:
        """Flip one stored byte (for the tests' checksum check)."""
        with self._lock:
            data, *rest = self._chunks[key]
            self._chunks[key] = (bytes([data[0] ^ 0xFF]) + data[1:], *rest)


def make_tier(context: TierContext) -> MemDictTier:
    return MemDictTier(context)


def make_misnamed_tier(context: TierContext) -> MemDictTier:
    tier = MemDictTier(context)
    tier.name = "memdict"
    return tier


def make_failing_tier(context: TierContext) -> MemDictTier:
    raise RuntimeError("the example store is unreachable")

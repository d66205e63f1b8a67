"""The interface every storage tier implements, and the allocator a tier reads into.

Reference convention: a tier that hands out a MemoryObj (`get`) has taken one
reference for the caller, who drops it with `ref_down()` when done. `submit_put`
takes its own reference on the object for as long as it needs the bytes.

Allocation on the event loop: the engine's `aget` calls hand a tier an allocator that
never waits (`without_wait(L1)`: a full L1 whose pages are all in use answers None,
a miss), since a wait there would stall every request on the loop. A tier that
allocates only on its own threads, where waiting for a page is fine, sets the class
attribute `waits_for_pages = True` and is given the L1 itself (the disk tier reads on
its I/O threads; the remote tier waits off the loop and wraps its on-loop allocations
in `without_wait`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

import torch

from kvmesh.common.keys import ChunkKey
from kvmesh.common.memory import MemoryFormat, MemoryObj


@runtime_checkable
class Allocator(Protocol):
    """Where a lower tier puts the bytes it reads (the L1 pool, evicting as needed).

    An allocator may also offer `try_allocate` (same arguments): a page only if one is
    there without waiting. Code on an event loop allocates through `without_wait`."""

    def allocate(
        self, shape: torch.Size, dtype: torch.dtype, fmt: MemoryFormat
    ) -> MemoryObj | None: ...


class _NoWait:
    def __init__(self, allocate: Callable[..., MemoryObj | None]) -> None:
        self.allocate = allocate


def without_wait(allocator: Allocator) -> Allocator:
    """allocator for code on the event loop: its `try_allocate` where it has one (the
    L1, whose `allocate` waits up to alloc_timeout_s for a page in use elsewhere to come
    back); an allocator without one (a bare pool) never waits anyway."""
    allocate = getattr(allocator, "try_allocate", None)
    return allocator if allocate is None else _NoWait(allocate)


def drop_late(obj: MemoryObj | None) -> None:
    """A get's result that came after its caller gave up: its reference is nobody's."""
    if obj is not None:
        obj.ref_down()


@runtime_checkable
class Tier(Protocol):
    """One level of the cache. Methods may be called from any thread."""

    name: str

    def contains(self, key: ChunkKey, pin: bool = False) -> bool:
        """Whether the chunk is here; with pin, it stays until `unpin`."""
        ...

    def batched_contains(self, keys: Sequence[ChunkKey], pin: bool = False) -> int:
        """How many of keys, from the first, are here (stops at the first miss)."""
        ...

    def submit_put(self, key: ChunkKey, obj: MemoryObj) -> None:
        """Store a copy of obj under key without blocking the caller."""
        ...

    def get(self, key: ChunkKey, allocator: Allocator) -> MemoryObj | None:
        """The chunk (one reference is the caller's), or None on a miss."""
        ...

    async def aget(self, key: ChunkKey, allocator: Allocator) -> MemoryObj | None:
        """`get` for the event loop: never blocks it."""
        ...

    def remove(self, key: ChunkKey) -> bool: ...

    def clear(self) -> int:
        """Drop every unpinned chunk; returns how many were dropped."""
        ...

    def pin(self, key: ChunkKey) -> bool: ...

    def unpin(self, key: ChunkKey) -> bool: ...

    def touch(self, key: ChunkKey) -> None:
        """Count a use of the chunk for the eviction policy."""
        ...

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every put submitted so far has ended; False if timeout passed first."""
        ...

    def close(self) -> None: ...

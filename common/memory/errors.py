"""Errors of the memory objects and the host pool, under one root."""

from __future__ import annotations


class KVMemoryError(RuntimeError):
    """Root of the errors raised by kvmesh.common.memory."""


class MemoryObjFreedError(KVMemoryError):
    """A MemoryObj was used after its page went back to the pool (or the pool closed).

    Its page may already hold another chunk, so any access would read or corrupt
    someone else's KV: this is always a bug in the caller's reference counting.
    """


class MemoryObjInUseError(KVMemoryError):
    """`free()` was called while other references to the object are still held."""


class PoolClosedError(KVMemoryError):
    """The pool was closed: it hands out nothing more."""


class AllocationTimeoutError(KVMemoryError):
    """No page became free before the deadline (everything pinned or referenced)."""

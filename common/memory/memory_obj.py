"""MemoryObj: one page of a HostMemoryPool, seen as a typed tensor.

Lifetime is reference counted; eviction protection is a separate pin count.

- **References** (`ref_count`) say who may still read or write the bytes. A fresh
  object has one, the *owner's* (whoever called `allocate`). Each further holder takes
  one with `ref_up()` and drops it with `ref_down()`; the last `ref_down()` returns
  the page to the pool. The L1 tier is the usual owner: a reader it hands an object
  to gets a reference of its own and drops it when done.
- **Pins** (`pin_count`) say "do not evict": a lookup that promised a prefix pins its
  chunks until the matching retrieve. Pins do not keep the page alive by themselves;
  if the last reference is dropped while pinned the page is still freed.
- **Evictable** (`can_evict`) means not pinned and `ref_count == 1`: only the owner
  (the tier) holds it, so dropping that reference cannot pull bytes from under a
  reader.

Every counter change happens under the pool's lock, because the engine's event-loop
thread and the inference thread touch the same objects. Once freed (or once the pool
is closed) every use raises MemoryObjFreedError: the page may already hold another
chunk, and the cache must never hand back wrong KV.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from kvmesh.common.memory.errors import MemoryObjFreedError, MemoryObjInUseError
from kvmesh.common.memory.formats import MemoryFormat

if TYPE_CHECKING:
    from kvmesh.common.memory.host_pool import HostMemoryPool


class MemoryObj:
    """A view of one pool page holding `nbytes` bytes shaped as `shape` of `dtype`.

    Made by `HostMemoryPool.allocate`, never directly. `shape`, `dtype`, `fmt`,
    `nbytes` and `page` are read-only by convention; `key` and `checksum` are free
    slots for the engine (the chunk's key and its xxh3 checksum).
    """

    # Allocation must stay a few hundred ns: plain slots, no tensor until asked.
    __slots__ = (
        "_pool",
        "_raw",
        "_tensor",
        "checksum",
        "dtype",
        "fmt",
        "key",
        "nbytes",
        "page",
        "pin_count",
        "ref_count",
        "shape",
    )

    def __init__(
        self,
        pool: HostMemoryPool,
        page: int,
        shape: torch.Size,
        dtype: torch.dtype,
        fmt: MemoryFormat,
        nbytes: int,
    ) -> None:
        # `_pool is None` is the freed state: one load tells a live object from a dead one.
        self._pool: HostMemoryPool | None = pool
        self.page = page
        self.shape = shape
        self.dtype = dtype
        self.fmt = fmt
        self.nbytes = nbytes
        self.ref_count = 1
        self.pin_count = 0
        self._raw: torch.Tensor | None = None
        self._tensor: torch.Tensor | None = None
        self.key: Any = None
        self.checksum: int | None = None

    # -- the bytes --------------------------------------------------------------------
    @property
    def tensor(self) -> torch.Tensor:
        """The page's first `nbytes` as a `dtype` tensor of `shape` (made once, cached).

        A view, not a copy: writes land in the pool. Do not keep it past your
        reference, since after the free the page belongs to someone else. The pool
        hands the same tensor object to the page's next object of the same layout:
        never change its metadata in place (resize_, as_strided_, squeeze_, ...).
        """
        t = self._tensor
        if t is None:
            pool = self._pool
            if pool is None:
                raise self._freed("tensor")
            t = pool._page_tensor(self.page, self.shape, self.dtype)
            self._tensor = t
            if self._pool is None:  # freed meanwhile by another thread: cache nothing
                self._tensor = None
                raise self._freed("tensor")
        return t

    @property
    def raw(self) -> torch.Tensor:
        """The same `nbytes` bytes as a flat uint8 tensor (for I/O and checksums)."""
        r = self._raw
        if r is None:
            pool = self._pool
            if pool is None:
                raise self._freed("raw")
            r = pool._page_bytes(self.page, self.nbytes)
            self._raw = r
            if self._pool is None:  # freed meanwhile by another thread: cache nothing
                self._raw = None
                raise self._freed("raw")
        return r

    @property
    def data_ptr(self) -> int:
        """Address of the first byte (aligned to the pool's alignment); makes no tensor."""
        pool = self._pool
        if pool is None:
            raise self._freed("data_ptr")
        return pool._base_ptr + self.page * pool.page_size

    # -- references -------------------------------------------------------------------
    def ref_up(self) -> None:
        """Take one more reference (a reader that will `ref_down()` when done)."""
        pool = self._pool
        if pool is None:
            raise self._freed("ref_up")
        lock = pool._lock
        lock.acquire()
        try:
            if self._pool is None:
                raise self._freed("ref_up")
            self.ref_count += 1
        finally:
            lock.release()

    def ref_down(self) -> None:
        """Drop one reference; the last one returns the page to the pool."""
        pool = self._pool
        if pool is None:
            raise self._freed("ref_down")
        lock = pool._lock
        lock.acquire()
        try:
            if self._pool is None:
                raise self._freed("ref_down")
            n = self.ref_count - 1
            self.ref_count = n
            if n == 0:
                pool._release_locked(self)
        finally:
            lock.release()

    def free(self) -> None:
        """Return the page now, as its sole holder.

        Unlike `ref_down()` this checks the caller's belief that nobody else holds
        the object: with other references outstanding it raises MemoryObjInUseError
        and changes nothing. Freeing twice raises MemoryObjFreedError. Pins do not
        prevent it (they only keep eviction away).
        """
        pool = self._pool
        if pool is None:
            raise self._freed("free")
        lock = pool._lock
        lock.acquire()
        try:
            if self._pool is None:
                raise self._freed("free")
            if self.ref_count != 1:
                raise MemoryObjInUseError(
                    f"free() of {self!r}: {self.ref_count - 1} other reference(s) still "
                    "held; drop yours with ref_down() instead"
                )
            self.ref_count = 0
            pool._release_locked(self)
        finally:
            lock.release()

    # -- pins -------------------------------------------------------------------------
    def pin(self) -> None:
        """Protect from eviction until the matching `unpin()` (pins nest)."""
        pool = self._pool
        if pool is None:
            raise self._freed("pin")
        lock = pool._lock
        lock.acquire()
        try:
            if self._pool is None:
                raise self._freed("pin")
            self.pin_count += 1
        finally:
            lock.release()

    def unpin(self) -> None:
        """Undo one `pin()`; unpinning an unpinned object is a ValueError."""
        pool = self._pool
        if pool is None:
            raise self._freed("unpin")
        lock = pool._lock
        lock.acquire()
        try:
            if self._pool is None:
                raise self._freed("unpin")
            if self.pin_count == 0:
                raise ValueError(f"unpin() of {self!r}, which is not pinned")
            self.pin_count -= 1
        finally:
            lock.release()

    @property
    def is_pinned(self) -> bool:
        return self.pin_count > 0

    @property
    def can_evict(self) -> bool:
        """Live, not pinned, and only the owner's reference held (see module doc)."""
        return self._pool is not None and self.pin_count == 0 and self.ref_count == 1

    @property
    def is_freed(self) -> bool:
        return self._pool is None

    # -- helpers ----------------------------------------------------------------------
    def _mark_freed(self) -> None:
        """Called by the pool, under its lock, when the page goes back or it closes."""
        self._pool = None
        self._raw = None
        self._tensor = None

    def _freed(self, what: str) -> MemoryObjFreedError:
        return MemoryObjFreedError(
            f"{what} on {self!r}: the object was freed (or its pool closed); its page "
            "may now hold another chunk"
        )

    def __repr__(self) -> str:
        state = "freed" if self._pool is None else f"refs={self.ref_count} pins={self.pin_count}"
        return (
            f"MemoryObj(page={self.page}, shape={tuple(self.shape)}, "
            f"dtype={self.dtype}, fmt={getattr(self.fmt, 'name', self.fmt)}, "
            f"nbytes={self.nbytes}, {state})"
        )

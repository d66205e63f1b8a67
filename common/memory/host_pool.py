"""HostMemoryPool: one preallocated host buffer cut into fixed pages.

The L1 tier's storage *is* this pool: each stored chunk occupies one page, so the
pool never fragments and allocation is a pop from a stack of free page indices. When
no page is free `allocate` returns None, and the caller (the tier) evicts by policy and
retries, or waits on `wait_for_free` when everything is pinned or referenced.

Costs: allocation creates no tensor (a MemoryObj makes its view on first use), takes
the lock once, and is O(1) whatever the pool size. The buffer is one `torch.empty`
allocation that is never written at construction, so the kernel maps its pages on
first touch and even an 8 GiB pool is created at once (pinned memory is the
exception: pinning maps and locks every page, which takes time).

Thread-safe: one lock guards the free stack and every object's counters.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterable, Sequence

import psutil
import torch

from kvmesh.common.memory.errors import AllocationTimeoutError, PoolClosedError
from kvmesh.common.memory.formats import MemoryFormat
from kvmesh.common.memory.memory_obj import MemoryObj

ShapeLike = torch.Size | Sequence[int]

# Distinct (shape, dtype) pairs are few (one per chunk layout); the bound only guards
# against a caller that allocates arbitrary shapes.
_MAX_LAYOUTS = 1024
# Layouts whose page tensors are kept for reuse (an engine has one or two: full chunks
# and a short last one).
_CACHED_VIEW_LAYOUTS = 4


class HostMemoryPool:
    """Fixed-size pages over one host buffer (pinned when CUDA is available).

    size_bytes: the wanted size; the pool takes `min(size_bytes, available memory -
        reserve_bytes)`, rounded down to whole pages (see `requested_bytes`).
    page_size: the largest object, rounded up to `alignment` so every page starts
        aligned (O_DIRECT needs 4 KiB alignment of address, length and offset).
    pin_memory: None pins iff `torch.cuda.is_available()`.
    """

    def __init__(
        self,
        size_bytes: int,
        page_size: int,
        *,
        reserve_bytes: int = 0,
        pin_memory: bool | None = None,
        alignment: int = 4096,
    ) -> None:
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"alignment must be a power of two, got {alignment}")
        if page_size <= 0:
            raise ValueError(f"page_size must be positive, got {page_size}")
        if size_bytes <= 0:
            raise ValueError(f"size_bytes must be positive, got {size_bytes}")
        if reserve_bytes < 0:
            raise ValueError(f"reserve_bytes must be >= 0, got {reserve_bytes}")
        page_size = -(-page_size // alignment) * alignment
        available = psutil.virtual_memory().available
        budget = min(size_bytes, available - reserve_bytes)
        num_pages = max(budget, 0) // page_size
        if num_pages == 0:
            raise ValueError(
                f"host memory pool would hold no page: wanted {size_bytes} bytes, "
                f"{available} bytes available minus a reserve of {reserve_bytes} leaves "
                f"{max(available - reserve_bytes, 0)}, less than one page of {page_size}"
            )
        self.page_size = page_size
        self.alignment = alignment
        self.num_pages = num_pages
        self.requested_bytes = size_bytes
        self.pinned = torch.cuda.is_available() if pin_memory is None else pin_memory
        total = num_pages * page_size
        # torch only promises 64-byte alignment: over-allocate and start at the next
        # aligned address. Nothing writes the buffer, so its pages stay unmapped.
        self._backing: torch.Tensor | None = torch.empty(
            total + alignment, dtype=torch.uint8, pin_memory=self.pinned
        )
        skip = -self._backing.data_ptr() % alignment
        self._buffer: torch.Tensor | None = self._backing[skip : skip + total]
        self._base_ptr = self._buffer.data_ptr()

        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._waiters = 0  # notify only when someone waits: Condition.notify is not free
        # Reversed so page 0 is handed out first: low addresses stay warm.
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._live: list[MemoryObj | None] = [None] * num_pages
        self._used_bytes = 0
        self._closed = False
        self._layouts: dict[tuple[torch.Size, torch.dtype], tuple[torch.Size, int]] = {}
        # The buffer seen as each dtype asked for, so that a page's typed tensor is one
        # as_strided call (~1 µs) instead of slice + view + view (~4 µs).
        self._typed: dict[torch.dtype, torch.Tensor] = {}
        self._strides: dict[torch.Size, tuple[int, ...]] = {}
        # A page's tensor, kept for the next object of the same layout on that page
        # (the engine reuses pages all the time): as_strided still costs ~1 µs. Only
        # the first few layouts, a slot per page each, so memory stays bounded.
        self._page_views: dict[tuple[torch.Size, torch.dtype], list[torch.Tensor | None]] = {}
        # Callers reuse one shape object per chunk layout: an identity check on the
        # last one skips hashing the shape. One tuple, so threads read it whole.
        self._last_layout: tuple[object, object, torch.Size, int] = (None, None, torch.Size(), 0)

    # -- allocation -------------------------------------------------------------------
    def allocate(self, shape: ShapeLike, dtype: torch.dtype, fmt: MemoryFormat) -> MemoryObj | None:
        """A fresh object holding the caller's (owner's) reference, or None if no page
        is free. Raises ValueError if the object would not fit in a page."""
        last = self._last_layout
        if last[0] is shape and last[1] is dtype:
            size, nbytes = last[2], last[3]
        else:
            size, nbytes = self._lookup_layout(shape, dtype)
        # acquire/try/finally rather than `with`: half the cost on CPython 3.11, and
        # the hot paths (allocate, ref_down) take the lock once per call.
        lock = self._lock
        lock.acquire()
        try:
            if self._closed:
                raise PoolClosedError("allocate() on a closed HostMemoryPool")
            free = self._free
            if not free:
                return None
            page = free.pop()
            # Built under the lock so close() always sees every live object.
            obj = MemoryObj(self, page, size, dtype, fmt, nbytes)
            self._live[page] = obj
            self._used_bytes += nbytes
        finally:
            lock.release()
        return obj

    def allocate_batch(
        self, n: int, shape: ShapeLike, dtype: torch.dtype, fmt: MemoryFormat
    ) -> list[MemoryObj] | None:
        """n fresh objects under one lock acquisition, or None (and nothing taken) if
        fewer than n pages are free."""
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        size, nbytes = self._lookup_layout(shape, dtype)
        lock = self._lock
        lock.acquire()
        try:
            if self._closed:
                raise PoolClosedError("allocate_batch() on a closed HostMemoryPool")
            free = self._free
            if len(free) < n:
                return None
            if n == 0:
                return []
            pages = free[-n:]
            del free[-n:]
            objs = [MemoryObj(self, p, size, dtype, fmt, nbytes) for p in pages]
            live = self._live
            for obj in objs:
                live[obj.page] = obj
            self._used_bytes += n * nbytes
        finally:
            lock.release()
        return objs

    def release_batch(self, objs: Iterable[MemoryObj]) -> None:
        """`ref_down()` on each object under one lock acquisition.

        Every object is checked to be live and from this pool before any is touched;
        an object listed more times than it has references raises when its count is
        exhausted, after the earlier ones were released.
        """
        objs = list(objs)
        lock = self._lock
        lock.acquire()
        try:
            for obj in objs:
                if obj._pool is not self:
                    if obj._pool is None:
                        raise obj._freed("release_batch")
                    raise ValueError(f"{obj!r} belongs to another pool")
            for obj in objs:
                if obj._pool is None:
                    raise obj._freed("release_batch")
                n = obj.ref_count - 1
                obj.ref_count = n
                if n == 0:
                    self._release_locked(obj)
        finally:
            lock.release()

    def allocate_wait(
        self, shape: ShapeLike, dtype: torch.dtype, fmt: MemoryFormat, timeout_s: float
    ) -> MemoryObj:
        """`allocate`, waiting up to timeout_s for a page to be freed by someone else.

        It never evicts: a tier evicts first and calls this only when nothing is
        evictable. Raises AllocationTimeoutError at the deadline: at once after one
        try when timeout_s <= 0; never when it is infinite (or past what a lock wait
        takes). NaN is a ValueError.
        """
        _check_timeout(timeout_s)
        deadline = time.monotonic() + timeout_s
        while True:
            obj = self.allocate(shape, dtype, fmt)
            if obj is not None:
                return obj
            left = deadline - time.monotonic()
            if left <= 0 or not self.wait_for_free(left):
                raise AllocationTimeoutError(
                    f"no free page in {timeout_s}s: all {self.num_pages} pages of "
                    f"{self.page_size} bytes are allocated (pinned or referenced)"
                )

    def wait_for_free(self, timeout_s: float | None) -> bool:
        """Block until a page is free (True) or timeout_s passes (False).

        Woken by every free; True means a page was free at wake-up, not that the next
        `allocate` gets it (another thread may win). None (or infinity, or anything
        past threading.TIMEOUT_MAX) waits without a deadline, timeout_s <= 0 does not
        wait; NaN is a ValueError. Raises PoolClosedError if the pool is or gets closed.
        """
        if timeout_s is not None:
            _check_timeout(timeout_s)
            if timeout_s >= threading.TIMEOUT_MAX:
                timeout_s = None  # a lock wait raises OverflowError past it
        with self._cond:
            if self._closed:
                raise PoolClosedError("wait_for_free() on a closed HostMemoryPool")
            if self._free:
                return True
            self._waiters += 1
            try:
                ok = self._cond.wait_for(
                    lambda: bool(self._free) or self._closed,
                    None if timeout_s is None else max(timeout_s, 0.0),
                )
            finally:
                self._waiters -= 1
            if self._closed:
                raise PoolClosedError("HostMemoryPool closed while waiting for a page")
            return ok

    # -- stats ------------------------------------------------------------------------
    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def used_pages(self) -> int:
        return self.num_pages - len(self._free)

    @property
    def used_bytes(self) -> int:
        """Sum of the live objects' nbytes (≤ used_pages × page_size)."""
        return self._used_bytes

    @property
    def capacity_bytes(self) -> int:
        return self.num_pages * self.page_size

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def buffer(self) -> torch.Tensor:
        """The whole aligned region as uint8 (to register it once with NIXL, say)."""
        buf = self._buffer
        if buf is None:
            raise PoolClosedError("buffer of a closed HostMemoryPool")
        return buf

    # -- teardown ---------------------------------------------------------------------
    def close(self) -> int:
        """Release the buffer; returns how many objects were still allocated.

        Those objects are marked freed (any use raises MemoryObjFreedError). Tensor
        views a caller kept still hold the memory until they are dropped. Idempotent.
        """
        with self._lock:
            if self._closed:
                return 0
            self._closed = True
            leaked = 0
            for obj in self._live:
                if obj is not None:
                    obj._mark_freed()
                    leaked += 1
            self._live = [None] * self.num_pages
            self._free = list(range(self.num_pages - 1, -1, -1))
            self._used_bytes = 0
            self._buffer = None
            self._backing = None
            self._typed = {}
            self._page_views = {}
            if self._waiters:
                self._cond.notify_all()
        return leaked

    def __enter__(self) -> HostMemoryPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"HostMemoryPool({self.num_pages} pages × {self.page_size} B, "
            f"{self.free_pages} free, pinned={self.pinned}, closed={self._closed})"
        )

    # -- for MemoryObj ----------------------------------------------------------------
    def _release_locked(self, obj: MemoryObj) -> None:
        """Put obj's page back; the caller holds the lock and dropped the last ref."""
        page = obj.page
        self._live[page] = None
        self._free.append(page)
        self._used_bytes -= obj.nbytes
        obj._pool = None
        obj._raw = None
        obj._tensor = None
        if self._waiters:
            self._cond.notify_all()

    def _page_bytes(self, page: int, nbytes: int) -> torch.Tensor:
        buf = self._buffer
        if buf is None:
            raise PoolClosedError("HostMemoryPool is closed")
        start = page * self.page_size
        return buf[start : start + nbytes]

    def _page_tensor(self, page: int, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """Page `page` as a contiguous `dtype` tensor of `shape`: a view of the buffer."""
        typed = self._typed.get(dtype)
        if typed is None:
            buf = self._buffer
            if buf is None:
                raise PoolClosedError("HostMemoryPool is closed")
            if self.page_size % dtype.itemsize:
                # Pages that are not whole elements (an alignment below the itemsize):
                # the byte slice's own view checks what it can.
                raw = self._page_bytes(page, shape.numel() * dtype.itemsize)
                return raw.view(dtype).view(shape)
            typed = buf.view(dtype)
            self._typed[dtype] = typed
        views = self._page_views.get((shape, dtype))
        if views is not None:
            t = views[page]
            if t is not None:
                return t
        strides = self._strides.get(shape)
        if strides is None:
            strides = _contiguous_strides(shape)
            if len(self._strides) >= _MAX_LAYOUTS:
                self._strides.clear()
            self._strides[shape] = strides
        # as_strided counts its offset from the start of the storage, not of the view:
        # the buffer begins `skip` bytes into its backing allocation.
        offset = typed.storage_offset() + page * self.page_size // dtype.itemsize
        t = typed.as_strided(shape, strides, offset)
        if views is None and len(self._page_views) < _CACHED_VIEW_LAYOUTS:
            views = self._page_views.setdefault((shape, dtype), [None] * self.num_pages)
        if views is not None:
            views[page] = t
        return t

    def _lookup_layout(self, shape: ShapeLike, dtype: torch.dtype) -> tuple[torch.Size, int]:
        try:
            size, nbytes = self._layouts[(shape, dtype)]  # type: ignore[index]
        except (KeyError, TypeError):  # TypeError: an unhashable shape such as a list
            size, nbytes = self._layout(shape, dtype)
        # allocate() knows this layout again by the shape's identity: only an immutable
        # shape may be remembered so, or a list changed in place would get the old size.
        if type(shape) is tuple or type(shape) is torch.Size:
            self._last_layout = (shape, dtype, size, nbytes)
        return size, nbytes

    def _layout(self, shape: ShapeLike, dtype: torch.dtype) -> tuple[torch.Size, int]:
        """Validate a (shape, dtype) and cache its size; the slow path of allocate."""
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}")
        size = torch.Size(shape)
        if any(d < 0 for d in size):
            raise ValueError(f"negative dimension in shape {tuple(size)}")
        # In Python ints: Size.numel() wraps at 2**63, so a shape of 2**32 x 2**32 (a
        # damaged or hostile chunk header) would pass as 0 bytes and get a page.
        nbytes = math.prod(size) * dtype.itemsize
        if nbytes > self.page_size:
            raise ValueError(
                f"an object of shape {tuple(size)} and dtype {dtype} needs {nbytes} bytes, "
                f"more than a page ({self.page_size} bytes)"
            )
        if len(self._layouts) >= _MAX_LAYOUTS:
            self._layouts.clear()
        self._layouts[(size, dtype)] = (size, nbytes)
        return size, nbytes


def _check_timeout(timeout_s: float) -> None:
    # A NaN deadline compares false both ways: Condition.wait_for then neither waits
    # nor gives up, and spins a core until a page frees.
    if math.isnan(timeout_s):
        raise ValueError("timeout_s must be a number of seconds, got NaN")


def _contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    """Row-major strides, as torch gives a contiguous tensor (a 0 or 1 dim steps by 1)."""
    strides = []
    step = 1
    for d in reversed(shape):
        strides.append(step)
        step *= max(d, 1)
    return tuple(reversed(strides))

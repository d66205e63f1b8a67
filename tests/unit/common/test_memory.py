"""kvmesh.common.memory: page views, reference/pin conventions, and the host pool."""

from __future__ import annotations

import itertools
import math
import threading
import time
from collections import namedtuple

import psutil
import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvmesh.common import memory as mem
from kvmesh.common.memory import (
    AllocationTimeoutError,
    HostMemoryPool,
    MemoryFormat,
    MemoryObj,
    MemoryObjFreedError,
    MemoryObjInUseError,
    PoolClosedError,
)

KiB = 1024
MiB = 1024**2
PAGE = 16 * KiB

# One representative (shape, dtype) per format: layers=2, tokens=16, hidden=64.
FORMAT_LAYOUTS = {
    MemoryFormat.UNDEFINED: ((7, 3), torch.int32),
    MemoryFormat.KV_2LTD: ((2, 2, 16, 64), torch.float16),
    MemoryFormat.KV_T2D: ((16, 2, 64), torch.bfloat16),
    MemoryFormat.KV_2TD: ((2, 16, 64), torch.float32),
    MemoryFormat.KV_MLA: ((2, 16, 96), torch.float16),
    MemoryFormat.BINARY: ((12345,), torch.uint8),
}


@pytest.fixture
def pool() -> HostMemoryPool:
    p = HostMemoryPool(64 * PAGE, PAGE)
    yield p
    p.close()


def test_every_format_has_a_layout_here() -> None:
    assert set(FORMAT_LAYOUTS) == set(MemoryFormat)
    assert [f for f in MemoryFormat if not f.is_kv] == [MemoryFormat.UNDEFINED, MemoryFormat.BINARY]


@pytest.mark.parametrize("fmt", list(MemoryFormat))
def test_tensor_view_has_the_shape_dtype_and_bytes(pool: HostMemoryPool, fmt: MemoryFormat) -> None:
    shape, dtype = FORMAT_LAYOUTS[fmt]
    obj = pool.allocate(shape, dtype, fmt)
    assert obj is not None
    assert obj.fmt is fmt
    assert obj.shape == torch.Size(shape) and isinstance(obj.shape, torch.Size)
    assert obj.dtype == dtype
    assert obj.nbytes == torch.Size(shape).numel() * dtype.itemsize
    t = obj.tensor
    assert t.shape == obj.shape and t.dtype == dtype and t.is_contiguous()
    assert obj.tensor is t  # made once, then cached
    assert obj.raw.dtype == torch.uint8 and obj.raw.numel() == obj.nbytes
    assert t.data_ptr() == obj.raw.data_ptr() == obj.data_ptr
    assert obj.data_ptr % 4096 == 0
    t.view(-1)[0:1] = 1  # a view: writes reach the raw bytes
    assert obj.raw[: dtype.itemsize].any()
    assert pool.used_bytes == obj.nbytes
    obj.ref_down()
    assert pool.used_bytes == 0 and pool.free_pages == pool.num_pages


def test_tensor_and_raw_are_the_same_bytes_whatever_the_buffer_offset() -> None:
    # Small pools come from malloc, rarely 4 KiB-aligned: the aligned buffer then starts
    # inside its backing allocation, and each page's typed tensor must start there too.
    offsets = set()
    for pages in range(1, 9):
        with HostMemoryPool(pages * 4096, 4096) as p:
            assert p._buffer is not None and p._backing is not None
            offsets.add(p._buffer.data_ptr() - p._backing.data_ptr())
            for dtype, shape in (
                (torch.float16, (2, 3, 5)),
                (torch.int64, (7,)),
                (torch.uint8, (9,)),
            ):
                objs = p.allocate_batch(pages, shape, dtype, MemoryFormat.UNDEFINED)
                assert objs is not None
                for i, o in enumerate(objs):
                    assert o.tensor.data_ptr() == o.raw.data_ptr() == o.data_ptr
                    o.raw.fill_(i + 1)
                for i, o in enumerate(objs):
                    assert bool((o.tensor.view(torch.uint8) == i + 1).all())
                p.release_batch(objs)
    assert offsets != {0}, "no pool started inside its backing allocation: nothing was tested"


def test_a_page_tensor_is_reused_only_for_the_same_layout(pool: HostMemoryPool) -> None:
    fmt = MemoryFormat.UNDEFINED
    a = pool.allocate((4, 8), torch.float16, fmt)
    t, page = a.tensor, a.page
    a.ref_down()
    b = pool.allocate((4, 8), torch.float16, fmt)
    assert b.page == page and b.tensor is t  # the page's view, kept by the pool
    b.ref_down()
    for shape, dtype in (((8, 4), torch.float16), ((4, 8), torch.int16), ((3,), torch.int64)):
        c = pool.allocate(shape, dtype, fmt)
        assert c.page == page and c.tensor is not t
        assert c.tensor.shape == shape and c.tensor.dtype == dtype
        assert c.tensor.data_ptr() == c.data_ptr and c.tensor.is_contiguous()
        c.ref_down()


def test_list_shapes_and_repeat_layouts_work(pool: HostMemoryPool) -> None:
    a = pool.allocate([4, 8], torch.float16, MemoryFormat.UNDEFINED)
    b = pool.allocate((4, 8), torch.float16, MemoryFormat.UNDEFINED)
    c = pool.allocate(torch.Size([8, 4]), torch.float16, MemoryFormat.UNDEFINED)
    assert a.shape == b.shape == (4, 8) and c.shape == (8, 4)
    assert a.nbytes == b.nbytes == c.nbytes == 64


def test_writes_through_one_object_never_show_in_another(pool: HostMemoryPool) -> None:
    objs = pool.allocate_batch(pool.num_pages, (PAGE // 4,), torch.int32, MemoryFormat.UNDEFINED)
    assert objs is not None
    for i, o in enumerate(objs):
        o.tensor.fill_(i)
    for i, o in enumerate(objs):
        assert bool((o.tensor == i).all()), f"page {o.page} was overwritten"
    pool.release_batch(objs)


def test_too_large_raises_and_takes_nothing(pool: HostMemoryPool) -> None:
    with pytest.raises(ValueError, match="more than a page"):
        pool.allocate((PAGE + 1,), torch.uint8, MemoryFormat.BINARY)
    with pytest.raises(ValueError, match="more than a page"):
        pool.allocate_batch(2, (PAGE // 2 + 1,), torch.float16, MemoryFormat.BINARY)
    with pytest.raises(TypeError):
        pool.allocate((4,), "float16", MemoryFormat.BINARY)  # type: ignore[arg-type]
    assert pool.allocate((PAGE,), torch.uint8, MemoryFormat.BINARY) is not None  # exactly fits
    assert pool.free_pages == pool.num_pages - 1


@pytest.mark.parametrize(
    "shape",
    [(2**32, 2**32), (2**31, 2**31, 2), (2**62, 4), (2**21, 2**21, 2**21)],
)
def test_a_shape_whose_element_count_wraps_int64_is_too_large(
    pool: HostMemoryPool, shape: tuple[int, ...]
) -> None:
    # torch.Size.numel() wraps at 2**63: (2**32, 2**32) counts 0 elements. Such a shape
    # (from a chunk header that passed its checksum) must not get a page of 0 or a
    # negative number of bytes.
    with pytest.raises(ValueError, match="more than a page"):
        pool.allocate(shape, torch.uint8, MemoryFormat.BINARY)
    with pytest.raises(ValueError, match="more than a page"):
        pool.allocate_batch(1, shape, torch.uint8, MemoryFormat.BINARY)
    assert pool.free_pages == pool.num_pages and pool.used_bytes == 0


def test_a_list_shape_changed_in_place_gets_its_new_size(pool: HostMemoryPool) -> None:
    # allocate() knows the last layout again by the shape object's identity: a list
    # reused with other contents must not get the size it had before.
    shape = [2, 4]
    assert pool.allocate(shape, torch.float16, MemoryFormat.KV_2TD).shape == (2, 4)
    shape[1] = 8
    obj = pool.allocate(shape, torch.float16, MemoryFormat.KV_2TD)
    assert tuple(obj.shape) == (2, 8) and obj.nbytes == 32
    shape[1] = PAGE
    with pytest.raises(ValueError, match="more than a page"):
        pool.allocate(shape, torch.float16, MemoryFormat.KV_2TD)


def test_exhaustion_returns_none_and_batch_is_all_or_nothing(pool: HostMemoryPool) -> None:
    spec = ((16,), torch.uint8, MemoryFormat.BINARY)
    first = pool.allocate_batch(pool.num_pages - 3, *spec)
    assert first is not None and pool.free_pages == 3
    assert pool.allocate_batch(4, *spec) is None
    assert pool.free_pages == 3  # nothing taken
    rest = pool.allocate_batch(3, *spec)
    assert rest is not None and len({o.page for o in first + rest}) == pool.num_pages
    assert pool.allocate(*spec) is None
    assert pool.allocate_batch(0, *spec) == []
    with pytest.raises(ValueError):
        pool.allocate_batch(-1, *spec)
    pool.release_batch(first + rest)
    assert pool.free_pages == pool.num_pages and pool.used_bytes == 0


def test_reference_and_pin_conventions(pool: HostMemoryPool) -> None:
    obj = pool.allocate((8,), torch.uint8, MemoryFormat.BINARY)
    assert (obj.ref_count, obj.pin_count) == (1, 0)
    assert obj.can_evict  # only the owner's reference
    obj.ref_up()  # a reader
    assert not obj.can_evict
    obj.pin()
    obj.pin()
    obj.ref_down()  # the reader is done
    assert obj.is_pinned and not obj.can_evict
    obj.unpin()
    assert obj.is_pinned
    obj.unpin()
    assert obj.can_evict and not obj.is_pinned
    with pytest.raises(ValueError, match="not pinned"):
        obj.unpin()
    obj.ref_down()  # the owner's: the page goes back
    assert obj.is_freed and not obj.can_evict and pool.free_pages == pool.num_pages


def test_last_reference_frees_even_when_pinned(pool: HostMemoryPool) -> None:
    obj = pool.allocate((8,), torch.uint8, MemoryFormat.BINARY)
    obj.pin()
    obj.ref_down()
    assert obj.is_freed and pool.free_pages == pool.num_pages


def test_free_checks_sole_ownership_and_double_free_raises(pool: HostMemoryPool) -> None:
    obj = pool.allocate((8,), torch.uint8, MemoryFormat.BINARY)
    obj.ref_up()
    with pytest.raises(MemoryObjInUseError):
        obj.free()
    assert obj.ref_count == 2 and not obj.is_freed  # nothing changed
    obj.ref_down()
    obj.free()
    with pytest.raises(MemoryObjFreedError):
        obj.free()
    with pytest.raises(MemoryObjFreedError):
        obj.ref_down()


@pytest.mark.parametrize(
    "use",
    [
        lambda o: o.tensor,
        lambda o: o.raw,
        lambda o: o.data_ptr,
        lambda o: o.ref_up(),
        lambda o: o.ref_down(),
        lambda o: o.pin(),
        lambda o: o.unpin(),
        lambda o: o.free(),
    ],
    ids=["tensor", "raw", "data_ptr", "ref_up", "ref_down", "pin", "unpin", "free"],
)
def test_use_after_free_raises(pool: HostMemoryPool, use) -> None:
    obj = pool.allocate((4, 4), torch.float32, MemoryFormat.UNDEFINED)
    _ = obj.tensor  # cached views must not survive the free either
    obj.ref_down()
    with pytest.raises(MemoryObjFreedError, match="freed"):
        use(obj)
    assert "freed" in repr(obj)


def test_metadata_slots_and_no_instance_dict(pool: HostMemoryPool) -> None:
    obj = pool.allocate((8,), torch.uint8, MemoryFormat.BINARY)
    assert obj.key is None and obj.checksum is None
    obj.key, obj.checksum = ("ns", b"h"), 0xDEAD
    assert obj.key == ("ns", b"h") and obj.checksum == 0xDEAD
    assert not hasattr(obj, "__dict__")
    with pytest.raises(AttributeError):
        obj.whatever = 1  # type: ignore[attr-defined]


def test_release_batch_checks_every_object_first(pool: HostMemoryPool) -> None:
    objs = pool.allocate_batch(3, (8,), torch.uint8, MemoryFormat.BINARY)
    other = HostMemoryPool(2 * PAGE, PAGE)
    foreign = other.allocate((8,), torch.uint8, MemoryFormat.BINARY)
    with pytest.raises(ValueError, match="another pool"):
        pool.release_batch([*objs, foreign])
    objs[2].ref_down()
    with pytest.raises(MemoryObjFreedError):
        pool.release_batch(objs)
    assert not objs[0].is_freed and not objs[1].is_freed  # checked before touching any
    pool.release_batch(objs[:2])
    assert pool.free_pages == pool.num_pages
    other.close()


# -- sizing ---------------------------------------------------------------------------
def test_page_size_rounds_up_to_the_alignment() -> None:
    p = HostMemoryPool(10 * 8192, 5000, alignment=8192)
    assert p.page_size == 8192 and p.num_pages == 10
    assert p.capacity_bytes == 10 * 8192 and p.buffer.data_ptr() % 8192 == 0
    p.close()
    with pytest.raises(ValueError, match="power of two"):
        HostMemoryPool(MiB, 4096, alignment=3000)
    with pytest.raises(ValueError):
        HostMemoryPool(MiB, 0)


def test_size_rounds_down_to_whole_pages() -> None:
    p = HostMemoryPool(10 * 4096 + 100, 4096)
    assert p.num_pages == 10 and p.requested_bytes == 10 * 4096 + 100
    p.close()


def test_size_is_bounded_by_available_memory_minus_reserve() -> None:
    reserve = 256 * MiB
    before = psutil.virtual_memory().available
    p = HostMemoryPool(1 << 50, 2 * MiB, reserve_bytes=reserve)  # one PiB: never fits
    assert p.capacity_bytes <= before - reserve + 64 * MiB  # slack: memory moves meanwhile
    assert p.capacity_bytes > 0
    p.close()


def test_size_bound_uses_psutil_and_zero_pages_is_a_clear_error(monkeypatch) -> None:
    vm = namedtuple("vm", "available")
    monkeypatch.setattr(mem.host_pool.psutil, "virtual_memory", lambda: vm(100 * MiB))
    p = HostMemoryPool(1 << 40, MiB, reserve_bytes=40 * MiB)
    assert p.num_pages == 60
    p.close()
    with pytest.raises(ValueError, match="no page"):
        HostMemoryPool(1 << 40, MiB, reserve_bytes=100 * MiB)


def test_construction_does_not_touch_the_pages() -> None:
    size = min(2 << 30, psutil.virtual_memory().available // 4)
    proc = psutil.Process()
    rss = proc.memory_info().rss
    start = time.perf_counter()
    p = HostMemoryPool(size, 256 * KiB, pin_memory=False)
    elapsed = time.perf_counter() - start
    grown = proc.memory_info().rss - rss
    p.close()
    assert elapsed < 0.5, f"creating a {size >> 20} MiB pool took {elapsed:.2f}s"
    assert grown < 64 * MiB, f"RSS grew by {grown >> 20} MiB: pages were touched"


# -- close ----------------------------------------------------------------------------
def test_close_makes_live_objects_unusable() -> None:
    p = HostMemoryPool(4 * PAGE, PAGE)
    a = p.allocate((8,), torch.uint8, MemoryFormat.BINARY)
    _ = a.tensor
    b = p.allocate((8,), torch.uint8, MemoryFormat.BINARY)
    b.ref_down()
    assert p.close() == 1  # a was still allocated
    assert p.close() == 0 and p.closed
    with pytest.raises(MemoryObjFreedError):
        _ = a.tensor
    with pytest.raises(MemoryObjFreedError):
        a.ref_down()
    with pytest.raises(PoolClosedError):
        p.allocate((8,), torch.uint8, MemoryFormat.BINARY)
    with pytest.raises(PoolClosedError):
        p.allocate_batch(1, (8,), torch.uint8, MemoryFormat.BINARY)
    with pytest.raises(PoolClosedError):
        _ = p.buffer
    with pytest.raises(PoolClosedError):
        p.wait_for_free(0.01)


# -- waiting --------------------------------------------------------------------------
def _full_pool() -> tuple[HostMemoryPool, MemoryObj]:
    p = HostMemoryPool(PAGE, PAGE)
    obj = p.allocate((8,), torch.uint8, MemoryFormat.BINARY)
    assert p.free_pages == 0
    return p, obj


def test_wait_for_free_times_out_when_nothing_frees() -> None:
    p, _obj = _full_pool()
    start = time.monotonic()
    assert p.wait_for_free(0.1) is False
    assert 0.09 <= time.monotonic() - start < 2
    with pytest.raises(AllocationTimeoutError, match="no free page"):
        p.allocate_wait((8,), torch.uint8, MemoryFormat.BINARY, 0.05)
    p.close()


def test_wait_for_free_wakes_on_free() -> None:
    p, obj = _full_pool()
    timer = threading.Timer(0.05, obj.ref_down)
    start = time.monotonic()
    timer.start()
    assert p.wait_for_free(5.0) is True
    assert time.monotonic() - start < 2
    assert p.wait_for_free(0) is True  # a page is free: no wait
    timer.join()
    p.close()


def test_allocate_wait_gets_the_page_another_thread_frees() -> None:
    p, obj = _full_pool()
    timer = threading.Timer(0.05, obj.ref_down)
    timer.start()
    got = p.allocate_wait((8,), torch.uint8, MemoryFormat.BINARY, 5.0)
    assert got.page == obj.page and not got.is_freed
    timer.join()
    p.close()


def _in_thread(fn, timeout_s: float = 2.0) -> object:
    """fn()'s result or exception, from a thread given timeout_s (a hang is a failure)."""
    out: list[object] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as e:
            out.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout_s)
    assert out, f"still waiting after {timeout_s}s"
    return out[0]


def test_timeouts_that_are_not_a_number_of_seconds() -> None:
    p, obj = _full_pool()
    shape = (8,)
    # NaN once waited with no deadline (spinning a core) until a page freed.
    for call in (
        lambda: p.allocate_wait(shape, torch.uint8, MemoryFormat.BINARY, math.nan),
        lambda: p.wait_for_free(math.nan),
    ):
        try:
            got = _in_thread(call)
        finally:
            if obj.is_freed:  # the waiter took the page: give it back for the next
                got.ref_down()  # type: ignore[union-attr]
                obj = p.allocate(shape, torch.uint8, MemoryFormat.BINARY)
        assert isinstance(got, ValueError) and "NaN" in str(got)
    # Negative: one try, no wait.
    start = time.monotonic()
    assert p.wait_for_free(-1.0) is False
    with pytest.raises(AllocationTimeoutError):
        p.allocate_wait(shape, torch.uint8, MemoryFormat.BINARY, -1.0)
    assert time.monotonic() - start < 0.5
    # Infinity, or more than a lock wait takes: no deadline (they raised OverflowError
    # at once), so a free is waited for.
    for call in (
        lambda: p.wait_for_free(math.inf),
        lambda: p.allocate_wait(shape, torch.uint8, MemoryFormat.BINARY, math.inf),
        lambda: p.wait_for_free(1e300),
        lambda: p.allocate_wait(shape, torch.uint8, MemoryFormat.BINARY, 1e300),
    ):
        timer = threading.Timer(0.1, obj.ref_down)
        timer.start()
        got = _in_thread(call)
        timer.join()
        if got is True:
            obj = p.allocate(shape, torch.uint8, MemoryFormat.BINARY)
        else:
            assert isinstance(got, MemoryObj) and got.page == obj.page, got
            obj = got
    p.close()


def test_close_wakes_waiters() -> None:
    p, _obj = _full_pool()
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            p.wait_for_free(5.0)
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=wait)
    t.start()
    time.sleep(0.05)
    p.close()
    t.join(2)
    assert not t.is_alive() and isinstance(errors[0], PoolClosedError)


# -- concurrency ----------------------------------------------------------------------
def test_threads_allocating_and_freeing_lose_no_page() -> None:
    p = HostMemoryPool(16 * 4096, 4096)
    n_threads, rounds = 4, 3000
    failures: list[str] = []

    def work(tid: int) -> None:
        held: list[MemoryObj] = []
        for i in range(rounds):
            if i % 7 == 3:
                batch = p.allocate_batch(3, (64,), torch.uint8, MemoryFormat.BINARY)
                if batch:
                    held.extend(batch)
            else:
                o = p.allocate((64,), torch.uint8, MemoryFormat.BINARY)
                if o is not None:
                    held.append(o)
            for o in held:
                o.raw.fill_(tid)
            if len(held) > 2 or i % 5 == 0:
                for o in held:
                    if not bool((o.raw == tid).all()):
                        failures.append(f"thread {tid}: page {o.page} written by another")
                    o.ref_up()
                    o.ref_down()
                p.release_batch(held) if i % 2 else [o.ref_down() for o in held]
                held.clear()
        for o in held:
            o.ref_down()

    threads = [threading.Thread(target=work, args=(t,)) for t in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, failures[:5]
    assert p.free_pages == p.num_pages and p.used_bytes == 0
    assert sorted(p._free) == list(range(p.num_pages))  # no page duplicated or lost
    p.close()


# -- random sequences -----------------------------------------------------------------
class PoolMachine(RuleBasedStateMachine):
    """Random allocate/batch/ref/free sequences against a model of what is live."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = HostMemoryPool(12 * 4096, 4096)
        self.live: dict[int, tuple[MemoryObj, int]] = {}  # id → (obj, its pattern)
        self.dead: list[MemoryObj] = []
        self.next_pattern = 1

    def _own(self, obj: MemoryObj) -> None:
        pattern = self.next_pattern % 251 + 1
        self.next_pattern += 1
        obj.raw.fill_(pattern)
        self.live[id(obj)] = (obj, pattern)

    @rule(nbytes=st.integers(0, 4096))
    def allocate(self, nbytes: int) -> None:
        obj = self.pool.allocate((nbytes,), torch.uint8, MemoryFormat.BINARY)
        if len(self.live) == self.pool.num_pages:
            assert obj is None
        else:
            assert obj is not None and obj.nbytes == nbytes
            self._own(obj)

    @rule(n=st.integers(0, 6), words=st.integers(1, 1024))
    def allocate_batch(self, n: int, words: int) -> None:
        free_before = self.pool.free_pages
        objs = self.pool.allocate_batch(n, (words,), torch.int32, MemoryFormat.KV_2TD)
        if n > free_before:
            assert objs is None and self.pool.free_pages == free_before
        else:
            assert objs is not None and len(objs) == n
            for o in objs:
                self._own(o)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), extra_ref=st.booleans())
    def free_one(self, data: st.DataObject, extra_ref: bool) -> None:
        key = data.draw(st.sampled_from(sorted(self.live)))
        obj, _ = self.live.pop(key)
        if extra_ref:  # a reader comes and goes first
            obj.ref_up()
            obj.ref_down()
        obj.ref_down()
        self.dead.append(obj)

    @precondition(lambda self: len(self.live) >= 2)
    @rule()
    def release_half(self) -> None:
        keys = sorted(self.live)[::2]
        objs = [self.live.pop(k)[0] for k in keys]
        self.pool.release_batch(objs)
        self.dead.extend(objs)

    @precondition(lambda self: self.dead)
    @rule(data=st.data())
    def dead_objects_stay_dead(self, data: st.DataObject) -> None:
        obj = data.draw(st.sampled_from(self.dead))
        for use in (obj.ref_down, obj.ref_up, obj.pin, obj.free, lambda: obj.tensor):
            with pytest.raises(MemoryObjFreedError):
                use()

    @invariant()
    def pages_disjoint_and_counted(self) -> None:
        objs = [o for o, _ in self.live.values()]
        spans = sorted((o.data_ptr, o.data_ptr + self.pool.page_size) for o in objs)
        for (_, end), (start, _) in itertools.pairwise(spans):
            assert end <= start, "two live objects share page bytes"
        assert self.pool.used_pages == len(objs)
        assert self.pool.free_pages + len(objs) == self.pool.num_pages
        assert self.pool.used_bytes == sum(o.nbytes for o in objs)

    @invariant()
    def patterns_intact(self) -> None:
        for obj, pattern in self.live.values():
            assert bool((obj.raw == pattern).all()), f"page {obj.page} was overwritten"

    def teardown(self) -> None:
        for obj, _ in self.live.values():
            obj.ref_down()
        assert self.pool.free_pages == self.pool.num_pages, "pages leaked"
        assert self.pool.used_bytes == 0
        self.pool.close()


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)

"""The storage manager's share of the miss reasons: a lower tier that raises is an
`error` miss, one still answering at the load's deadline a `timeout` miss per chunk,
and a load abandoned before its deadline (a prefetch released) no miss at all."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import pytest
import torch
from kvtest.waiting import wait_for

from kvmesh.common.keys import ChunkKey
from kvmesh.common.memory import HostMemoryPool, MemoryFormat
from kvmesh.common.observability import Metrics
from kvmesh.services.worker.events import KVEventBuffer
from kvmesh.services.worker.loop_thread import LoopThread
from kvmesh.services.worker.storage_manager import StorageManager
from kvmesh.services.worker.tiers.host import HostTier
from kvmesh.services.worker.tiers.misses import MissReason, TierMisses

KEYS = [ChunkKey("0123456789abcdef", bytes([i]) * 16) for i in range(3)]


class StallingTier:
    """A lower tier whose gets never end (or raise, with `fail`)."""

    name = "stall"

    def __init__(self, metrics: Metrics, fail: bool = False) -> None:
        self.misses = TierMisses(self.name, metrics)
        self.fail = fail
        self.started = 0

    async def aget(self, key, allocator):
        self.started += 1
        if self.fail:
            raise OSError("gone")
        await asyncio.sleep(3600)

    def close(self) -> None:
        return None


@pytest.fixture
def parts() -> Iterator[tuple[HostTier, Metrics, LoopThread]]:
    metrics = Metrics()
    pool = HostMemoryPool(1 << 20, page_size=4096)
    loop = LoopThread("misses-test")
    l1 = HostTier(pool, metrics=metrics)
    yield l1, metrics, loop
    loop.stop()
    l1.close()
    pool.close()


def counts(metrics: Metrics, tier: str) -> dict[str, float]:
    out = {}
    for r in MissReason:
        value = metrics.value("chunk_misses_total", {"tier": tier, "reason": r.value})
        if value:
            out[r.value] = value
    return out


def manager(l1, lower, loop, timeout_s: float = 0.2) -> StorageManager:
    return StorageManager(l1, [lower], loop, KVEventBuffer(), io_timeout_s=timeout_s)


def test_a_raising_tier_is_an_error_miss_per_chunk(parts) -> None:
    l1, metrics, loop = parts
    sm = manager(l1, StallingTier(metrics, fail=True), loop)
    objs, _ = sm.get_prefix(KEYS)
    assert objs == []
    assert counts(metrics, "stall") == {"error": 3}
    assert counts(metrics, "l1") == {"not_stored": 3}


def test_the_load_deadline_is_a_timeout_miss_per_chunk(parts) -> None:
    l1, metrics, loop = parts
    sm = manager(l1, StallingTier(metrics), loop, timeout_s=0.2)
    objs, _ = sm.get_prefix(KEYS)
    assert objs == []
    # The cancellation lands on the loop just after the caller gave up.
    wait_for(lambda: counts(metrics, "stall") == {"timeout": 3}, 5, "three timeout misses")


def test_an_abandoned_load_is_no_miss(parts) -> None:
    l1, metrics, loop = parts
    tier = StallingTier(metrics)
    sm = manager(l1, tier, loop, timeout_s=30.0)
    fut = loop.submit(sm.aget_prefix(KEYS, 30.0))  # a prefetch: a deadline far off
    wait_for(lambda: tier.started == 3, 5, "the gets started")
    fut.cancel()  # released before it finished
    wait_for(lambda: fut.cancelled(), 5, "the prefetch cancelled")
    loop.run(asyncio.sleep(0.05), 5)  # the cancellations have run
    assert counts(metrics, "stall") == {}


class AllocatingTier:
    """A lower tier that allocates on the loop, as a plugin may (tiers/base.py)."""

    name = "alloc"

    def __init__(self, metrics: Metrics, waits_for_pages: bool = False) -> None:
        self.misses = TierMisses(self.name, metrics)
        self.waits_for_pages = waits_for_pages
        self.allocators: list[object] = []

    async def aget(self, key, allocator):
        self.allocators.append(allocator)
        return allocator.allocate((1024,), torch.float32, MemoryFormat.BINARY)

    def close(self) -> None:
        return None


def test_tiers_get_an_allocator_that_never_waits_on_the_loop() -> None:
    # Every L1 page held elsewhere: a tier's allocation on the loop answers None at once
    # (a miss), where the L1's own allocate would hold the loop for alloc_timeout_s.
    metrics = Metrics()
    pool = HostMemoryPool(2 * 4096, page_size=4096)
    loop = LoopThread("alloc-test")
    l1 = HostTier(pool, metrics=metrics, alloc_timeout_s=3.0)
    held = [pool.allocate((1024,), torch.float32, MemoryFormat.BINARY) for _ in range(2)]
    try:
        tier = AllocatingTier(metrics)
        sm = manager(l1, tier, loop, timeout_s=5.0)
        t0 = time.monotonic()
        assert sm.get_prefix(KEYS[:1]) == ([], [])
        assert time.monotonic() - t0 < 1.0
        assert tier.allocators and tier.allocators[0] is not l1
        # A tier that waits on its own threads says so, and gets the L1 itself.
        own = AllocatingTier(metrics, waits_for_pages=True)
        assert manager(l1, own, loop)._allocators[id(own)] is l1
        # A page back: the same tier's get lands.
        held.pop().ref_down()
        objs, names = sm.get_prefix(KEYS[:1])
        assert names == ["alloc"] and objs[0].nbytes == 4096
        objs[0].ref_down()
    finally:
        for obj in held:
            obj.ref_down()
        loop.stop()
        l1.close()
        pool.close()


class CountingTier:
    """A tier of another package (no `misses` of its own): its lookups run on the
    manager's lookup threads."""

    name = "plain"

    def batched_contains(self, keys, pin=False) -> int:
        return 0

    def close(self) -> None:
        return None


def test_no_lookup_threads_are_made_after_close() -> None:
    """A lookup racing close (or after it) made a new pool of lookup threads that
    nobody would shut down."""
    pool = HostMemoryPool(1 << 20, page_size=4096)
    loop = LoopThread("misses-close")
    sm = StorageManager(HostTier(pool, metrics=Metrics()), [CountingTier()], loop, KVEventBuffer())

    def lookup_threads() -> set[threading.Thread]:
        return {t for t in threading.enumerate() if t.name.startswith("kvmesh-lookup")}

    before = lookup_threads()
    try:
        assert sm.prefix_hits(KEYS)[0] == 0  # makes the pool
        assert lookup_threads() - before
        sm.close()
        assert sm.prefix_hits(KEYS)[0] == 0  # a miss, not an error
        wait_for(lambda: not lookup_threads() - before, 5, "the lookup threads to end")
    finally:
        loop.stop()
        pool.close()


class SwallowingTier:
    """A tier whose get swallows the cancel and answers None (a plugin may)."""

    name = "swallow"

    def __init__(self, metrics: Metrics) -> None:
        self.misses = TierMisses(self.name, metrics)

    async def aget(self, key, allocator):
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            return None

    def close(self) -> None:
        return None


def test_a_tier_that_swallows_the_cancel_gives_the_tiers_below_no_time(parts) -> None:
    """The prefetch's timer cancels once: past it, the next tier was asked with no
    deadline at all (3.2 s for a 0.2 s prefetch in a review's run)."""
    l1, metrics, loop = parts
    below = StallingTier(metrics)
    sm = StorageManager(l1, [SwallowingTier(metrics), below], loop, KVEventBuffer())
    t0 = time.monotonic()
    objs, _ = loop.run(sm.aget_prefix(KEYS, 0.2), 10)
    assert objs == [] and time.monotonic() - t0 < 2.0
    assert below.started == 0
    assert counts(metrics, "swallow") == {"timeout": 3}
    assert counts(metrics, "stall") == {}

"""The storage manager's share of the miss reasons: a lower tier that raises is an
`error` miss, one still answering at the load's deadline a `timeout` miss per chunk,
and a load abandoned before its deadline (a prefetch released) no miss at all."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from kvtest.waiting import wait_for

from kvmesh.common.keys import ChunkKey
from kvmesh.common.memory import HostMemoryPool
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
    sm = manager(l1, tier, loop)
    fut = loop.submit(sm.aget_prefix(KEYS))  # a prefetch: no deadline of its own
    wait_for(lambda: tier.started == 3, 5, "the gets started")
    fut.cancel()  # released before it finished
    wait_for(lambda: fut.cancelled(), 5, "the prefetch cancelled")
    loop.run(asyncio.sleep(0.05), 5)  # the cancellations have run
    assert counts(metrics, "stall") == {}

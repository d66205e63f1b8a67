"""DiskTier on its own: round trips, de-duplication, references, eviction, verified
reads, restart and re-index, the directory lock, a vanished directory, an event loop
that is never blocked, transient read errors, close during reads, and rewrites racing
puts and removes."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from kvtest.disk import MiB, chunk_files, expected_bytes, key_of, make_chunk, temp_files

from kvmesh.common.chunk_codec import FILE_LAYOUT
from kvmesh.common.codecs import make_codec
from kvmesh.common.memory import HostMemoryPool, MemoryFormat
from kvmesh.common.observability import Metrics
from kvmesh.services.worker.tiers import disk as disk_mod
from kvmesh.services.worker.tiers.disk import DiskTier
from kvmesh.services.worker.tiers.disk_executor import Priority
from kvmesh.services.worker.tiers.disk_format import chunk_file_name, temp_file_name
from kvmesh.services.worker.tiers.disk_scan import check_file, list_dir, plan_eviction

HEADER_SIZE = FILE_LAYOUT.size
KiB = 1024
SIZE = 64 * KiB  # a 4 KiB multiple: O_DIRECT
ODD = 64 * KiB - 100  # not one: buffered
FILE = HEADER_SIZE + SIZE


@pytest.fixture
def pool() -> Iterator[HostMemoryPool]:
    p = HostMemoryPool(8 * MiB, SIZE, pin_memory=False)
    yield p
    p.close()


def new_tier(path: Path, max_size: int = 64 * MiB, **kw) -> DiskTier:
    kw.setdefault("io_threads", 2)
    tier = DiskTier(path, max_size, **kw)
    assert tier.wait_indexed(10)
    return tier


@pytest.fixture
def tier(tmp_path: Path) -> Iterator[DiskTier]:
    t = new_tier(tmp_path / "d")
    yield t
    t.close()


def put(tier: DiskTier, pool: HostMemoryPool, i: int, nbytes: int = SIZE) -> None:
    obj = make_chunk(pool, i, nbytes)
    tier.submit_put(key_of(i), obj)
    obj.ref_down()  # the tier holds its own reference until the write ends


def read_ok(tier: DiskTier, pool: HostMemoryPool, i: int, nbytes: int = SIZE) -> bool | None:
    """None on a miss, else whether the bytes are exactly chunk i's."""
    obj = tier.get(key_of(i), pool)
    if obj is None:
        return None
    try:
        return obj.nbytes == nbytes and torch.equal(obj.tensor, expected_bytes(i, nbytes))
    finally:
        obj.ref_down()


def metric(t: DiskTier, name: str, **labels: str) -> float:
    return t.stats.metrics.value(name, labels) or 0.0


@pytest.mark.parametrize("o_direct", [True, False], ids=["direct", "buffered"])
def test_round_trip_aligned_and_not(tmp_path: Path, pool: HostMemoryPool, o_direct: bool) -> None:
    tier = new_tier(tmp_path / "d", o_direct=o_direct)
    try:
        put(tier, pool, 0, SIZE)
        put(tier, pool, 1, ODD)
        assert tier.flush(5)
        assert (
            len(tier) == 2
            and tier.contains(key_of(0))
            and tier.batched_contains([key_of(0), key_of(1), key_of(2)]) == 2
        )
        assert sorted(chunk_files(tmp_path / "d")) == sorted(
            chunk_file_name(key_of(i)) for i in (0, 1)
        )
        assert os.path.getsize(tmp_path / "d" / chunk_file_name(key_of(1))) == HEADER_SIZE + ODD
        assert read_ok(tier, pool, 0, SIZE) and read_ok(tier, pool, 1, ODD)
        assert read_ok(tier, pool, 2) is None
        assert pool.used_bytes == 0  # every buffer went back
        assert tier.used_bytes == 2 * HEADER_SIZE + SIZE + ODD
        assert metric(tier, "disk_gets_total", result="hit") == 2
        assert metric(tier, "disk_gets_total", result="miss") == 1
        assert metric(tier, "disk_puts_total", result="written") == 2
        assert temp_files(tmp_path / "d") == []
    finally:
        tier.close()


def test_aget_and_metadata_of_the_read(tier: DiskTier, pool: HostMemoryPool) -> None:
    obj = pool.allocate((2, 4, 8, 128), torch.bfloat16, MemoryFormat.KV_2LTD)
    assert obj is not None
    obj.tensor.copy_(torch.randn(2, 4, 8, 128))
    ref = obj.tensor.clone()
    tier.submit_put(key_of(5), obj)
    obj.ref_down()
    tier.flush(5)

    async def main():
        return await tier.aget(key_of(5), pool)

    got = asyncio.run(main())
    assert got is not None
    assert (tuple(got.shape), got.dtype, got.fmt, got.key) == (
        (2, 4, 8, 128),
        torch.bfloat16,
        MemoryFormat.KV_2LTD,
        key_of(5),
    )
    assert torch.equal(got.tensor.view(torch.int16), ref.view(torch.int16))
    got.ref_down()


def test_put_is_deduplicated(tier: DiskTier, pool: HostMemoryPool) -> None:
    put(tier, pool, 0)
    put(tier, pool, 0)  # while the first may still be in flight
    tier.flush(5)
    put(tier, pool, 0)  # and after
    tier.flush(5)
    assert metric(tier, "disk_puts_total", result="written") == 1
    assert metric(tier, "disk_puts_total", result="duplicate") == 2
    assert len(chunk_files(tier.path)) == 1


def _occupy(submit, n: int) -> threading.Event:
    """Occupy n threads of a pool (submit) until the returned event is set."""
    gate = threading.Event()
    started = threading.Barrier(n + 1)

    def hold() -> None:
        started.wait()
        gate.wait(10)

    for _ in range(n):
        submit(hold)
    started.wait(5)
    return gate


def gate_all(tier: DiskTier, n: int) -> threading.Event:
    """Occupy all n I/O threads until the returned event is set."""
    return _occupy(lambda fn: tier._exec.submit(Priority.PREFETCH, fn), n)


def gate_checks(tier: DiskTier) -> threading.Event:
    """Occupy every thread that checks reads until the returned event is set."""
    return _occupy(tier._checks.submit, disk_mod.CHECK_THREADS)


def test_source_reference_is_held_until_the_write_ends(
    tier: DiskTier, pool: HostMemoryPool
) -> None:
    gate = gate_all(tier, 2)
    obj = make_chunk(pool, 0, SIZE)
    tier.submit_put(key_of(0), obj)
    assert obj.ref_count == 2  # the caller's and the tier's
    assert not tier.contains(key_of(0))  # not readable before it is written
    gate.set()
    assert tier.flush(5)
    assert obj.ref_count == 1
    obj.ref_down()
    assert pool.used_bytes == 0
    assert read_ok(tier, pool, 0)


def test_remove_while_writing_leaves_no_file(tier: DiskTier, pool: HostMemoryPool) -> None:
    gate = gate_all(tier, 2)
    put(tier, pool, 0)
    assert tier.remove(key_of(0))
    assert not tier.remove(key_of(0))
    gate.set()
    tier.flush(5)
    assert chunk_files(tier.path) == [] and len(tier) == 0 and tier.used_bytes == 0
    put(tier, pool, 0)  # the key can be written again afterwards
    tier.flush(5)
    assert read_ok(tier, pool, 0)


def test_eviction_by_size_follows_the_policy(tmp_path: Path, pool: HostMemoryPool) -> None:
    tier = new_tier(tmp_path / "d", max_size=3 * FILE)
    try:
        for i in range(3):
            put(tier, pool, i)
            tier.flush(5)
        assert read_ok(tier, pool, 0)  # 0 is now the most recently used
        put(tier, pool, 3)
        tier.flush(5)
        assert [tier.contains(key_of(i)) for i in range(4)] == [True, False, True, True]
        assert sorted(chunk_files(tier.path)) == sorted(
            chunk_file_name(key_of(i)) for i in (0, 2, 3)
        )
        assert tier.used_bytes == 3 * FILE
        assert metric(tier, "evictions_total", tier="disk") == 1

        # Pinned chunks are never evicted; with everything pinned a put is dropped.
        assert tier.batched_contains([key_of(0), key_of(2), key_of(3)], pin=True) == 3
        put(tier, pool, 4)
        tier.flush(5)
        assert not tier.contains(key_of(4))
        assert metric(tier, "disk_puts_total", result="no_space") == 1
        assert not tier.remove(key_of(0))  # pinned
        assert tier.clear() == 0
        for i in (0, 2, 3):
            assert tier.unpin(key_of(i))
        assert not tier.unpin(key_of(0))
        put(tier, pool, 4)
        tier.flush(5)
        # LRU order was 2, 0, 3 (pins do not count as uses): 2 goes.
        assert [tier.contains(key_of(i)) for i in (0, 2, 3, 4)] == [True, False, True, True]
        assert tier.clear() == 3
        tier.flush(5)
        assert chunk_files(tier.path) == [] and tier.used_bytes == 0
    finally:
        tier.close()


def test_chunk_larger_than_the_tier_is_dropped(tmp_path: Path, pool: HostMemoryPool) -> None:
    tier = new_tier(tmp_path / "d", max_size=FILE - 1)
    try:
        put(tier, pool, 0)
        tier.flush(5)
        assert len(tier) == 0 and metric(tier, "disk_puts_total", result="no_space") == 1
    finally:
        tier.close()


def test_a_file_claiming_a_chunk_over_the_page_is_not_indexed(
    tmp_path: Path, pool: HostMemoryPool
) -> None:
    """A header claiming more than a pool page (a damaged or forged file: here a valid
    one of a larger geometry) would be a hit on every lookup and a failed read on
    every get: with the page size known, the re-index drops it."""
    d = tmp_path / "d"
    with HostMemoryPool(4 * MiB, 2 * SIZE, pin_memory=False) as big:
        tier = new_tier(d)
        put(tier, pool, 0)
        put(tier, big, 1, 2 * SIZE)
        tier.flush(5)
        tier.close()
    problem = check_file(str(d), chunk_file_name(key_of(1)), 0, 0, max_nbytes=SIZE).problem
    assert problem == f"header says {2 * SIZE} bytes, more than a chunk here ({SIZE})"
    assert check_file(str(d), chunk_file_name(key_of(0)), 0, 0, max_nbytes=SIZE).ok

    again = new_tier(d, max_chunk_bytes=pool.page_size)
    try:
        assert again.contains(key_of(0)) and not again.contains(key_of(1))
        assert read_ok(again, pool, 0)
        assert sorted(chunk_files(d)) == [chunk_file_name(key_of(0))]
        assert metric(again, "disk_reindex_files_total", result="deleted") == 1
    finally:
        again.close()


@pytest.mark.parametrize(
    "offset",
    [40, 110, 130, HEADER_SIZE, HEADER_SIZE + SIZE // 2, HEADER_SIZE + SIZE - 1],
    ids=["shape", "checksum", "key", "payload-first", "payload-middle", "payload-last"],
)
def test_flipped_byte_is_a_miss_never_wrong_data(
    tier: DiskTier, pool: HostMemoryPool, offset: int
) -> None:
    put(tier, pool, 0)
    put(tier, pool, 1)
    tier.flush(5)
    path = Path(tier.path) / chunk_file_name(key_of(0))
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x40]))
    assert read_ok(tier, pool, 0) is None
    assert metric(tier, "disk_corrupt_total") == 1
    assert not path.exists() and not tier.contains(key_of(0))
    assert read_ok(tier, pool, 1)  # the other chunk is untouched
    assert pool.used_bytes == 0


def test_truncated_or_missing_file_is_a_miss(tier: DiskTier, pool: HostMemoryPool) -> None:
    for i in range(2):
        put(tier, pool, i)
    tier.flush(5)
    os.truncate(Path(tier.path) / chunk_file_name(key_of(0)), HEADER_SIZE + 10)
    os.unlink(Path(tier.path) / chunk_file_name(key_of(1)))
    assert read_ok(tier, pool, 0) is None and read_ok(tier, pool, 1) is None
    assert metric(tier, "disk_corrupt_total") == 1  # the truncated one
    assert len(tier) == 0 and tier.used_bytes == 0


def test_restart_reindexes_and_serves_the_same_bytes(tmp_path: Path, pool: HostMemoryPool) -> None:
    tier = new_tier(tmp_path / "d")
    for i in range(6):
        put(tier, pool, i, SIZE if i % 2 == 0 else ODD)
    tier.flush(5)
    tier.close()
    assert not os.path.exists(tmp_path / "d" / ".lock") or True  # the lock file may stay

    again = new_tier(tmp_path / "d")
    try:
        assert len(again) == 6 and again.used_bytes == 3 * (HEADER_SIZE + SIZE) + 3 * (
            HEADER_SIZE + ODD
        )
        for i in range(6):
            assert read_ok(again, pool, i, SIZE if i % 2 == 0 else ODD)
        assert metric(again, "disk_reindex_files_total", result="kept") == 6
    finally:
        again.close()


def test_restart_deletes_temporary_and_failing_files_and_enforces_max_size(
    tmp_path: Path, pool: HostMemoryPool
) -> None:
    d = tmp_path / "d"
    tier = new_tier(d)
    for i in range(6):
        put(tier, pool, i)
        tier.flush(5)
        os.utime(d / chunk_file_name(key_of(i)), ns=(10**18 + i * 10**9,) * 2)
    tier.close()
    (d / temp_file_name(key_of(20), "deadrun")).write_bytes(b"x" * 1000)
    (d / chunk_file_name(key_of(21))).write_bytes(b"garbage" * 100)
    (d / "README").write_text("not ours")
    # What `kvmesh disk scan` predicts for a 4-chunk tier: the two oldest go.
    listing = list_dir(str(d))
    files = [check_file(str(d), *c) for c in listing.chunks]
    _, evicted = plan_eviction([f for f in files if f.ok], 4 * FILE)
    assert [f.header.key for f in evicted] == [key_of(0), key_of(1)]

    again = new_tier(d, max_size=4 * FILE)
    try:
        again.flush(5)
        assert [again.contains(key_of(i)) for i in range(6)] == [False] * 2 + [True] * 4
        assert sorted(os.listdir(d)) == sorted(
            [".lock", "README", *(chunk_file_name(key_of(i)) for i in range(2, 6))]
        )
        assert again.used_bytes == 4 * FILE
        assert metric(again, "disk_reindex_files_total", result="deleted") == 2
        assert metric(again, "disk_reindex_files_total", result="evicted") == 2
    finally:
        again.close()


def test_lookups_miss_until_indexed_and_nothing_blocks(
    tmp_path: Path, pool: HostMemoryPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    d = tmp_path / "d"
    tier = new_tier(d)
    for i in range(3):
        put(tier, pool, i)
    tier.flush(5)
    tier.close()

    gate = threading.Event()
    real_check = disk_mod.check_files

    def slow_check(*args, **kw):
        gate.wait(10)
        yield from real_check(*args, **kw)

    monkeypatch.setattr(disk_mod, "check_files", slow_check)
    t0 = time.monotonic()
    again = DiskTier(d, 64 * MiB, io_threads=2)
    try:
        assert time.monotonic() - t0 < 1.0  # the constructor does not wait for the scan
        assert not again.contains(key_of(0)) and read_ok(again, pool, 0) is None
        put(again, pool, 7)  # puts work during the scan
        again.flush(5)
        assert read_ok(again, pool, 7)
        gate.set()
        assert again.wait_indexed(10)
        assert all(read_ok(again, pool, i) for i in range(3))
    finally:
        gate.set()
        again.close()


def test_aget_never_blocks_the_event_loop(tier: DiskTier, pool: HostMemoryPool) -> None:
    put(tier, pool, 0)
    tier.flush(5)
    gate = gate_all(tier, 2)

    async def main() -> tuple[int, bool | None]:
        ticks = 0
        read = asyncio.ensure_future(tier.aget(key_of(0), pool))
        threading.Timer(0.3, gate.set).start()
        while not read.done():
            await asyncio.sleep(0.01)
            ticks += 1
        obj = read.result()
        ok = obj is not None and torch.equal(obj.tensor, expected_bytes(0, SIZE))
        obj.ref_down()
        return ticks, ok

    ticks, ok = asyncio.run(main())
    assert ok and ticks >= 10  # the loop kept turning while the read waited


class BlockingAllocator:
    """Allocates from a pool, first waiting on an event (runs on an I/O thread)."""

    def __init__(self, pool: HostMemoryPool) -> None:
        self.pool = pool
        self.entered = threading.Event()
        self.release = threading.Event()

    def allocate(self, shape, dtype, fmt):
        self.entered.set()
        self.release.wait(10)
        return self.pool.allocate(shape, dtype, fmt)


@pytest.mark.parametrize("when", ["queued", "running", "checking"])
def test_cancelled_aget_returns_its_buffer(tier: DiskTier, pool: HostMemoryPool, when: str) -> None:
    put(tier, pool, 0)
    tier.flush(5)
    alloc = BlockingAllocator(pool)
    gate = gate_all(tier, 2) if when == "queued" else None
    if when == "checking":  # read and waiting for its check when cancelled
        alloc.release.set()
        gate = gate_checks(tier)

    async def main() -> None:
        task = asyncio.ensure_future(tier.aget(key_of(0), alloc))
        await asyncio.sleep(0.05)
        if when == "running":
            assert alloc.entered.wait(5)
        if when == "checking":
            deadline = time.monotonic() + 5
            # Read, and its check queued behind the held check threads.
            while tier._checks._work_queue.qsize() == 0:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    alloc.release.set()
    if gate is not None:
        gate.set()
    tier.flush(5)
    deadline = time.monotonic() + 5
    while pool.used_bytes and time.monotonic() < deadline:
        time.sleep(0.01)  # a cancelled check gives its buffer back on the check thread
    assert pool.used_bytes == 0
    # and the chunk is not stuck as "being read": it can still be evicted or removed
    assert tier.remove(key_of(0))


def test_second_tier_on_a_directory_waits_for_the_first(
    tmp_path: Path, pool: HostMemoryPool
) -> None:
    first = new_tier(tmp_path / "d")
    put(first, pool, 0)
    first.flush(5)
    second = DiskTier(tmp_path / "d", 64 * MiB, retry_s=0.1)
    try:
        assert second.degraded is not None and "in use" in second.degraded
        assert not second.contains(key_of(0))
        put(second, pool, 1)  # dropped: degraded
        assert metric(second, "disk_puts_total", result="degraded") == 1
        first.close()
        time.sleep(0.15)
        put(second, pool, 1)  # the probe: takes the directory, then re-indexes it
        second.flush(5)
        assert second.degraded is None
        assert second.wait_indexed(5)
        assert read_ok(second, pool, 0) and read_ok(second, pool, 1)
    finally:
        first.close()
        second.close()


def test_vanished_directory_degrades_then_recovers(tmp_path: Path, pool: HostMemoryPool) -> None:
    tier = new_tier(tmp_path / "d", retry_s=0.2)
    try:
        put(tier, pool, 0)
        tier.flush(5)
        shutil.rmtree(tmp_path / "d")
        put(tier, pool, 1)
        tier.flush(5)
        assert tier.degraded == "directory vanished"
        assert metric(tier, "disk_degraded") == 1
        assert len(tier) == 0 and tier.used_bytes == 0  # its files went with it
        assert read_ok(tier, pool, 0) is None
        put(tier, pool, 2)  # dropped, before the retry time
        assert metric(tier, "disk_puts_total", result="degraded") == 1
        time.sleep(0.25)
        put(tier, pool, 2)  # the probe recreates the directory
        tier.flush(5)
        assert tier.degraded is None and metric(tier, "disk_degraded") == 0
        assert read_ok(tier, pool, 2)
        assert (tmp_path / "d" / ".lock").exists()
    finally:
        tier.close()
    assert pool.used_bytes == 0


def test_a_file_that_cannot_be_deleted_keeps_its_bytes_counted(
    tmp_path: Path, pool: HostMemoryPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An eviction whose unlink fails (a read-only remount): the chunk is no longer
    served, its bytes still count against max_size, the tier degrades; once it recovers
    the file goes and its bytes with it."""
    tier = new_tier(tmp_path / "d", max_size=3 * FILE, retry_s=0.2)
    stuck = os.path.join(tier.path, chunk_file_name(key_of(0)))
    fail = threading.Event()
    unlink = os.unlink

    def failing_unlink(path, *a, **kw):
        if fail.is_set() and os.fspath(path) == stuck:
            raise OSError(errno.EROFS, "Read-only file system")
        return unlink(path, *a, **kw)

    monkeypatch.setattr(disk_mod.os, "unlink", failing_unlink)
    try:
        for i in range(3):
            put(tier, pool, i)
            tier.flush(5)
        fail.set()
        put(tier, pool, 3)  # evicts 0, whose file stays
        tier.flush(5)
        assert not tier.contains(key_of(0)) and read_ok(tier, pool, 0) is None
        assert chunk_file_name(key_of(0)) in chunk_files(tier.path)
        assert tier.used_bytes == 4 * FILE == FILE * len(chunk_files(tier.path))
        assert tier.degraded is not None and "EROFS" in tier.degraded
        assert metric(tier, "disk_io_errors_total", op="delete") == 1
        fail.clear()
        time.sleep(0.25)
        put(tier, pool, 4)  # the probe succeeds: the stuck file goes
        tier.flush(5)
        assert tier.degraded is None
        assert chunk_file_name(key_of(0)) not in chunk_files(tier.path)
        assert tier.used_bytes == FILE * len(chunk_files(tier.path)) <= 3 * FILE
        assert read_ok(tier, pool, 4)
    finally:
        tier.close()


def test_close_drops_queued_puts_and_returns_their_buffers(
    tmp_path: Path, pool: HostMemoryPool
) -> None:
    tier = new_tier(tmp_path / "d")
    gate = gate_all(tier, 2)
    for i in range(5):
        put(tier, pool, i)
    assert pool.used_bytes == 5 * SIZE  # held by the queued writes
    threading.Timer(0.1, gate.set).start()
    tier.close()
    tier.close()  # idempotent
    assert pool.used_bytes == 0
    assert temp_files(tmp_path / "d") == []
    tier.submit_put(key_of(9), make_chunk(pool, 9, SIZE))  # ignored once closed
    assert tier.get(key_of(0), pool) is None


def test_queue_bound_drops_puts_instead_of_holding_memory(
    tmp_path: Path, pool: HostMemoryPool
) -> None:
    tier = new_tier(tmp_path / "d", max_pending_puts=2)
    gate = gate_all(tier, 2)
    try:
        for i in range(4):
            put(tier, pool, i)
        assert metric(tier, "disk_puts_total", result="queue_full") == 2
        assert pool.used_bytes == 2 * SIZE
        gate.set()
        tier.flush(5)
        assert len(tier) == 2
    finally:
        gate.set()
        tier.close()


def test_metrics_share_the_engine_registry_labels(tmp_path: Path, pool: HostMemoryPool) -> None:
    m = Metrics({"instance": "i", "rank": "0"})
    tier = new_tier(tmp_path / "d", metrics=m)
    try:
        put(tier, pool, 0)
        tier.flush(5)
        text = m.render().decode()
        for line in (
            'kvmesh_disk_puts_total{instance="i",rank="0",result="written"} 1.0',
            f'kvmesh_disk_usage_bytes{{instance="i",rank="0"}} {FILE:.1f}',
            'kvmesh_disk_chunks{instance="i",rank="0"} 1.0',
            'kvmesh_disk_degraded{instance="i",rank="0"} 0.0',
            'kvmesh_disk_corrupt_total{instance="i",rank="0"} 0.0',
        ):
            assert line in text, line
    finally:
        tier.close()


def _hold_in(thread_name: str, fn):
    """fn wrapped to stop, in the thread of that name only, before it runs, until
    `release` is set; `reached` says it got there."""
    reached, release = threading.Event(), threading.Event()

    def wrapped(*args, **kw):
        if threading.current_thread().name != thread_name:
            return fn(*args, **kw)
        reached.set()
        release.wait(10)
        return fn(*args, **kw)

    return wrapped, reached, release


def _hold_after(thread_name: str, fn):
    """fn wrapped to stop, in threads whose name starts with thread_name, once it
    returned, until `release` is set; `reached` says it got there."""
    reached, release = threading.Event(), threading.Event()

    def wrapped(*args, **kw):
        result = fn(*args, **kw)
        if threading.current_thread().name.startswith(thread_name):
            reached.set()
            release.wait(10)
        return result

    return wrapped, reached, release


@pytest.mark.parametrize("err", ["EMFILE", "ENFILE", "ENOMEM", "EAGAIN", "EINTR", "ENOBUFS"])
def test_transient_read_error_is_a_miss_that_keeps_the_chunk(
    tier: DiskTier, pool: HostMemoryPool, monkeypatch: pytest.MonkeyPatch, err: str
) -> None:
    put(tier, pool, 0)
    tier.flush(5)
    code = getattr(errno, err)

    def out_of_resources(path, bufs, direct):  # as open() fails with a full fd table
        raise OSError(code, os.strerror(code), path)

    real = disk_mod.read_file
    monkeypatch.setattr(disk_mod, "read_file", out_of_resources)
    assert read_ok(tier, pool, 0) is None
    assert asyncio.run(tier.aget(key_of(0), pool)) is None
    tier.flush(5)
    assert metric(tier, "disk_io_errors_total", op="read") == 2
    assert tier.misses.value("error") == 2
    monkeypatch.setattr(disk_mod, "read_file", real)
    # Kept: the file and its entry, served again once the condition passes.
    assert (Path(tier.path) / chunk_file_name(key_of(0))).exists()
    assert tier.contains(key_of(0)) and read_ok(tier, pool, 0)
    assert pool.used_bytes == 0


def test_read_error_of_the_file_drops_the_chunk(
    tier: DiskTier, pool: HostMemoryPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    put(tier, pool, 0)
    tier.flush(5)

    def bad_sector(path, bufs, direct):
        raise OSError(errno.EIO, os.strerror(errno.EIO), path)

    monkeypatch.setattr(disk_mod, "read_file", bad_sector)
    assert read_ok(tier, pool, 0) is None
    tier.flush(5)
    assert not tier.contains(key_of(0)) and chunk_files(tier.path) == []
    assert tier.used_bytes == 0 and pool.used_bytes == 0


def test_close_during_aget_is_a_miss_not_a_cancellation(
    tmp_path: Path, pool: HostMemoryPool
) -> None:
    tier = new_tier(tmp_path / "d", io_threads=1)
    put(tier, pool, 0)
    tier.flush(5)
    gate = gate_all(tier, 1)  # the read stays queued until close() drops it

    async def main() -> None:
        task = asyncio.ensure_future(tier.aget(key_of(0), pool))
        await asyncio.sleep(0.05)
        threading.Timer(0.2, gate.set).start()
        await asyncio.to_thread(tier.close)  # the engine shutting down
        assert await task is None
        assert not task.cancelled()

    try:
        asyncio.run(main())
    finally:
        gate.set()
        tier.close()
    assert tier.misses.value("error") == 1
    assert pool.used_bytes == 0


def test_check_pool_shutdown_during_aget_is_a_miss(tier: DiskTier, pool: HostMemoryPool) -> None:
    put(tier, pool, 0)
    tier.flush(5)
    gate = gate_checks(tier)

    async def main() -> None:
        task = asyncio.ensure_future(tier.aget(key_of(0), pool))
        deadline = time.monotonic() + 5
        while tier._checks._work_queue.qsize() == 0:  # read, its check queued
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        tier._checks.shutdown(wait=False, cancel_futures=True)
        assert await task is None
        assert not task.cancelled()

    try:
        asyncio.run(main())
    finally:
        gate.set()
    assert pool.used_bytes == 0  # the landed buffer went back


def zero_chunk(tier: DiskTier, pool: HostMemoryPool, i: int) -> None:
    """Chunk i as SIZE zero bytes: it compresses."""
    obj = make_chunk(pool, i, SIZE)
    obj.tensor.zero_()
    tier.submit_put(key_of(i), obj)
    obj.ref_down()


def read_zeros(tier: DiskTier, pool: HostMemoryPool, i: int) -> bool | None:
    obj = tier.get(key_of(i), pool)
    if obj is None:
        return None
    try:
        return obj.nbytes == SIZE and not obj.tensor.any()
    finally:
        obj.ref_down()


def rewrite_in_thread(
    tier: DiskTier, pool: HostMemoryPool, i: int
) -> tuple[threading.Thread, dict]:
    out: dict = {}
    codec = make_codec("zstd")
    t = threading.Thread(
        target=lambda: out.setdefault("r", tier.rewrite(key_of(i), codec, pool)), name="rewriter"
    )
    t.start()
    return t, out


@contextlib.contextmanager
def rename_held(
    tier: DiskTier, pool: HostMemoryPool, monkeypatch: pytest.MonkeyPatch
) -> Iterator[dict]:
    """Chunk 0 stored as zeros, then rewritten (zstd) on a thread held in its rename:
    the body runs during the rename; the rewrite's result is out["r"] afterwards."""
    zero_chunk(tier, pool, 0)
    tier.flush(5)
    slow_rename, renaming, go = _hold_in("rewriter", os.rename)
    monkeypatch.setattr(os, "rename", slow_rename)
    t, out = rewrite_in_thread(tier, pool, 0)
    try:
        assert renaming.wait(5)
        yield out
    finally:
        go.set()
        t.join(5)


def test_rewrite_and_put_of_one_key_never_share_a_temporary_file(
    tmp_path: Path, pool: HostMemoryPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = new_tier(tmp_path / "d", io_threads=1, retry_s=30)
    try:
        zero_chunk(tier, pool, 0)
        tier.flush(5)
        real = disk_mod.write_file
        # Both writers stop once their temporary file is written.
        after_rewrite, rewrote, go_rewrite = _hold_after("rewriter", real)
        after_both, put_wrote, go_put = _hold_after("kvmesh-disk-io", after_rewrite)
        monkeypatch.setattr(disk_mod, "write_file", after_both)
        t, out = rewrite_in_thread(tier, pool, 0)
        assert rewrote.wait(5)
        assert tier.remove(key_of(0), force=True)  # removed and stored again meanwhile
        tier.flush(5)
        zero_chunk(tier, pool, 0)
        assert put_wrote.wait(5)
        go_rewrite.set()
        t.join(5)
        go_put.set()
        tier.flush(5)
        assert out["r"] == "absent"
        assert tier.degraded is None
        assert read_zeros(tier, pool, 0)  # the put's file, whole
        assert temp_files(tier.path) == []
    finally:
        tier.close()


def test_rewrite_renames_outside_the_index_lock(
    tier: DiskTier, pool: HostMemoryPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    for i in range(2):
        zero_chunk(tier, pool, i)
        tier.flush(5)  # one at a time: two I/O threads could land them in either order
    order = list(tier._policy)
    slow_rename, renaming, go = _hold_in("rewriter", os.rename)
    monkeypatch.setattr(os, "rename", slow_rename)  # a rename stuck on a slow filesystem
    t, out = rewrite_in_thread(tier, pool, 0)
    try:
        assert renaming.wait(5)
        looked: dict = {}
        lookup = threading.Thread(target=lambda: looked.setdefault("hit", tier.contains(key_of(1))))
        lookup.start()
        lookup.join(2)
        assert looked.get("hit") is True  # another key's lookup did not wait for the rename
        assert tier.contains(key_of(0))  # still there for lookups
    finally:
        go.set()
        t.join(5)
    assert out["r"] == "rewritten"
    assert read_zeros(tier, pool, 0) and read_zeros(tier, pool, 1)
    assert len(tier) == 2 and list(tier._policy) == order  # its eviction place is kept
    files = Path(tier.path)
    assert tier.used_bytes == sum((files / n).stat().st_size for n in chunk_files(files))
    assert tier.used_bytes < 2 * FILE


def test_read_during_a_rewrites_rename_is_a_miss_not_a_delete(
    tier: DiskTier, pool: HostMemoryPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    with rename_held(tier, pool, monkeypatch) as out:
        # The new entry (compressed size) against the old, raw file: a miss.
        assert read_zeros(tier, pool, 0) is None
        assert metric(tier, "disk_gets_total", result="hit") == 0
    assert out["r"] == "rewritten"  # neither file was taken for a corrupt one
    assert read_zeros(tier, pool, 0) and len(tier) == 1


def test_a_read_opened_during_a_rename_and_checked_after_it_deletes_nothing(
    tier: DiskTier, pool: HostMemoryPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The I/O thread opens the old file while the rename is held; the check (on the
    # check pool, so usually later) runs once the rename has ended and the entry is no
    # longer `replacing`: the mismatch is the rename's, not the disk's.
    with rename_held(tier, pool, monkeypatch) as out:
        landed = tier._read_bytes(key_of(0), tier._index[key_of(0)], pool)
        assert landed is not None
    assert out["r"] == "rewritten"
    assert tier._check(landed) is None  # a miss...
    assert metric(tier, "disk_corrupt_total") == 0  # ...not corruption
    assert len(chunk_files(tier.path)) == 1 and read_zeros(tier, pool, 0)


def test_chunk_removed_during_a_rewrites_rename_stays_removed(
    tier: DiskTier, pool: HostMemoryPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    with rename_held(tier, pool, monkeypatch) as out:
        assert tier.remove(key_of(0))
    tier.flush(5)
    assert out["r"] == "absent"
    assert chunk_files(tier.path) == [] and temp_files(tier.path) == []
    assert len(tier) == 0 and tier.used_bytes == 0 and len(list(tier._policy)) == 0
    zero_chunk(tier, pool, 0)  # and the key can be stored again
    tier.flush(5)
    assert read_zeros(tier, pool, 0)


def test_failed_rewrite_rename_keeps_the_old_file(
    tier: DiskTier, pool: HostMemoryPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    zero_chunk(tier, pool, 0)
    tier.flush(5)
    real = os.rename

    def failing(src, dst):
        if threading.current_thread().name == "rewriter":
            raise OSError(errno.EIO, os.strerror(errno.EIO), src)
        return real(src, dst)

    monkeypatch.setattr(os, "rename", failing)
    t, out = rewrite_in_thread(tier, pool, 0)
    t.join(5)
    assert out["r"] == "failed"
    assert temp_files(tier.path) == []
    assert len(tier) == 1 and tier.used_bytes == FILE  # the old entry, raw
    assert read_zeros(tier, pool, 0)


def test_reindex_deletes_a_misplaced_file_by_its_name(
    tmp_path: Path, pool: HostMemoryPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    d = tmp_path / "d"
    first = new_tier(d)
    put(first, pool, 7)
    first.flush(5)
    first.close()
    misplaced = d / chunk_file_name(key_of(1))  # key 7's file under key 1's name
    shutil.copyfile(d / chunk_file_name(key_of(7)), misplaced)
    os.utime(misplaced, ns=(time.time_ns() + 10**9,) * 2)  # after key 7's, as copied later

    again = new_tier(d)
    try:
        assert not misplaced.exists()  # deleted although key 7 is indexed
        assert not again.contains(key_of(1)) and read_ok(again, pool, 7)
        assert again.used_bytes == FILE
    finally:
        again.close()


def test_reindex_never_deletes_a_put_that_landed_during_the_scan(
    tmp_path: Path, pool: HostMemoryPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    d = tmp_path / "d"
    first = new_tier(d)
    put(first, pool, 7)
    first.flush(5)
    first.close()
    os.rename(d / chunk_file_name(key_of(7)), d / chunk_file_name(key_of(1)))  # misplaced
    holder: dict = {}
    started = threading.Event()
    real = disk_mod.check_files

    def check_then_put(path, part, **kw):
        out = list(real(path, part, **kw))  # the scan saw the misplaced file
        started.wait(5)
        put(holder["tier"], pool, 1)  # meanwhile the engine stores key 1
        holder["tier"].flush(5)
        return out

    monkeypatch.setattr(disk_mod, "check_files", check_then_put)
    holder["tier"] = tier = DiskTier(d, 64 * MiB, io_threads=2)
    started.set()
    try:
        assert tier.wait_indexed(10)
        assert (d / chunk_file_name(key_of(1))).exists()
        assert tier.contains(key_of(1)) and read_ok(tier, pool, 1)
    finally:
        tier.close()

"""Disk tier audit (H15): a re-index racing puts and removes of the keys it scans, a
read racing a removal, and chunks stored during a restart against the files it finds."""

from __future__ import annotations

import errno
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from kvtest.disk import MiB, chunk_files, expected_bytes, key_of, make_chunk

from kvmesh.common.chunk_codec import FILE_LAYOUT
from kvmesh.common.memory import HostMemoryPool
from kvmesh.services.worker.tiers import disk as disk_mod
from kvmesh.services.worker.tiers.disk import DiskTier

KiB = 1024
SIZE = 64 * KiB
FILE = FILE_LAYOUT.size + SIZE


@pytest.fixture
def pool() -> Iterator[HostMemoryPool]:
    p = HostMemoryPool(8 * MiB, SIZE, pin_memory=False)
    yield p
    p.close()


def put(tier: DiskTier, pool: HostMemoryPool, i: int) -> None:
    obj = make_chunk(pool, i, SIZE)
    tier.submit_put(key_of(i), obj)
    obj.ref_down()


def bytes_on_disk(path: Path) -> int:
    return sum(os.path.getsize(path / n) for n in chunk_files(path))


def read_ok(tier: DiskTier, pool: HostMemoryPool, i: int) -> bool | None:
    obj = tier.get(key_of(i), pool)
    if obj is None:
        return None
    try:
        return bool((obj.tensor == expected_bytes(i, SIZE)).all())
    finally:
        obj.ref_down()


def filled_dir(path: Path, pool: HostMemoryPool, n: int) -> None:
    tier = DiskTier(path, 64 * MiB, io_threads=2)
    assert tier.wait_indexed(10)
    for i in range(n):
        put(tier, pool, i)
    assert tier.flush(10)
    tier.close()


class _HeldScan:
    """Holds the re-index between checking a batch of files and indexing it."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.checked = threading.Event()
        self.release = threading.Event()
        real = disk_mod.check_files

        def held(*args, **kwargs):
            files = list(real(*args, **kwargs))
            self.checked.set()
            assert self.release.wait(10)
            yield from files

        monkeypatch.setattr(disk_mod, "check_files", held)


def test_reindex_never_indexes_a_file_removed_since_it_was_scanned(
    tmp_path: Path, pool: HostMemoryPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A key the scan found on disk is written anew and then removed before its batch
    is indexed: the file is gone, so the re-index must not bring the key back (a hit
    with no file, its bytes counted in used_bytes)."""
    d = tmp_path / "d"
    filled_dir(d, pool, 4)
    scan = _HeldScan(monkeypatch)
    tier = DiskTier(d, 64 * MiB, io_threads=2)
    try:
        assert scan.checked.wait(10)
        put(tier, pool, 1)
        assert tier.flush(10) and tier.contains(key_of(1))
        assert tier.remove(key_of(1))
        assert tier.flush(10)
        scan.release.set()
        assert tier.wait_indexed(10) and tier.flush(10)
        assert not tier.contains(key_of(1))
        assert len(tier) == 3 and len(chunk_files(d)) == 3
        assert tier.used_bytes == bytes_on_disk(d) == 3 * FILE
    finally:
        scan.release.set()
        tier.close()


@pytest.mark.parametrize("removed", [False, True], ids=["kept", "removed"])
def test_reindex_keeps_the_old_file_when_a_write_of_its_key_fails(
    tmp_path: Path, pool: HostMemoryPool, monkeypatch: pytest.MonkeyPatch, removed: bool
) -> None:
    """The scan finds key 1's file while a new write of key 1 is in flight, so it
    leaves the key to the write; the write then fails (ENOSPC) and the old file is
    still there: it must be indexed after all (or, if the chunk was removed meanwhile,
    deleted), never left on disk uncounted."""
    d = tmp_path / "d"
    filled_dir(d, pool, 4)
    scan = _HeldScan(monkeypatch)
    writing, fail = threading.Event(), threading.Event()
    real_write = disk_mod.write_file

    def failing_write(*args, **kwargs):
        writing.set()
        assert fail.wait(10)
        raise OSError(errno.ENOSPC, "No space left on device")

    tier = DiskTier(d, 64 * MiB, io_threads=2)
    try:
        assert scan.checked.wait(10)
        monkeypatch.setattr(disk_mod, "write_file", failing_write)
        put(tier, pool, 1)
        assert writing.wait(10)
        if removed:
            assert tier.remove(key_of(1))
        scan.release.set()
        assert tier.wait_indexed(10)
        fail.set()
        assert tier.flush(10)
        monkeypatch.setattr(disk_mod, "write_file", real_write)
        assert tier.flush(10)
        files = 3 if removed else 4
        assert len(tier) == files and len(chunk_files(d)) == files
        assert tier.used_bytes == bytes_on_disk(d) == files * FILE
        assert read_ok(tier, pool, 1) is (None if removed else True)
    finally:
        scan.release.set()
        fail.set()
        tier.close()


def test_read_racing_a_removal_is_a_plain_miss_not_an_io_error(
    tmp_path: Path,
    pool: HostMemoryPool,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A read queued before a remove() opens the file after the delete: a miss, counted
    as one (not as a disk I/O error, which operators read as a failing disk), with no
    'chunk dropped' warning. Then the key can be written and read again."""
    tier = DiskTier(tmp_path / "d", 64 * MiB, io_threads=2)
    try:
        assert tier.wait_indexed(10)
        put(tier, pool, 0)
        assert tier.flush(10)
        reading, go = threading.Event(), threading.Event()
        real_read = disk_mod.read_file

        def held_read(*args, **kwargs):
            reading.set()
            assert go.wait(10)
            return real_read(*args, **kwargs)

        monkeypatch.setattr(disk_mod, "read_file", held_read)
        result: list[object] = []
        reader = threading.Thread(target=lambda: result.append(read_ok(tier, pool, 0)))
        reader.start()
        assert reading.wait(10)
        [name] = chunk_files(tmp_path / "d")
        assert tier.remove(key_of(0))
        deadline = time.monotonic() + 10
        while os.path.exists(tmp_path / "d" / name):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        go.set()
        reader.join(10)
        monkeypatch.setattr(disk_mod, "read_file", real_read)
        assert result == [None]
        value = tier.stats.metrics.value
        assert (value("disk_io_errors_total", {"op": "read"}) or 0) == 0
        assert (value("disk_gets_total", {"result": "error"}) or 0) == 0
        assert (value("disk_gets_total", {"result": "miss"}) or 0) == 1
        assert tier.misses.value("error") == 0
        assert "chunk dropped" not in capsys.readouterr().out
        assert pool.used_bytes == 0
        put(tier, pool, 0)
        assert tier.flush(10) and read_ok(tier, pool, 0) is True
    finally:
        tier.close()


def test_chunks_stored_during_the_reindex_outlast_the_files_it_finds(
    tmp_path: Path, pool: HostMemoryPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A restart on a full directory: what this run stores while the re-index runs is
    newer than every file an earlier run left, so the files found go first when the
    two together are over max_size (the new chunks were the ones evicted, all of them,
    when found files were counted as just stored)."""
    d = tmp_path / "d"
    filled_dir(d, pool, 6)
    scan = _HeldScan(monkeypatch)
    tier = DiskTier(d, 6 * FILE, io_threads=2)
    try:
        assert scan.checked.wait(10)
        for i in (10, 11, 12):
            put(tier, pool, i)
        assert tier.flush(10)
        scan.release.set()
        assert tier.wait_indexed(10) and tier.flush(10)
        assert [i for i in (10, 11, 12) if tier.contains(key_of(i))] == [10, 11, 12]
        assert sum(tier.contains(key_of(i)) for i in range(6)) == 3
        assert len(tier) == 6 and tier.used_bytes == bytes_on_disk(d) == 6 * FILE
        assert all(read_ok(tier, pool, i) for i in (10, 11, 12))
    finally:
        scan.release.set()
        tier.close()


def test_chunk_files_are_readable_by_the_engines_user_only(tmp_path: Path, pool) -> None:
    """Chunk files hold every tenant's KV: another local user must not read them,
    whatever the umask (022 here, as on most hosts). A directory made by the tier is
    the user's alone; one that existed keeps its mode."""
    old = os.umask(0o022)
    try:
        made, existing = tmp_path / "made" / "tier", tmp_path / "existing"
        existing.mkdir(mode=0o750)
        for path in (made, existing):
            filled_dir(path, pool, 2)
    finally:
        os.umask(old)
    for path in (made, existing):
        files = [path / n for n in os.listdir(path)]
        assert len(chunk_files(path)) == 2
        assert all(f.stat().st_mode & 0o777 == 0o600 for f in files), files
    assert made.stat().st_mode & 0o777 == 0o700
    assert existing.stat().st_mode & 0o777 == 0o750


def test_chunk_files_written_before_are_made_private_at_the_reindex(tmp_path: Path, pool) -> None:
    """Files of an older kvmesh (0644) are closed when the tier starts on them."""
    filled_dir(tmp_path, pool, 2)
    for name, mode in zip(sorted(chunk_files(tmp_path)), (0o644, 0o244), strict=True):
        os.chmod(tmp_path / name, mode)  # 0o244: not even readable by its owner
    tier = DiskTier(tmp_path, 64 * MiB, io_threads=2)
    try:
        assert tier.wait_indexed(10)
        modes = [os.stat(tmp_path / n).st_mode & 0o777 for n in chunk_files(tmp_path)]
        assert modes == [0o600, 0o600]
        assert read_ok(tier, pool, 0) and read_ok(tier, pool, 1)
    finally:
        tier.close()

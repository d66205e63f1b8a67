"""The disk tier's building blocks: chunk file names, aligned I/O, the priority
executor, and the directory scan shared by the re-index and `kvmesh disk scan`. (The
chunk file header is common/chunk_codec.py's FILE_LAYOUT: test_chunk_codec.py.)"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch
from kvtest.disk import key_of

from kvmesh.common.chunk_codec import FILE_LAYOUT, ChunkHeader, chunk_bytes, payload_checksum
from kvmesh.common.memory import HostMemoryPool, MemoryFormat
from kvmesh.services.worker.tiers import disk_io
from kvmesh.services.worker.tiers.disk_executor import Priority, PriorityExecutor
from kvmesh.services.worker.tiers.disk_format import (
    chunk_file_name,
    is_temp_file_name,
    key_of_file_name,
    temp_file_name,
)
from kvmesh.services.worker.tiers.disk_scan import (
    check_file,
    check_files,
    list_dir,
    plan_eviction,
    read_ahead,
)

HEADER_SIZE = FILE_LAYOUT.size


# --- file names ---------------------------------------------------------------------------


def test_file_names_come_from_the_key_only() -> None:
    key = key_of(3)
    name = chunk_file_name(key)
    assert name == key.to_str() + ".kv"
    assert key_of_file_name(name) == key
    assert set(name) <= set("0123456789abcdef-.kv")
    for other in ("x.kv", key.to_str(), key.to_str().upper() + ".kv", ".lock"):
        assert key_of_file_name(other) is None
    tmp = temp_file_name(key, "run1")
    assert is_temp_file_name(tmp) and key_of_file_name(tmp) is None
    assert not is_temp_file_name(name)


def test_every_write_gets_its_own_temporary_name(tmp_path: Path) -> None:
    key = key_of(3)
    names = [temp_file_name(key, "run1") for _ in range(3)]
    assert len(set(names)) == 3  # a put and a rewrite of one key never share a file
    for tmp in names:
        assert tmp.startswith(".") and tmp.endswith(".run1.tmp")
        (tmp_path / tmp).write_bytes(b"in flight")
    dead = temp_file_name(key, "oldrun")
    (tmp_path / dead).write_bytes(b"half")
    # The running tier's own are left alone; another run's are deleted.
    assert list_dir(str(tmp_path), own_run_id="run1").temps == [dead]


# --- aligned I/O ----------------------------------------------------------------------------


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("nbytes", [64 * 1024, 64 * 1024 - 10])
def test_write_then_read_file(tmp_path: Path, direct: bool, nbytes: int) -> None:
    with HostMemoryPool(1 << 20, 128 * 1024, pin_memory=False) as pool:
        src = pool.allocate((nbytes,), torch.uint8, MemoryFormat.BINARY)
        dst = pool.allocate((nbytes,), torch.uint8, MemoryFormat.BINARY)
        assert src is not None and dst is not None
        src.tensor.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8))
        hdr = disk_io.header_buffer()
        hdr[:] = b"h" * HEADER_SIZE
        path = str(tmp_path / "f")
        used = disk_io.write_file(path, [hdr, chunk_bytes(src)], direct)
        # O_DIRECT only when asked and everything is aligned (tmpfs/ext4 support it).
        assert used == (direct and nbytes % 4096 == 0)
        assert os.path.getsize(path) == HEADER_SIZE + nbytes
        hdr[:] = b"\0" * HEADER_SIZE
        n = disk_io.read_file(path, [hdr, chunk_bytes(dst)], direct)
        assert n == HEADER_SIZE + nbytes
        assert bytes(hdr) == b"h" * HEADER_SIZE
        assert torch.equal(src.tensor, dst.tensor)


def test_header_buffer_is_aligned_and_per_thread() -> None:
    import ctypes

    mine = disk_io.header_buffer()
    assert ctypes.addressof(ctypes.c_char.from_buffer(mine)) % disk_io.BLOCK == 0
    other: list[memoryview] = []
    t = threading.Thread(target=lambda: other.append(disk_io.header_buffer()))
    t.start()
    t.join()
    assert other[0] is not mine


# --- priority executor ----------------------------------------------------------------------


def test_executor_runs_by_priority_then_fifo() -> None:
    ex = PriorityExecutor(1)
    gate = threading.Event()
    order: list[str] = []
    try:
        ex.submit(Priority.PUT, gate.wait, 5)  # occupies the only thread
        time.sleep(0.05)
        for name, prio in [
            ("put1", Priority.PUT),
            ("del1", Priority.DELETE),
            ("put2", Priority.PUT),
            ("get1", Priority.PREFETCH),
            ("del2", Priority.DELETE),
            ("get2", Priority.PREFETCH),
        ]:
            ex.submit(prio, order.append, name)
        assert ex.queued() == 6 and ex.queued(Priority.PUT) == 2
        gate.set()
        assert ex.wait_idle(5)
        assert order == ["get1", "get2", "del1", "del2", "put1", "put2"]
    finally:
        ex.shutdown()


def test_executor_results_errors_and_shutdown_cancels() -> None:
    ex = PriorityExecutor(2)
    assert ex.submit(Priority.PUT, lambda: 42).result(5) == 42
    with pytest.raises(ZeroDivisionError):
        ex.submit(Priority.PUT, lambda: 1 / 0).result(5)
    gate = threading.Event()
    ex.submit(Priority.PUT, gate.wait, 5)
    ex.submit(Priority.PUT, gate.wait, 5)
    time.sleep(0.05)
    queued_put = ex.submit(Priority.PUT, lambda: "put")
    queued_delete = ex.submit(Priority.DELETE, lambda: "delete")
    cancelled: list[bool] = []
    queued_put.add_done_callback(lambda f: cancelled.append(f.cancelled()))
    threading.Timer(0.1, gate.set).start()
    ex.shutdown(cancel=(Priority.PUT,))
    assert cancelled == [True]
    assert queued_delete.result(0) == "delete"  # deletes still run on shutdown
    with pytest.raises(RuntimeError):
        ex.submit(Priority.PUT, lambda: None)


# --- directory scan -------------------------------------------------------------------------


def write_chunk(path: Path, i: int, payload: bytes, mtime: int) -> str:
    key = key_of(i)
    h = ChunkHeader(
        key,
        (len(payload),),
        torch.uint8,
        MemoryFormat.BINARY,
        len(payload),
        payload_checksum(payload),
        written_ns=1_700_000_000_000_000_000,
    )
    name = chunk_file_name(key)
    (path / name).write_bytes(FILE_LAYOUT.pack(h) + payload)
    os.utime(path / name, ns=(mtime, mtime))
    return name


def test_scan_sorts_oldest_first_and_finds_every_problem(tmp_path: Path) -> None:
    names = [write_chunk(tmp_path, i, bytes([i]) * 100, 10**18 + (5 - i) * 10**9) for i in range(5)]
    (tmp_path / ".lock").write_text("1\n")
    (tmp_path / "notes.txt").write_text("a person's file")
    dead = temp_file_name(key_of(9), "oldrun")
    (tmp_path / dead).write_bytes(b"half")
    (tmp_path / temp_file_name(key_of(10), "mine")).write_bytes(b"in flight")
    # names[1]: truncated; names[2]: payload flipped; names[3]: under another key's name
    with open(tmp_path / names[1], "r+b") as f:
        f.truncate(HEADER_SIZE + 50)
    raw = bytearray((tmp_path / names[2]).read_bytes())
    raw[HEADER_SIZE + 7] ^= 0xFF
    (tmp_path / names[2]).write_bytes(bytes(raw))
    os.utime(tmp_path / names[2], ns=(10**18 + 3 * 10**9,) * 2)
    os.rename(tmp_path / names[3], tmp_path / chunk_file_name(key_of(33)))

    listing = list_dir(str(tmp_path), own_run_id="mine")
    assert listing.temps == [dead]
    assert listing.ignored == ["notes.txt"]
    assert listing.chunks[0][0] == names[4]  # oldest first
    checked = {c[0]: check_file(str(tmp_path), *c) for c in listing.chunks}
    assert checked[names[0]].ok and checked[names[4]].ok
    assert "size" in (checked[names[1]].problem or "")
    assert checked[names[2]].ok  # a start reads headers only; the read verifies payloads
    flipped = next(c for c in listing.chunks if c[0] == names[2])
    assert check_file(str(tmp_path), *flipped, verify_payload=True).problem == (
        "payload checksum mismatch"
    )
    assert "another key" in (checked[chunk_file_name(key_of(33))].problem or "")


def _cached(path: Path) -> bool:
    """Whether path's first page is in the page cache: mincore(2) on a mapping that is
    never touched (a read, even a RWF_NOWAIT one, starts the readahead itself)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    ]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, HEADER_SIZE, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), "mmap failed")
        try:
            vec = (ctypes.c_ubyte * 1)()
            if libc.mincore(addr, HEADER_SIZE, vec) != 0:
                raise OSError(ctypes.get_errno(), "mincore failed")
            return bool(vec[0] & 1)
        finally:
            libc.munmap(addr, HEADER_SIZE)
    finally:
        os.close(fd)


def test_read_ahead_brings_headers_into_the_page_cache_and_the_scan_is_unchanged() -> None:
    # /var/tmp: a disk-backed filesystem, where dropping a file's pages is possible.
    import shutil
    import tempfile

    d = Path(tempfile.mkdtemp(dir="/var/tmp", prefix="kvmesh-readahead-"))
    try:
        names = [write_chunk(d, i, bytes([i]) * 20_000, 10**18 + i * 10**9) for i in range(50)]
        for name in names:
            fd = os.open(d / name, os.O_RDONLY)
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
        assert not any(_cached(d / n) for n in names), "the pages were not dropped"
        listing = list_dir(str(d))
        read_ahead(str(d), listing.chunks)
        deadline = time.monotonic() + 5
        while not all(_cached(d / n) for n in names) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert all(_cached(d / n) for n in names)
        (d / names[7]).unlink()  # a file gone between the listing and the check
        scanned = list(check_files(str(d), listing.chunks))
        assert [f.name for f in scanned] == [c[0] for c in listing.chunks]
        assert [f.name for f in scanned if not f.ok] == [names[7]]
        assert scanned[7].problem == "vanished during the scan"
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_plan_eviction_drops_oldest_or_newest_for_mru(tmp_path: Path) -> None:
    for i in range(4):
        write_chunk(tmp_path, i, b"x" * 100, 10**18 + i * 10**9)
    listing = list_dir(str(tmp_path))
    files = [check_file(str(tmp_path), *c) for c in listing.chunks]
    size = files[0].size
    stay, gone = plan_eviction(files, 2 * size, "lru")
    assert [f.header.key for f in gone] == [key_of(0), key_of(1)]
    assert len(stay) == 2
    _, gone = plan_eviction(files, 3 * size, "mru")
    assert [f.header.key for f in gone] == [key_of(3)]
    assert plan_eviction(files, 10 * size)[1] == []

"""The cache-server's spill under races and write failures: a read that the key's own
put or eviction overtakes, a write that fails on a full disk, an unlink that fails.
Interleavings are forced by pausing the pool thread inside `_read_parsed`."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import xxhash
from structlog.testing import capture_logs

from kvmesh.services.cacheserver import spill as spill_mod
from kvmesh.services.cacheserver.spill import DiskSpill
from kvmesh.services.cacheserver.store import ENTRY_OVERHEAD, MemoryStore, make_entry

KiB = 1024
N = 4000  # bytes per value
V1, V2 = b"1" * N, b"2" * N


async def until(cond: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 5
    while not cond():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.01)


async def written(spill: DiskSpill, key: str) -> None:
    await until(lambda: key not in spill._pending, f"the spill write of {key} never landed")


def one_value_store(spill: DiskSpill) -> MemoryStore:
    """Memory for one value, so each put evicts the previous one to the spill."""
    return MemoryStore(N + 1 + ENTRY_OVERHEAD, 64 * KiB, spill)


class PausedRead:
    """Holds the spill's next file reads on the pool thread until `go` is set; `started`
    is set once one is held. `after` pauses once the bytes are read, else before."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, *, after: bool) -> None:
        self.started = threading.Event()
        self.go = threading.Event()
        read_parsed = spill_mod._read_parsed

        def paused(path: Path, key: bytes):
            if not after:
                self.started.set()
                self.go.wait(5)
            out = read_parsed(path, key)
            if after:
                self.started.set()
                self.go.wait(5)
            return out

        monkeypatch.setattr(spill_mod, "_read_parsed", paused)


@pytest.mark.parametrize("v2_written", [False, True], ids=["v2-being-written", "v2-written"])
def test_a_read_overtaken_by_a_newer_put_never_promotes_the_old_value(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, v2_written: bool
) -> None:
    """A GET reads K's file (V1); meanwhile K is put again (V2) and V2 is evicted to the
    spill. The old bytes must not come back, nor be promoted over V2."""
    read = PausedRead(monkeypatch, after=True)

    async def main() -> None:
        spill = DiskSpill(tmp_path, 1 << 20, io_threads=2)
        store = one_value_store(spill)
        try:
            store.put("K", make_entry(V1))
            store.put("F", make_entry(b"f" * N))  # K (V1) goes to the spill
            await written(spill, "K")
            reader = asyncio.create_task(store.get("K"))
            assert await asyncio.to_thread(read.started.wait, 5)  # V1 read, not returned
            store.put("K", make_entry(V2))
            store.put("F", make_entry(b"f" * N))  # K (V2) goes to the spill
            if v2_written:
                await written(spill, "K")  # on the pool's other thread
            read.go.set()
            got = await reader
            assert got is not None and bytes(got.view) == V2
            now = await store.get("K")
            assert now is not None and bytes(now.view) == V2
            assert spill.corrupt == 0
        finally:
            read.go.set()
            spill.close()

    asyncio.run(main())


@pytest.mark.parametrize("how", ["evicted", "replaced"])
def test_a_read_racing_its_files_removal_is_not_counted_corrupt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """K's file is deleted while a GET is about to open it: by the spill's own eviction
    (a miss, reason "evicted") or because K was put and spilled again (V2 is read
    instead). Neither is a corrupt file."""
    read = PausedRead(monkeypatch, after=False)

    async def main() -> MemoryStore:
        file_size = spill_mod.HEADER_SIZE + 1 + N
        spill = DiskSpill(tmp_path, 2 * file_size, io_threads=2)  # room for two files
        store = one_value_store(spill)
        try:
            store.put("K", make_entry(V1))
            store.put("A", make_entry(b"a" * N))  # K goes to the spill
            await written(spill, "K")
            old_file = tmp_path / spill._index["K"].name
            reader = asyncio.create_task(store.get("K"))
            assert await asyncio.to_thread(read.started.wait, 5)
            if how == "evicted":
                store.put("B", make_entry(b"b" * N))  # A to the spill: K, A
                await written(spill, "A")
                store.put("C", make_entry(b"c" * N))  # B to the spill: K's file evicted
            else:
                store.put("K", make_entry(V2))
                store.put("A", make_entry(b"a" * N))  # K (V2) to the spill again
            await until(lambda: not old_file.exists(), "K's old file was never deleted")
            read.go.set()
            got = await reader
            if how == "evicted":
                assert got is None
            else:
                assert got is not None and bytes(got.view) == V2
            assert spill.corrupt == 0
            return store
        finally:
            read.go.set()
            spill.close()

    store = asyncio.run(main())
    assert store.miss_reasons["checksum"] == 0
    assert store.miss_reasons["evicted"] == (1 if how == "evicted" else 0)


def fail_first_write(spill_dir: Path, key: str) -> None:
    """The spill's first write (seq 1) of key goes to /dev/full: ENOSPC, as on a full disk."""
    name = f"{xxhash.xxh3_128_hexdigest(key.encode())}-1{spill_mod.SUFFIX}.tmp"
    (spill_dir / name).symlink_to("/dev/full")


needs_dev_full = pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full")


@needs_dev_full
def test_a_failed_spill_write_leaves_no_tmp_file(tmp_path: Path) -> None:
    async def main() -> None:
        spill = DiskSpill(tmp_path, 1 << 20)
        fail_first_write(tmp_path, "k")
        assert spill.submit("k", make_entry(V1))
        await written(spill, "k")
        assert "k" not in spill and spill.dropped == 1 and spill.used_bytes == 0
        spill.close()

    asyncio.run(main())
    assert list(tmp_path.iterdir()) == []


@needs_dev_full
def test_a_full_disk_pauses_spilling_for_retry_s(tmp_path: Path) -> None:
    async def main() -> None:
        spill = DiskSpill(tmp_path, 1 << 20, retry_s=0.3)
        fail_first_write(tmp_path, "k0")
        assert spill.submit("k0", make_entry(V1))
        await written(spill, "k0")
        assert not spill.submit("k1", make_entry(V2))  # paused: dropped, no write tried
        assert spill.dropped == 2 and "k1" not in spill
        await asyncio.sleep(0.3)
        assert spill.submit("k1", make_entry(V2))  # retried once the pause is over
        await written(spill, "k1")
        got = await spill.read("k1")
        assert got is not None and bytes(got.view) == V2
        spill.close()

    asyncio.run(main())


def test_an_unlink_that_fails_is_logged(tmp_path: Path) -> None:
    """Files are deleted on the pool with no one awaiting: an error other than "already
    gone" must reach the log, not vanish in a future."""

    async def main() -> None:
        spill = DiskSpill(tmp_path, 1 << 20)
        assert spill.submit("k", make_entry(V1))
        await written(spill, "k")
        path = tmp_path / spill._index["k"].name
        path.unlink()
        path.mkdir()  # unlink() now fails with EISDIR
        spill.discard("k")
        spill.close()  # waits for the unlink

    with capture_logs() as logs:
        asyncio.run(main())
    assert [e["event"] for e in logs if e["log_level"] == "warning"] == ["spill file not deleted"]


async def test_a_write_that_ends_after_close_still_cleans_up(tmp_path) -> None:
    # A write still queued when the spill closes finishes on the pool's way down; its
    # callback, on the loop afterwards, must not fail scheduling the cleanup.
    spill = DiskSpill(tmp_path, 1 << 20)
    loop_errors: list[dict] = []
    asyncio.get_running_loop().set_exception_handler(lambda _loop, ctx: loop_errors.append(ctx))
    assert spill.submit("k", make_entry(b"v" * 1000))
    spill.discard("k")  # no longer current: its file is deleted once written
    spill.close()
    await asyncio.sleep(0.05)
    assert loop_errors == []
    assert [p.name for p in tmp_path.iterdir()] == []


def test_spilled_values_are_readable_by_the_servers_user_only(tmp_path: Path) -> None:
    """Spilled values are clients' KV: another local user must not read them, whatever
    the umask (022 here, as on most hosts)."""
    old = os.umask(0o022)
    try:

        async def main() -> None:
            spill = DiskSpill(tmp_path / "spill", 1 << 20)
            assert spill.submit("k", make_entry(V1))
            await written(spill, "k")
            spill.close()

        asyncio.run(main())
    finally:
        os.umask(old)
    files = list((tmp_path / "spill").iterdir())
    assert files and all(f.stat().st_mode & 0o777 == 0o600 for f in files)
    assert (tmp_path / "spill").stat().st_mode & 0o777 == 0o700

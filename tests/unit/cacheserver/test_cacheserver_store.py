"""The cache-server's store without sockets: LRU bound, checksums, spill to disk and back,
paged listing under mutation, and the handlers' answers to bad requests."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest
from kvtest.cacheserver_handlers import handlers

from kvmesh.common.protocol import cacheserver as proto
from kvmesh.common.protocol.cacheserver import ErrorCode
from kvmesh.services.cacheserver.handlers import RequestError
from kvmesh.services.cacheserver.spill import HEADER_SIZE, DiskSpill
from kvmesh.services.cacheserver.store import (
    ENTRY_OVERHEAD,
    INTERNAL_PREFIX,
    KeyIndex,
    MemoryStore,
    StoreError,
    make_entry,
)

KiB = 1024


def entry(n: int, seed: int = 0, meta: bytes = b""):
    return make_entry(os.urandom(n) if seed < 0 else bytes([seed % 256]) * n, meta)


def cost(key: str, n: int, meta: bytes = b"") -> int:
    return n + len(meta) + len(key) + ENTRY_OVERHEAD


def test_lru_evicts_least_recently_used_within_the_bound() -> None:
    store = MemoryStore(max_memory=3 * cost("k0", 10 * KiB), max_value_size=64 * KiB)
    for i in range(3):
        store.put(f"k{i}", entry(10 * KiB, i))
    assert store.get_memory("k0") is not None  # k0 is now the most recent
    store.put("k3", entry(10 * KiB, 3))
    assert not store.contains("k1")
    assert all(store.contains(k) for k in ("k0", "k2", "k3"))
    assert store.used_bytes <= store.max_memory
    assert store.evictions == 1


def test_replacing_a_key_keeps_the_accounting_exact() -> None:
    store = MemoryStore(max_memory=1 << 20, max_value_size=1 << 20)
    store.put("k", entry(1000))
    store.put("k", entry(2000, meta=b"xy"))
    assert store.used_bytes == cost("k", 2000, b"xy")
    assert store.delete("k") and store.used_bytes == 0
    assert not store.delete("k")


def test_value_limits_and_checksums() -> None:
    store = MemoryStore(max_memory=1 << 20, max_value_size=1000)
    with pytest.raises(StoreError) as exc:
        store.put("big", entry(1001))
    assert exc.value.code is ErrorCode.VALUE_TOO_LARGE
    e = make_entry(b"hello")
    assert make_entry(b"hello", checksum=e.checksum).checksum == e.checksum
    with pytest.raises(StoreError) as exc:
        make_entry(b"hello", checksum=e.checksum ^ 1)
    assert exc.value.code is ErrorCode.CHECKSUM_MISMATCH


def test_key_index_pages_cover_every_key_once_despite_mutation() -> None:
    index = KeyIndex()
    keys = {f"p:{i:05d}" for i in range(2000)} | {"other", INTERNAL_PREFIX + "lm:hidden"}
    for k in keys:
        index.add(k)
    seen: list[str] = []
    cursor = ""
    pages = 0
    while True:
        page, cursor = index.page("p:", cursor, 97)
        seen.extend(page)
        pages += 1
        if pages == 3:  # mutate mid-listing: new keys may or may not show up
            index.add("p:new")
            index.discard("p:00000")  # may or may not show up
        if not cursor:
            break
    stable = {k for k in keys if k.startswith("p:")} - {"p:00000"}
    assert stable <= set(seen)
    assert len(seen) == len(set(seen)), "a key was listed twice"
    assert "other" not in seen and not any(k.startswith(INTERNAL_PREFIX) for k in seen)
    with pytest.raises(ValueError):
        index.page("", "nonsense", 10)


def test_a_key_index_page_stops_after_a_bounded_scan(monkeypatch) -> None:
    """A prefix that matches little gets short (even empty) pages with a cursor, not
    one page that walked the whole index on the loop; the pages still list every
    match once."""
    monkeypatch.setattr(KeyIndex, "SCAN_PER_PAGE", 100)
    index = KeyIndex()
    keys = [f"a:{i:05d}" for i in range(5000)] + [f"b:{i:02d}" for i in range(30)]
    for k in keys:
        index.add(k)
    page, cursor = index.page("nomatch", "", 1000)
    assert page == [] and cursor  # it scanned all 5030 keys and said done
    seen: list[str] = []
    cursor, pages = "", 0
    while True:
        page, cursor = index.page("b:", cursor, 1000)
        seen.extend(page)
        pages += 1
        if not cursor:
            break
    assert sorted(seen) == sorted(k for k in keys if k.startswith("b:"))
    assert pages > 10


def run(coro):
    return asyncio.run(coro)


async def spills_landed(spill: DiskSpill) -> None:
    """Until every spill write has its file renamed into place and is indexed: writes
    run on the spill's threads after the eviction that started them."""
    deadline = time.monotonic() + 5
    while spill._pending:
        assert time.monotonic() < deadline, f"spill writes of {list(spill._pending)} never landed"
        await asyncio.sleep(0.01)


def test_spill_takes_evictions_and_gives_them_back_verified(tmp_path: Path) -> None:
    async def main() -> None:
        spill = DiskSpill(tmp_path / "spill", max_size=1 << 20)
        store = MemoryStore(cost("k0", 100 * KiB, b"k0") * 2, 512 * KiB, spill)
        values = {f"k{i}": os.urandom(100 * KiB) for i in range(5)}
        for k, v in values.items():
            store.put(k, make_entry(v, meta=k.encode()))
        assert len(store) == 2 and len(spill) == 3
        await spills_landed(spill)
        assert len(list((tmp_path / "spill").glob("*.val"))) == 3
        for k, v in values.items():  # every value comes back, spilled or not
            e = await store.get(k)
            assert e is not None and bytes(e.view) == v and e.meta == k.encode()
        assert store.keys_total == 5
        spill.close()

    run(main())


def flip_a_value_bit(spill_dir: Path) -> None:
    (path,) = spill_dir.glob("*.val")
    data = bytearray(path.read_bytes())
    data[HEADER_SIZE + 5 + 100] ^= 0xFF  # a bit inside the value
    path.write_bytes(bytes(data))


def test_spill_drops_a_corrupted_file_as_a_miss(tmp_path: Path) -> None:
    async def main() -> None:
        spill = DiskSpill(tmp_path, max_size=1 << 20)
        store = MemoryStore(cost("a", 10 * KiB), 64 * KiB, spill)
        store.put("a", entry(10 * KiB, 1))
        store.put("b", entry(10 * KiB, 2))  # evicts a to the spill
        await spills_landed(spill)  # else a is still read from memory
        flip_a_value_bit(tmp_path)
        assert await store.get("a") is None
        assert spill.corrupt == 1 and not store.contains("a")
        spill.close()

    run(main())


def test_spill_is_bounded_and_starts_empty(tmp_path: Path) -> None:
    (tmp_path / "old-1.val").write_bytes(b"left over")

    async def main() -> None:
        spill = DiskSpill(tmp_path, max_size=3 * (10 * KiB + 100))
        assert not (tmp_path / "old-1.val").exists()
        store = MemoryStore(cost("k00", 10 * KiB), 64 * KiB, spill)
        for i in range(10):
            store.put(f"k{i:02d}", entry(10 * KiB, i))
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.2)
        assert spill.used_bytes <= spill.max_size
        assert len(spill) <= 3
        assert store.keys_total == len(store) + len(spill)
        spill.close()

    run(main())


# -- handlers --------------------------------------------------------------------------


def test_handlers_answer_batches_in_key_order() -> None:
    h = handlers(MemoryStore(1 << 20, 1 << 16))

    reply, _ = h.put_many(
        proto.PutValues(1, ["a", "b", "c"], [b"1", b"2", b"3"]), [b"A", b"B" * 70_000, b"C"]
    )
    assert reply.errors == [0, int(ErrorCode.VALUE_TOO_LARGE), 0]
    reply, frames = h.get_many(proto.GetValues(2, ["c", "b", "a"]), [])
    assert reply.found == [True, False, True] and reply.metas == [b"3", b"", b"1"]
    assert [bytes(f) for f in frames] == [b"C", b"A"]
    reply, _ = h.exists_many(proto.CheckValues(3, ["a", "x"]), [])
    assert reply.found == [True, False]


@pytest.mark.parametrize(
    ("msg", "frames", "code"),
    [
        (proto.PutValue(1, "k"), [], ErrorCode.BAD_FRAMES),
        (proto.PutValue(1, "k"), [b"a", b"b"], ErrorCode.BAD_FRAMES),
        (proto.PutValue(1, ""), [b"a"], ErrorCode.BAD_KEY),
        (proto.PutValue(1, "k", b"m" * 5000), [b"a"], ErrorCode.BAD_MESSAGE),
        (proto.PutValue(1, "k", b"", 12345), [b"a"], ErrorCode.CHECKSUM_MISMATCH),
        (proto.PutValues(1, ["a", "b"]), [b"a"], ErrorCode.BAD_FRAMES),
        (proto.GetValues(1, ["k"] * (proto.MAX_BATCH + 1)), [], ErrorCode.BATCH_TOO_LARGE),
        (proto.ListKeys(1, "", "", 0), [], ErrorCode.BAD_MESSAGE),
        (proto.ListKeys(1, "", "bogus", 10), [], ErrorCode.BAD_MESSAGE),
        (proto.GetValue(1, "bad\nkey"), [], ErrorCode.BAD_KEY),
    ],
    ids=[
        "put-no-frame",
        "put-two-frames",
        "empty-key",
        "meta-too-big",
        "checksum",
        "mput-frames",
        "batch-too-large",
        "list-limit",
        "list-cursor",
        "control-char-key",
    ],
)
def test_handlers_refuse_bad_requests(msg, frames, code) -> None:
    h = handlers(MemoryStore(1 << 20, 1 << 16))
    with pytest.raises(RequestError) as exc:
        h.table[type(msg)](msg, frames)
    assert exc.value.code is code

"""The cache-server's misses by reason (kvmesh_cacheserver_misses_total{reason}): a key
never stored, one evicted for room (no spill), one whose spill file fails its checks,
and one deleted by a client, each counted once, through the handlers as a client sees
them."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from kvtest.cacheserver_handlers import handlers

from kvmesh.common.protocol import cacheserver as proto
from kvmesh.common.recent_keys import RecentKeys
from kvmesh.services.cacheserver.handlers import Handlers
from kvmesh.services.cacheserver.spill import HEADER_SIZE, DiskSpill
from kvmesh.services.cacheserver.store import ENTRY_OVERHEAD, MISS_REASONS, MemoryStore

KiB = 1024


def cost(key: str, n: int) -> int:
    return n + len(key) + ENTRY_OVERHEAD


def reasons(h: Handlers) -> dict[str, float]:
    m = h.stats.metrics
    return {r: m.value("cacheserver_misses_total", {"reason": r}) for r in MISS_REASONS}


def get(h: Handlers, key: str) -> bool:
    reply, _ = asyncio.run(h.aget(proto.GetValue(1, key), []))
    return reply.found


def test_never_stored_evicted_and_deleted_keys() -> None:
    store = MemoryStore(max_memory=2 * cost("k0", 10 * KiB), max_value_size=64 * KiB)
    h = handlers(store)
    for i in range(3):  # k0 is evicted to make room for k2
        h.put(proto.PutValue(i, f"k{i}"), [bytes([i]) * 10 * KiB])
    assert store.evictions == 1
    assert not get(h, "never")
    assert not get(h, "k0")
    assert get(h, "k1")
    assert reasons(h) == {"not_stored": 1, "evicted": 1, "checksum": 0, "timeout": 0}
    assert store.miss_reasons == {"not_stored": 1, "evicted": 1, "checksum": 0, "timeout": 0}

    # Stored again, then deleted by a client: from then on "not stored", not evicted.
    h.put(proto.PutValue(9, "k0"), [b"x" * KiB])
    assert get(h, "k0")
    h.delete(proto.DeleteValue(10, "k0"), [])
    # A batch counts each key once.
    reply, _ = asyncio.run(h.aget_many(proto.GetValues(11, ["k0", "k1", "never"]), []))
    assert reply.found == [False, True, False]
    assert reasons(h) == {"not_stored": 3, "evicted": 1, "checksum": 0, "timeout": 0}
    assert h.stats.metrics.value("cacheserver_gets_total", {"result": "miss"}) == 4


def flip_a_value_byte(spill_dir: Path) -> None:
    (path,) = spill_dir.glob("*.val")
    data = bytearray(path.read_bytes())
    data[HEADER_SIZE + 100] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_corrupt_spill_file_is_one_checksum_miss(tmp_path: Path) -> None:
    async def main() -> Handlers:
        spill = DiskSpill(tmp_path, max_size=1 << 20)
        store = MemoryStore(cost("a", 10 * KiB), 64 * KiB, spill)
        h = handlers(store)
        h.put(proto.PutValue(1, "a"), [b"\x01" * 10 * KiB])
        h.put(proto.PutValue(2, "b"), [b"\x02" * 10 * KiB])  # a goes to the spill
        deadline = time.monotonic() + 5
        while "a" in spill._pending:  # its write has not landed yet
            assert time.monotonic() < deadline, "the spill write never landed"
            await asyncio.sleep(0.01)
        await asyncio.to_thread(flip_a_value_byte, tmp_path)
        reply, _ = await h.aget(proto.GetValue(3, "a"), [])
        assert not reply.found
        reply, _ = await h.aget(proto.GetValue(4, "a"), [])  # the file is gone now
        assert not reply.found
        spill.close()
        return h

    h = asyncio.run(main())
    assert reasons(h) == {"not_stored": 1, "evicted": 0, "checksum": 1, "timeout": 0}


def test_recent_keys_forget_the_oldest_beyond_capacity() -> None:
    keys: RecentKeys[str] = RecentKeys(3)
    for k in "abcd":
        keys.add(k)
    assert "a" not in keys and all(k in keys for k in "bcd") and len(keys) == 3
    keys.add("b")  # refreshed: now the newest
    keys.add("e")
    assert "c" not in keys and "b" in keys
    keys.discard("b")
    assert "b" not in keys

"""The remote tier over an in-memory connector (no sockets): puts, gets, bounded lookups,
the presence cache, health (instant misses while down, dropped puts, reconnection),
and the whole engine over `fs://` (a directory, the disk tier's file format)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from kvtest.paged import bits, make_cache, slot_tokens

from kvmesh.common.chunk_codec import ChunkHeader
from kvmesh.common.config import EngineConfig, L1Config, RemoteConfig
from kvmesh.common.keys import ChunkKey
from kvmesh.common.memory import HostMemoryPool, MemoryFormat
from kvmesh.common.transport.tcp_address import host_ports
from kvmesh.services.worker.engine import KVEngine
from kvmesh.services.worker.loop_thread import LoopThread
from kvmesh.services.worker.tiers import remote_presence
from kvmesh.services.worker.tiers.remote import RemoteTier
from kvmesh.services.worker.tiers.remote_connector import Fetched, make_connector
from kvmesh.services.worker.tiers.remote_presence import PresenceCache

NS = "00112233445566ff"


def key(i: int) -> ChunkKey:
    return ChunkKey(NS, i.to_bytes(16, "little"))


class MemoryConnector:
    """A remote store in a dict, with switches to make it fail or hang."""

    scheme = "mem"
    compresses = True
    display = "mem://"

    def __init__(self) -> None:
        self.values: dict[ChunkKey, tuple[ChunkHeader, bytes]] = {}
        self.dead = False
        self.hang = False
        self.calls: dict[str, int] = {}

    async def _enter(self, op: str) -> None:
        self.calls[op] = self.calls.get(op, 0) + 1
        if self.hang:
            await asyncio.sleep(3600)
        if self.dead:
            raise ConnectionError("remote is dead")

    def connected(self) -> bool | None:
        return None

    async def reconnect(self) -> None:
        await self._enter("reconnect")

    async def ping(self) -> None:
        await self._enter("ping")

    async def put(self, key: ChunkKey, header: ChunkHeader, packed: bytes, payload: Any) -> None:
        await self._enter("put")
        self.values[key] = (header, bytes(payload))

    async def get(self, key: ChunkKey) -> Fetched | None:
        await self._enter("get")
        item = self.values.get(key)
        return None if item is None else Fetched(item[0], item[1])

    async def exists(self, keys: Sequence[ChunkKey]) -> list[bool]:
        await self._enter("exists")
        return [k in self.values for k in keys]

    async def delete(self, keys: Sequence[ChunkKey]) -> int:
        await self._enter("delete")
        return sum(self.values.pop(k, None) is not None for k in keys)

    async def clear(self, namespace_ids: Sequence[str]) -> int:
        await self._enter("clear")
        gone = [k for k in self.values if k.namespace_id in namespace_ids]
        for k in gone:
            del self.values[k]
        return len(gone)

    async def close(self) -> None:
        pass


def remote_config(**kw) -> RemoteConfig:
    base = {
        "enabled": True,
        "url": "kvmesh://unused:1",
        "timeout_s": 0.3,
        "lookup_timeout_s": 0.05,
        "health_interval_s": 0.1,
        "failures_to_down": 2,
    }
    return RemoteConfig(**{**base, **kw})


@pytest.fixture
def setup():
    loop = LoopThread("test-remote")
    pool = HostMemoryPool(8 << 20, 64 * 1024, pin_memory=False)
    conn = MemoryConnector()
    tiers: list[RemoteTier] = []

    def make(**kw) -> RemoteTier:
        tier = RemoteTier(conn, loop, remote_config(**kw))
        tiers.append(tier)
        assert tier.wait_ready(5)
        return tier

    yield make, conn, pool
    for t in tiers:
        t.close()
    loop.stop()
    pool.close()


def chunk(pool: HostMemoryPool, seed: int):
    obj = pool.allocate(torch.Size([2, 2, 16, 64]), torch.float16, MemoryFormat.KV_2LTD)
    g = torch.Generator().manual_seed(seed)
    obj.raw.copy_(torch.randint(0, 256, (obj.nbytes,), dtype=torch.uint8, generator=g))
    return obj


def test_put_get_round_trip_and_references(setup) -> None:
    make, _conn, pool = setup
    tier = make()
    obj = chunk(pool, 1)
    tier.submit_put(key(1), obj)
    assert tier.flush(2)
    assert obj.ref_count == 1, "the tier kept a reference after its put"
    got = tier.get(key(1), pool)
    assert got is not None and torch.equal(got.raw, obj.raw) and got.ref_count == 1
    assert tier.get(key(2), pool) is None
    m = tier.stats.metrics
    assert m.value("remote_puts_total", {"result": "written"}) == 1
    assert m.value("remote_gets_total", {"result": "hit"}) == 1
    assert m.value("remote_gets_total", {"result": "miss"}) == 1
    got.ref_down()
    obj.ref_down()


def test_a_known_key_is_not_sent_twice(setup) -> None:
    make, conn, pool = setup
    tier = make()
    obj = chunk(pool, 1)
    for _ in range(3):
        tier.submit_put(key(1), obj)
    assert tier.flush(2)
    tier.submit_put(key(1), obj)
    assert tier.flush(2)
    assert conn.calls["put"] == 1
    assert tier.stats.metrics.value("remote_puts_total", {"result": "duplicate"}) == 3
    obj.ref_down()


def test_lookups_use_the_presence_cache_and_one_batch(setup) -> None:
    make, conn, pool = setup
    tier = make()
    objs = [chunk(pool, i) for i in range(4)]
    for i, o in enumerate(objs[:3]):
        tier.submit_put(key(i), o)
    assert tier.flush(2)
    before = conn.calls.get("exists", 0)
    assert tier.batched_contains([key(0), key(1), key(2)]) == 3  # all known: no round trip
    assert conn.calls.get("exists", 0) == before
    tier.presence.clear()
    assert tier.batched_contains([key(i) for i in range(6)]) == 3  # one batch asked
    assert conn.calls["exists"] == before + 1
    assert tier.batched_contains([key(i) for i in range(6)]) == 3  # key 3 cached absent
    assert conn.calls["exists"] == before + 1
    for o in objs:
        o.ref_down()


def test_a_hanging_remote_bounds_lookups_and_gets_by_their_deadlines(setup) -> None:
    make, conn, pool = setup
    tier = make(failures_to_down=100)  # stay "up": measure the deadlines themselves
    conn.hang = True
    t0 = time.monotonic()
    assert tier.batched_contains([key(7), key(8)]) == 0
    assert time.monotonic() - t0 < 0.05 + 0.1
    t0 = time.monotonic()
    assert tier.get(key(7), pool) is None
    assert time.monotonic() - t0 < 0.3 + 0.2
    assert tier.stats.metrics.value("remote_lookups_total", {"result": "timeout"}) == 1
    assert tier.stats.metrics.value("remote_gets_total", {"result": "error"}) == 1
    conn.hang = False


def test_down_means_instant_misses_dropped_puts_and_recovery(setup) -> None:
    make, conn, pool = setup
    tier = make()
    obj = chunk(pool, 3)
    tier.submit_put(key(3), obj)
    assert tier.flush(2)
    conn.dead = True
    deadline = time.monotonic() + 3
    while tier.up and time.monotonic() < deadline:  # the next ping notices
        time.sleep(0.01)
    assert not tier.up
    calls = dict(conn.calls)
    t0 = time.monotonic()
    for i in range(50):
        assert tier.batched_contains([key(3), key(i + 100)]) == 0
        assert tier.get(key(3), pool) is None
        tier.submit_put(key(i + 100), obj)
    assert time.monotonic() - t0 < 0.5, "requests waited on a dead remote"
    assert conn.calls.get("get", 0) == calls.get("get", 0)  # nothing reached the remote
    m = tier.stats.metrics
    assert m.value("remote_puts_total", {"result": "down"}) == 50
    assert m.value("remote_up") == 0
    conn.dead = False
    assert tier.wait_ready(3), "the tier did not come back by itself"
    got = tier.get(key(3), pool)
    assert got is not None and torch.equal(got.raw, obj.raw)
    assert m.value("remote_state_changes_total", {"to": "up"}) == 2
    got.ref_down()
    obj.ref_down()


def test_consecutive_request_failures_mark_it_down(setup) -> None:
    make, conn, pool = setup
    tier = make(health_interval_s=30.0)  # no ping in time: only requests notice
    conn.dead = True
    assert tier.get(key(1), pool) is None
    assert tier.up
    assert tier.get(key(1), pool) is None
    assert not tier.up
    conn.dead = False


def test_queue_limit_drops_and_counts(setup) -> None:
    make, conn, pool = setup
    tier = make(max_pending_puts=2, failures_to_down=100)
    conn.hang = True
    obj = chunk(pool, 1)
    for i in range(5):
        tier.submit_put(key(i), obj)
    assert tier.stats.metrics.value("remote_puts_total", {"result": "queue_full"}) == 3
    assert tier.flush(2)  # the hung puts hit their deadline and let go of the chunk
    assert obj.ref_count == 1
    conn.hang = False
    obj.ref_down()


def test_remove_and_clear_touch_only_this_tiers_namespaces(setup) -> None:
    make, conn, pool = setup
    tier = make()
    obj = chunk(pool, 1)
    for i in range(3):
        tier.submit_put(key(i), obj)
    assert tier.flush(2)
    foreign = ChunkKey("ffffffffffffffff", bytes(16))
    conn.values[foreign] = conn.values[key(0)]
    assert tier.remove(key(0))
    assert tier.clear() == 2
    assert list(conn.values) == [foreign]
    obj.ref_down()


def test_presence_cache_ttls_and_bound(monkeypatch) -> None:
    # The cache's own clock, moved by hand: with real sleeps, a test thread preempted
    # for 50 ms on a loaded machine saw the absence expire before its first check.
    now = [1000.0]
    monkeypatch.setattr(remote_presence, "time", SimpleNamespace(monotonic=lambda: now[0]))
    cache = PresenceCache(max_keys=3, present_ttl_s=0.2, absent_ttl_s=0.05)
    cache.update([key(0), key(1), key(2)], [True, True, False])
    assert cache.prefix([key(0), key(1), key(2), key(3)]) == (2, False)
    now[0] += 0.06
    assert cache.prefix([key(0), key(1), key(2)]) == (2, None)  # the absence expired
    cache.update([key(5), key(6)], [True, True])
    assert len(cache) <= 3
    now[0] += 0.21
    assert cache.get(key(5)) is None


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("h:1", [("h", 1)]),
        ("a:1,b:2", [("a", 1), ("b", 2)]),
        ("[::1]:7", [("::1", 7)]),
        ("host", [("host", 99)]),
    ],
)
def test_host_ports(text, expected) -> None:
    assert host_ports(text, 99) == expected


def test_unknown_scheme_is_refused() -> None:
    with pytest.raises(ValueError):
        make_connector("s3://bucket")


# -- the whole engine over fs:// ------------------------------------------------------------


def fs_engine(root: Path, view, **remote) -> KVEngine:
    cfg = EngineConfig(
        chunk_size=8,
        model_name="remote-fs",
        l1=L1Config(max_size=4 << 20, reserve=0, alloc_timeout_s=0.2),
        remote=RemoteConfig(enabled=True, url=f"fs://{root}", health_interval_s=0.1, **remote),
    )
    return KVEngine("fs", 0, cfg, view)


def test_engine_reuses_chunks_another_engine_wrote_to_a_shared_directory(tmp_path: Path) -> None:
    src_view, src_layers, kind = make_cache("cpu", torch.float16, True, blocks=16, block_size=4)
    dst_view, dst_layers, _ = make_cache("cpu", torch.float16, False, blocks=16, block_size=4)
    prompt = list(range(1000, 1040))
    src_slots, dst_slots = torch.randperm(64)[:40], torch.randperm(64)[:40]
    a = fs_engine(tmp_path, src_view)
    b = fs_engine(tmp_path, dst_view)
    try:
        assert a.storage.tier("remote").wait_ready(5) and b.storage.tier("remote").wait_ready(5)
        assert a.store(prompt, src_slots) == 40
        assert a.storage.tier("remote").flush(5)
        files = list(tmp_path.rglob("*.kv"))
        assert len(files) == 5 and all(f.parent.name == a.namespace.ns_id for f in files)
        assert b.lookup(prompt) == 40
        loaded = b.retrieve(prompt, dst_slots)
        assert bool(loaded.all())
        want = slot_tokens(src_layers, kind)[:, src_slots]
        got = slot_tokens(dst_layers, kind)[:, dst_slots]
        assert torch.equal(bits(want), bits(got))
        assert b.stats.metrics.value("tokens_hit_total", {"tier": "remote"}) == 40
        # A damaged file is a miss from there on, never wrong KV.
        b.clear(tier="l1")
        victim = sorted(files)[0]
        data = bytearray(victim.read_bytes())
        data[-1] ^= 0xFF
        victim.write_bytes(bytes(data))
        b.storage.tier("remote").presence.clear()
        loaded = b.retrieve(prompt, dst_slots)
        assert int(loaded.sum()) < 40
        assert b.stats.metrics.value("remote_gets_total", {"result": "corrupt"}) >= 1
    finally:
        a.close()
        b.close()


def test_fs_remote_on_a_missing_directory_is_down_not_fatal(tmp_path: Path) -> None:
    view, _, _ = make_cache("cpu", torch.float16, True, blocks=16, block_size=4)
    eng = fs_engine(tmp_path / "not-there", view)
    try:
        remote = eng.storage.tier("remote")
        assert not remote.wait_ready(0.3)
        assert eng.store(list(range(16)), torch.arange(16)) == 16  # L1 still works
        assert eng.lookup(list(range(16))) == 16
        (tmp_path / "not-there").mkdir()
        assert remote.wait_ready(3)
    finally:
        eng.close()


def test_a_small_get_waits_for_a_page_off_the_loop(setup) -> None:
    """A small uncompressed value is decoded on the loop only while an L1 page is free
    at once; with every page held elsewhere, the wait for one (up to the L1's
    alloc_timeout_s) happens on a thread, and the loop keeps serving meanwhile."""
    from kvmesh.services.worker.tiers.host import HostTier

    make, _conn, pool = setup
    tier = make()
    obj = chunk(pool, 7)
    tier.submit_put(key(7), obj)
    assert tier.flush(2)
    small = HostMemoryPool(obj.nbytes, obj.nbytes, pin_memory=False)
    l1 = HostTier(small, alloc_timeout_s=3.0)
    held = small.allocate(obj.shape, obj.dtype, obj.fmt)  # the only page, in use
    try:
        get = tier._loop.submit(tier.aget(key(7), l1))
        time.sleep(0.2)  # the get has its value and waits for a page
        t0 = time.monotonic()
        assert tier._loop.run(asyncio.sleep(0), 2.0) is None
        assert time.monotonic() - t0 < 0.5, "the event loop was blocked by the wait"
        assert not get.done()
        held.ref_down()
        held = None
        got = get.result(timeout=3)
        assert got is not None and torch.equal(got.raw, obj.raw)
        got.ref_down()
    finally:
        if held is not None:
            held.ref_down()
        obj.ref_down()
        small.close()

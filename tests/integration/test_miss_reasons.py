"""Hits and misses per tier with a reason (kvmesh_chunk_misses_total{tier,reason}) move
by exactly what a test did: N chunks stored and loaded, a prompt never stored, an L1
eviction, a corrupt disk file and a corrupt Redis value (a miss, never wrong bytes),
a removed remote value, a stopped redis-server, a frozen cache-server, and values a
cache-server evicted (counted on both sides)."""

from __future__ import annotations

import signal
import urllib.request
from pathlib import Path

import pytest
import redis
import torch
from kvtest.bridge import parse_metrics
from kvtest.paged import bits, make_cache, slot_tokens
from kvtest.remote import CacheServerProcess, RedisProcess, remote_engine
from kvtest.waiting import wait_for

from kvmesh.common.config import DiskConfig, EngineConfig, L1Config
from kvmesh.services.worker.engine import KVEngine
from kvmesh.services.worker.tiers.misses import MissReason

CHUNK = 8
BLOCKS, BLOCK = 64, 4
SLOTS = BLOCKS * BLOCK
REASONS = [r.value for r in MissReason]


def misses(eng: KVEngine, tier: str) -> dict[str, float]:
    """Every reason's counter of one tier, as the engine's metrics endpoint exports it."""
    m = eng.stats.metrics
    return {r: m.value("chunk_misses_total", {"tier": tier, "reason": r}) for r in REASONS}


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {r: after[r] - before[r] for r in before if after[r] != before[r]}


def value(eng: KVEngine, name: str, **labels: str) -> float:
    return eng.stats.metrics.value(name, labels or None) or 0.0


def prompt(n_chunks: int, base: int) -> list[int]:
    return list(range(base, base + n_chunks * CHUNK))


def l1_engine(l1_bytes: int = 8 << 20, **cfg) -> tuple[KVEngine, list, object]:
    view, layers, kind = make_cache("cpu", torch.float16, True, blocks=BLOCKS, block_size=BLOCK)
    config = EngineConfig(
        chunk_size=CHUNK,
        model_name="miss-test",
        l1=L1Config(max_size=l1_bytes, reserve=0, alloc_timeout_s=0.2),
        **cfg,
    )
    return KVEngine("miss", 0, config, view), layers, kind


def test_stored_chunks_hits_and_never_stored_misses_agree() -> None:
    eng, _, _ = l1_engine()
    try:
        stored = prompt(5, 1000)
        assert eng.store(stored, torch.randperm(SLOTS)[: len(stored)]) == 40
        assert value(eng, "chunks_stored_total") == 5
        assert value(eng, "tokens_stored_total") == 40

        assert bool(eng.retrieve(stored, torch.randperm(SLOTS)[:40]).all())
        assert value(eng, "chunk_hits_total", tier="l1") == 5
        assert value(eng, "tokens_hit_total", tier="l1") == 40
        assert not any(misses(eng, "l1").values())

        before = misses(eng, "l1")
        never = prompt(3, 900_000)
        assert not bool(eng.retrieve(never, torch.randperm(SLOTS)[:24]).any())
        assert delta(before, misses(eng, "l1")) == {"not_stored": 3}

        # Five cached chunks then two new ones: five hits, two misses.
        longer = [*stored, *prompt(2, 800_000)]
        before = misses(eng, "l1")
        loaded = eng.retrieve(longer, torch.randperm(SLOTS)[:56])
        assert int(loaded.sum()) == 40
        assert value(eng, "chunk_hits_total", tier="l1") == 10
        assert value(eng, "tokens_hit_total", tier="l1") == 80
        assert delta(before, misses(eng, "l1")) == {"not_stored": 2}
        # The same series on the metrics text an operator scrapes.
        text = eng.stats.metrics.render().decode()
        series = 'kvmesh_chunk_misses_total{instance="miss",rank="0",reason="not_stored",tier="l1"}'
        assert f"{series} 5.0" in text
    finally:
        eng.close()


def test_an_evicted_l1_chunk_is_a_miss_for_eviction() -> None:
    eng, _, _ = l1_engine(l1_bytes=64 << 10)
    try:
        first = prompt(2, 1000)
        assert eng.store(first, torch.randperm(SLOTS)[:16]) == 16
        # Fill L1 (LRU) one chunk at a time until the two oldest, `first`, are gone.
        base = 2000
        while value(eng, "evictions_total", tier="l1") < 2:
            base += CHUNK
            assert eng.store(prompt(1, base), torch.randperm(SLOTS)[:8]) == 8
        assert value(eng, "evictions_total", tier="l1") == 2
        assert eng.lookup(first) == 0

        before = misses(eng, "l1")
        assert not bool(eng.retrieve(first, torch.randperm(SLOTS)[:16]).any())
        assert delta(before, misses(eng, "l1")) == {"evicted": 2}

        # Stored again, then evicted no more: a hit, and the memory of it is cleared.
        assert eng.store(first, torch.randperm(SLOTS)[:16]) == 16
        assert bool(eng.retrieve(first, torch.randperm(SLOTS)[:16]).all())
        assert eng.storage.l1.miss_reason(eng.chunks(first)[0][2]) is None
        before = misses(eng, "l1")
        eng.clear(first, tier="l1")  # removed by an operator: not an eviction
        eng.retrieve(first, torch.randperm(SLOTS)[:16])
        assert delta(before, misses(eng, "l1")) == {"not_stored": 2}
    finally:
        eng.close()


def test_a_corrupt_disk_file_is_one_checksum_miss_and_never_wrong_bytes(tmp_path: Path) -> None:
    disk = DiskConfig(enabled=True, path=str(tmp_path), max_size=64 << 20)
    eng, layers, kind = l1_engine(disk=disk)
    dst_view, dst_layers, _ = make_cache(
        "cpu", torch.float16, False, blocks=BLOCKS, block_size=BLOCK
    )
    try:
        tier = eng.storage.tier("disk")
        p = prompt(3, 5000)
        src = torch.randperm(SLOTS)[:24]
        assert eng.store(p, src) == 24
        assert tier.flush(10)
        assert value(eng, "disk_puts_total", result="written") == 3
        eng.clear(tier="l1")
        keys = [k for _, _, k in eng.chunks(p)]
        # Flip one byte of the second chunk's payload (the file's last byte).
        path = Path(tier._file(keys[1]))
        raw = bytearray(path.read_bytes())
        raw[-1] ^= 0xFF
        path.write_bytes(bytes(raw))

        before = misses(eng, "disk")
        dst = torch.randperm(SLOTS)[:24]
        eng.register_kv_caches(dst_view)  # load into a zeroed cache: wrong bytes would show
        loaded = eng.retrieve(p, dst)
        # The first chunk loads; the corrupt one and what follows it are recomputed.
        assert loaded.tolist() == [True] * 8 + [False] * 16
        assert delta(before, misses(eng, "disk")) == {"checksum": 1}
        assert value(eng, "disk_corrupt_total") == 1
        assert value(eng, "chunk_hits_total", tier="disk") == 1
        want = slot_tokens(layers, kind)[:, src[:8]]
        got = slot_tokens(dst_layers, kind)[:, dst[:8]]
        assert torch.equal(bits(want), bits(got))

        # The corrupt file was deleted: the next load misses it as not stored, and the
        # checksum count stays at one.
        before = misses(eng, "disk")
        assert int(eng.retrieve(p, dst).sum()) == 8
        assert delta(before, misses(eng, "disk")) == {"not_stored": 1}
        assert not path.exists()
    finally:
        eng.close()


@pytest.fixture
def redis_node(tmp_path):
    node = RedisProcess(tmp_path).start()
    yield node
    node.kill()


def test_remote_checksum_evicted_and_down(redis_node) -> None:
    view, _, _ = make_cache("cpu", torch.float16, True, blocks=BLOCKS, block_size=BLOCK)
    eng = remote_engine(redis_node.url, view, instance="redis-miss", chunk=CHUNK)
    remote = eng.storage.tier("remote")
    client = redis.Redis(port=redis_node.port)
    try:
        p = prompt(3, 7000)
        assert eng.store(p, torch.randperm(SLOTS)[:24]) == 24
        assert remote.flush(5)
        assert value(eng, "remote_puts_total", result="written") == 3
        keys = [k for _, _, k in eng.chunks(p)]
        names = [remote.connector.prefix + k.to_str() for k in keys]
        assert client.dbsize() == 3

        # A corrupt value: one checksum miss, a load up to it, the value deleted.
        eng.clear(tier="l1")
        last = client.strlen(names[1]) - 1
        byte = client.getrange(names[1], last, last)[0]
        client.setrange(names[1], last, bytes([byte ^ 0xFF]))
        before = misses(eng, "remote")
        loaded = eng.retrieve(p, torch.randperm(SLOTS)[:24])
        assert loaded.tolist() == [True] * 8 + [False] * 16
        assert delta(before, misses(eng, "remote")) == {"checksum": 1}
        assert value(eng, "remote_gets_total", result="corrupt") == 1
        wait_for(lambda: not client.exists(names[1]), what="the corrupt value deleted")

        # A value this worker stored, gone from the store (as Redis's maxmemory would
        # evict it): an eviction, not "never stored".
        eng.clear(tier="l1")
        client.delete(names[0])
        before = misses(eng, "remote")
        assert not bool(eng.retrieve(p, torch.randperm(SLOTS)[:24]).any())
        # chunk 0 evicted, chunk 1 deleted as corrupt (so: not stored); chunk 2 is a
        # hit past the first miss, dropped.
        assert delta(before, misses(eng, "remote")) == {"evicted": 1, "not_stored": 1}

        # Redis stopped: once the tier marks it down, every chunk asked is remote_down.
        eng.clear(tier="l1")
        redis_node.kill()
        wait_for(lambda: not remote.up, timeout=15, what="the remote marked down")
        before = misses(eng, "remote")
        assert not bool(eng.retrieve(p, torch.randperm(SLOTS)[:24]).any())
        assert delta(before, misses(eng, "remote")) == {"remote_down": 3}
        assert value(eng, "remote_up") == 0
    finally:
        client.close()
        eng.close()


def test_a_frozen_cacheserver_is_a_timeout_per_chunk(tmp_path) -> None:
    """SIGSTOP: the connection stays open, nothing answers. With health checks far
    apart and many failures needed to mark it down, each get runs into its deadline."""
    with CacheServerProcess(tmp_path) as server:
        view, _, _ = make_cache("cpu", torch.float16, True, blocks=BLOCKS, block_size=BLOCK)
        eng = remote_engine(
            server.url, view, instance="frozen-miss", chunk=CHUNK, timeout_s=0.3,
            health_interval_s=60.0, failures_to_down=1000,
        )  # fmt: skip
        remote = eng.storage.tier("remote")
        try:
            p = prompt(4, 9000)
            assert eng.store(p, torch.randperm(SLOTS)[:32]) == 32
            assert remote.flush(5)
            eng.clear(tier="l1")
            before = misses(eng, "remote")
            server.proc.send_signal(signal.SIGSTOP)
            try:
                assert not bool(eng.retrieve(p, torch.randperm(SLOTS)[:32]).any())
            finally:
                server.proc.send_signal(signal.SIGCONT)
            assert delta(before, misses(eng, "remote")) == {"timeout": 4}
            assert remote.up  # a timeout alone does not mark the store down
            # Answering again: every chunk loads.
            assert bool(eng.retrieve(p, torch.randperm(SLOTS)[:32]).all())
            assert value(eng, "chunk_hits_total", tier="remote") == 4
        finally:
            eng.close()


def test_a_chunk_evicted_from_disk_is_a_miss_for_eviction(tmp_path: Path) -> None:
    disk = DiskConfig(enabled=True, path=str(tmp_path), max_size=1 << 20)  # the least allowed
    eng, _, _ = l1_engine(disk=disk)
    try:
        tier = eng.storage.tier("disk")
        first = prompt(2, 1000)
        assert eng.store(first, torch.randperm(SLOTS)[:16]) == 16
        assert tier.flush(10)
        # Fill the disk (LRU) until files go: `first`'s two, the oldest, go first.
        base = 1_000_000
        while value(eng, "evictions_total", tier="disk") < 2:
            base += 1000
            assert eng.store(prompt(16, base), torch.arange(128) % SLOTS) == 128
            assert tier.flush(10)
        eng.clear(tier="l1")
        before = misses(eng, "disk")
        assert not bool(eng.retrieve(first, torch.randperm(SLOTS)[:16]).any())
        assert delta(before, misses(eng, "disk")) == {"evicted": 2}
        # A prompt the disk never had, for contrast.
        before = misses(eng, "disk")
        eng.retrieve(prompt(2, 5_000_000), torch.randperm(SLOTS)[:16])
        assert delta(before, misses(eng, "disk")) == {"not_stored": 2}
    finally:
        eng.close()


def cacheserver_misses(server: CacheServerProcess) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics") as resp:
        metrics = parse_metrics(resp.read().decode())
    return {
        r: metrics.get(f'kvmesh_cacheserver_misses_total{{reason="{r}"}}', 0.0)
        for r in ("not_stored", "evicted", "checksum", "timeout")
    }


def test_values_the_cacheserver_evicted_are_evicted_on_both_sides(tmp_path) -> None:
    """A cache-server with room for a few dozen chunks: what this worker stored and the
    server evicted is an `evicted` miss for the worker's remote tier and for the
    server; a prompt never stored is `not_stored` on both."""
    options = {"max-memory": "64KiB", "max-value-size": "32KiB"}
    with CacheServerProcess(tmp_path, metrics=True, **options) as server:
        view, _, _ = make_cache("cpu", torch.float16, True, blocks=BLOCKS, block_size=BLOCK)
        eng = remote_engine(server.url, view, instance="evict-miss", chunk=CHUNK)
        remote = eng.storage.tier("remote")
        try:
            first = prompt(2, 1000)
            assert eng.store(first, torch.randperm(SLOTS)[:16]) == 16
            assert remote.flush(5)
            # Well past the server's memory: `first`, the least recently used, goes.
            for i in range(8):
                assert eng.store(prompt(8, 100_000 * (i + 1)), torch.arange(64)) == 64
                assert remote.flush(5)
            eng.clear(tier="l1")
            before, server_before = misses(eng, "remote"), cacheserver_misses(server)
            assert not bool(eng.retrieve(first, torch.randperm(SLOTS)[:16]).any())
            assert delta(before, misses(eng, "remote")) == {"evicted": 2}
            assert delta(server_before, cacheserver_misses(server)) == {"evicted": 2}

            before, server_before = misses(eng, "remote"), cacheserver_misses(server)
            eng.retrieve(prompt(2, 9_000_000), torch.randperm(SLOTS)[:16])
            assert delta(before, misses(eng, "remote")) == {"not_stored": 2}
            assert delta(server_before, cacheserver_misses(server)) == {"not_stored": 2}
        finally:
            eng.close()

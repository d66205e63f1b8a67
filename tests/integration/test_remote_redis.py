"""The remote tier on real Redis: one redis-server and a 3-master Redis Cluster on loopback.
An engine stores, a fresh engine (empty L1) reuses the chunks bit for bit; batches spread
over the cluster's nodes; clear removes them; a killed Redis turns into instant misses
and comes back by itself."""

from __future__ import annotations

import subprocess
import time

import pytest
import torch
from kvtest.paged import bits, make_cache, slot_tokens
from kvtest.remote import RedisCluster, RedisProcess, remote_engine

from kvmesh.common import offload

TOKENS = 80  # ten chunks of 8


@pytest.fixture(scope="module")
def redis_single(tmp_path_factory):
    node = RedisProcess(tmp_path_factory.mktemp("redis")).start()
    yield node
    node.kill()


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory):
    cluster = RedisCluster(tmp_path_factory.mktemp("cluster")).start()
    yield cluster
    cluster.stop()


def caches():
    src = make_cache("cpu", torch.float16, True, blocks=32, block_size=4)
    dst = make_cache("cpu", torch.float16, False, blocks=32, block_size=4)
    return src, dst


def dbsize(port: int) -> int:
    out = subprocess.run(
        ["redis-cli", "-p", str(port), "dbsize"], capture_output=True, text=True, check=True
    )
    return int(out.stdout.strip())


@pytest.mark.parametrize("which", ["single", "single-threads", "cluster"])
def test_a_fresh_engine_reuses_chunks_through_redis(which, request, monkeypatch) -> None:
    if which == "single-threads":
        # Every value's checksum, header join and decode on a thread, as from a megabyte.
        monkeypatch.setattr(offload, "OFFLOAD_FROM", 1)
    store = request.getfixturevalue("redis_cluster" if which == "cluster" else "redis_single")
    (src_view, src_layers, kind), (dst_view, dst_layers, _) = caches()
    prompt = list(range(5000, 5000 + TOKENS))
    src_slots, dst_slots = torch.randperm(128)[:TOKENS], torch.randperm(128)[:TOKENS]
    a = remote_engine(store.url, src_view, instance=f"a-{which}")
    b = remote_engine(store.url, dst_view, instance=f"b-{which}")
    try:
        assert a.store(prompt, src_slots) == TOKENS
        assert a.storage.tier("remote").flush(5)
        assert b.lookup(prompt) == TOKENS
        assert bool(b.retrieve(prompt, dst_slots).all())
        want = slot_tokens(src_layers, kind)[:, src_slots]
        got = slot_tokens(dst_layers, kind)[:, dst_slots]
        assert torch.equal(bits(want), bits(got))
        assert b.stats.metrics.value("tokens_hit_total", {"tier": "remote"}) == TOKENS
        if which == "cluster":
            sizes = [dbsize(n.port) for n in store.nodes]
            assert sum(sizes) == 10 and sum(1 for s in sizes if s) >= 2, sizes
        assert a.clear(tier="remote") == 10
        b.storage.tier("remote").presence.clear()
        b.clear(tier="l1")
        assert b.lookup(prompt) == 0
    finally:
        a.close()
        b.close()


def test_compression_when_it_pays(redis_single) -> None:
    view, layers, kind = make_cache("cpu", torch.float16, False, blocks=32, block_size=4)
    for t in layers:  # mostly zeros: compresses well
        t[..., :4] = 1.0
    eng = remote_engine(redis_single.url, view, instance="zstd", compression="zstd")
    try:
        prompt = list(range(9000, 9000 + TOKENS))
        assert eng.store(prompt, torch.arange(TOKENS)) == TOKENS
        remote = eng.storage.tier("remote")
        assert remote.flush(5)
        m = remote.stats.metrics
        sent, raw = m.value("remote_sent_bytes_total"), m.value("remote_raw_sent_bytes_total")
        assert sent < raw / 4, (sent, raw)
        eng.clear(tier="l1")
        before = slot_tokens(layers, kind).clone()
        for t in layers:
            t.zero_()
        assert bool(eng.retrieve(prompt, torch.arange(TOKENS)).all())
        assert torch.equal(bits(slot_tokens(layers, kind)[:, :TOKENS]), bits(before[:, :TOKENS]))
    finally:
        eng.clear(tier="remote")
        eng.close()


def test_a_killed_redis_is_skipped_then_used_again(tmp_path) -> None:
    node = RedisProcess(tmp_path).start()
    (view, _, _), _ = caches()
    eng = remote_engine(node.url, view, instance="kill", failures_to_down=1)
    remote = eng.storage.tier("remote")
    try:
        node.kill()
        deadline = time.monotonic() + 5
        while remote.up and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not remote.up
        t0 = time.monotonic()
        for i in range(20):
            prompt = list(range(i * 100, i * 100 + 16))
            assert eng.store(prompt, torch.arange(16)) == 16  # L1 goes on
            assert eng.lookup(prompt) == 16
        assert time.monotonic() - t0 < 1.0
        assert remote.stats.metrics.value("remote_puts_total", {"result": "down"}) >= 20
        RedisProcess(tmp_path, node.port).start()
        assert remote.wait_ready(10)
        prompt = list(range(7000, 7016))
        eng.store(prompt, torch.arange(16))
        assert remote.flush(5)
        assert dbsize(node.port) == 2
    finally:
        eng.close()
        subprocess.run(["redis-cli", "-p", str(node.port), "shutdown", "nosave"], check=False)

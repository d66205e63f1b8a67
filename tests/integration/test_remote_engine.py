"""Engines on a real cache-server process (`kvmesh://`): a fresh engine reuses another's
chunks bit for bit, and killing the cache-server mid-load costs no request more than
the remote deadline while L1 keeps serving; after a restart the remote is used again."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch
from kvtest.paged import bits, make_cache, slot_tokens
from kvtest.remote import CacheServerProcess, remote_engine

from kvmesh.common.transport.cacheserver_client import CacheServerClient

BLOCKS, BLOCK = 64, 4
SLOTS = BLOCKS * BLOCK


@pytest.fixture
def server(tmp_path):
    with CacheServerProcess(tmp_path) as srv:
        yield srv


@pytest.mark.parametrize("compression", ["none", "lz4"])
def test_a_fresh_engine_reuses_chunks_through_the_cacheserver(server, compression) -> None:
    src_view, src_layers, kind = make_cache("cpu", torch.bfloat16, True, blocks=BLOCKS)
    dst_view, dst_layers, _ = make_cache("cpu", torch.bfloat16, False, blocks=BLOCKS)
    prompt = list(range(100, 100 + 200))
    src_slots, dst_slots = torch.randperm(SLOTS)[:200], torch.randperm(SLOTS)[:200]
    a = remote_engine(server.url, src_view, instance="a", compression=compression)
    b = remote_engine(server.url, dst_view, instance="b", compression=compression)
    try:
        assert a.store(prompt, src_slots) == 200
        assert a.storage.tier("remote").flush(5)
        assert b.lookup(prompt) == 200
        assert bool(b.retrieve(prompt, dst_slots).all())
        want = slot_tokens(src_layers, kind)[:, src_slots]
        got = slot_tokens(dst_layers, kind)[:, dst_slots]
        assert torch.equal(bits(want), bits(got))
        assert b.stats.metrics.value("tokens_hit_total", {"tier": "remote"}) == 200
    finally:
        a.close()
        b.close()


def test_chunks_larger_than_a_part_come_back_whole(server) -> None:
    # 640 tokens x 16 KiB = 10 MiB a chunk: the cache-server sends each in two parts
    # (remote_kvmesh.VALUE_PART_BYTES), which the tier copies into one L1 buffer.
    from kvmesh.services.worker.tiers.remote_kvmesh import VALUE_PART_BYTES

    shape = {"layers": 4, "blocks": 80, "block_size": 16, "heads": 8, "head_dim": 128}
    src_view, src_layers, kind = make_cache("cpu", torch.float16, True, **shape)
    dst_view, dst_layers, _ = make_cache("cpu", torch.float16, False, **shape)
    tokens = 1280
    prompt = list(range(5000, 5000 + tokens))
    src_slots, dst_slots = torch.randperm(1280)[:tokens], torch.randperm(1280)[:tokens]
    opts = {"chunk": 640, "l1_bytes": 32 << 20, "timeout_s": 5.0}
    a = remote_engine(server.url, src_view, instance="big-a", **opts)
    b = remote_engine(server.url, dst_view, instance="big-b", **opts)
    try:
        chunk_bytes = a.layout.chunk_nbytes(640)
        assert VALUE_PART_BYTES < chunk_bytes < 2 * VALUE_PART_BYTES
        assert b.storage.tier("remote").connector.client.value_part_bytes == VALUE_PART_BYTES
        assert a.store(prompt, src_slots) == tokens
        assert a.storage.tier("remote").flush(10)
        assert bool(b.retrieve(prompt, dst_slots).all())
        want = slot_tokens(src_layers, kind)[:, src_slots]
        assert torch.equal(bits(want), bits(slot_tokens(dst_layers, kind)[:, dst_slots]))
        assert b.stats.metrics.value("tokens_hit_total", {"tier": "remote"}) == tokens
    finally:
        a.close()
        b.close()


def test_killing_the_cacheserver_mid_load(server) -> None:
    deadline_s, lookup_deadline_s = 0.5, 0.05
    view, _, _ = make_cache("cpu", torch.float16, True, blocks=BLOCKS)
    fresh_view, _, _ = make_cache("cpu", torch.float16, False, blocks=BLOCKS)
    options = {"timeout_s": deadline_s, "lookup_timeout_s": lookup_deadline_s}
    eng = remote_engine(server.url, view, instance="load", **options)
    other = remote_engine(server.url, fresh_view, instance="other", **options)
    remote = eng.storage.tier("remote")
    warm = list(range(7_000_000, 7_000_064))  # never among the load's prompts
    assert eng.store(warm, torch.arange(64)) == 64
    assert remote.flush(5)

    worst = {"store": 0.0, "lookup": 0.0, "retrieve": 0.0, "other": 0.0}
    failures: list[str] = []
    stop = threading.Event()

    def timed(name: str, fn):
        t0 = time.perf_counter()
        out = fn()
        worst[name] = max(worst[name], time.perf_counter() - t0)
        return out

    def load() -> None:
        i = 0
        while not stop.is_set():
            i += 1
            stored = [i * 1000 + t for t in range(32)]
            asked = [*stored, *range(i * 1000 + 500, i * 1000 + 516)]  # the tail is nowhere
            slots = torch.randperm(SLOTS)[:48]
            if timed("store", lambda s=stored, sl=slots: eng.store(s, sl[:32])) != 32:
                failures.append(f"store {i}")
            if timed("lookup", lambda a=asked: eng.lookup(a)) != 32:
                failures.append(f"lookup {i}")
            loaded = timed("retrieve", lambda a=asked, sl=slots: eng.retrieve(a, sl))
            if int(loaded.sum()) != 32:
                failures.append(f"retrieve {i}: {int(loaded.sum())}")
            # Another engine with an empty L1 reads the warm chunks: remote hits while it
            # is up, quick misses (a recompute) while it is down.
            timed("other", lambda: other.retrieve(warm, torch.randperm(SLOTS)[:64]))
            other.clear(tier="l1")

    worker = threading.Thread(target=load)
    worker.start()
    try:
        time.sleep(0.8)
        server.kill()
        t0 = time.monotonic()
        # An upper bound only (the loop ends when it is noticed): generous, because a
        # loaded machine delays the health checks themselves.
        while remote.up and time.monotonic() - t0 < 15:
            time.sleep(0.01)
        assert not remote.up, "the dead cache-server was not noticed"
        time.sleep(0.7)  # load goes on against a dead remote
        server.start()
        assert remote.wait_ready(10), "the engine did not reconnect by itself"
        time.sleep(0.5)
    finally:
        stop.set()
        worker.join(30)
    try:
        assert not failures, failures[:10]
        print("worst request times (s):", {k: round(v, 3) for k, v in worst.items()})
        margin = 0.25  # scheduling noise on a 2-core machine
        for name, worst_s in worst.items():
            assert worst_s < deadline_s + margin, (name, worst_s)
        m = remote.stats.metrics
        assert m.value("remote_puts_total", {"result": "down"}) > 0
        assert m.value("remote_state_changes_total", {"to": "down"}) >= 1
        # Used again: a new chunk reaches the restarted server and a fresh engine reads it.
        again = list(range(8_000_000, 8_000_032))
        assert eng.store(again, torch.arange(32)) == 32
        assert remote.flush(5)
        other.clear(tier="l1")
        other.storage.tier("remote").presence.clear()
        assert other.storage.tier("remote").wait_ready(5)
        assert other.lookup(again) == 32
        assert bool(other.retrieve(again, torch.randperm(SLOTS)[:32]).all())
    finally:
        eng.close()
        other.close()


def test_a_frozen_cacheserver_costs_at_most_the_deadline(server) -> None:
    """SIGSTOP: the connection stays open but nothing answers. Each request waits at
    most its deadline, a few failures mark the remote down (then misses are instant),
    and SIGCONT brings it back."""
    import signal

    deadline_s = 0.3
    view, _, _ = make_cache("cpu", torch.float16, True, blocks=BLOCKS)
    eng = remote_engine(
        server.url, view, instance="frozen", timeout_s=deadline_s, failures_to_down=2,
        health_interval_s=0.2,
    )  # fmt: skip
    remote = eng.storage.tier("remote")
    try:
        server.proc.send_signal(signal.SIGSTOP)
        times = []
        for i in range(6):
            asked = list(range(20_000 + i * 100, 20_000 + i * 100 + 16))
            t0 = time.perf_counter()
            assert eng.lookup(asked) == 0
            loaded = eng.retrieve(asked, torch.randperm(SLOTS)[:16])
            times.append(time.perf_counter() - t0)
            assert not bool(loaded.any())
        # The lookup's and the get's deadlines, plus room for a loaded machine.
        assert max(times) < 0.05 + deadline_s + 0.6, times
        assert not remote.up
        assert times[-1] < 0.05, "misses were not instant once the remote was down"
    finally:
        server.proc.send_signal(signal.SIGCONT)
    try:
        assert remote.wait_ready(5)
    finally:
        eng.close()


def test_close_waits_for_puts_in_flight(server) -> None:
    """Closing right after a store (no flush) while the cache-server is briefly
    frozen, so the puts are still in flight: engine.close_flush_s lets them finish, and
    a fresh engine finds every chunk."""
    import signal

    view, _, _ = make_cache("cpu", torch.float16, True, blocks=BLOCKS)
    prompts = [list(range(30_000 + 1000 * i, 30_000 + 1000 * i + 64)) for i in range(4)]
    eng = remote_engine(server.url, view, instance="closer")
    thaw = threading.Timer(0.2, server.proc.send_signal, (signal.SIGCONT,))
    try:
        server.proc.send_signal(signal.SIGSTOP)
        thaw.start()
        for p in prompts:
            assert eng.store(p, torch.randperm(SLOTS)[:64]) == 64
        pending = eng.storage.tier("remote")._pending
    finally:
        eng.close()
        thaw.join()
    assert pending > 0
    fresh = remote_engine(server.url, view, instance="fresh-after-close")
    try:
        assert [fresh.lookup(p) for p in prompts] == [64] * 4
    finally:
        fresh.close()


def test_a_damaged_value_is_a_miss_and_costs_no_l1_page(server) -> None:
    # Chunks come over the data connection straight into L1 pages; one whose bytes
    # fail the checksum must give its page back and never reach the paged cache.
    src_view, _, _ = make_cache("cpu", torch.bfloat16, True, blocks=BLOCKS)
    dst_view, dst_layers, _ = make_cache("cpu", torch.bfloat16, False, blocks=BLOCKS)
    prompt = list(range(7000, 7000 + 64))
    src_slots, dst_slots = torch.randperm(SLOTS)[:64], torch.randperm(SLOTS)[:64]
    a = remote_engine(server.url, src_view, instance="dmg-a")
    b = remote_engine(server.url, dst_view, instance="dmg-b")
    try:
        assert a.store(prompt, src_slots) == 64
        assert a.storage.tier("remote").flush(5)

        async def damage() -> int:
            c = CacheServerClient(server.endpoint, timeout_s=3.0)
            await c.connect()
            try:
                keys, _ = await c.list_page("", "", 1000)
                for k in keys:
                    value = await c.get(k)
                    raw = bytearray(value.tobytes())
                    raw[len(raw) // 2] ^= 1
                    await c.put(k, bytes(raw), value.meta)
                return len(keys)
            finally:
                await c.close()

        assert asyncio.run(damage()) == 8
        before = dst_layers[0].clone()
        used = b.pool.used_pages
        assert not bool(b.retrieve(prompt, dst_slots).any())
        assert b.stats.metrics.value("remote_gets_total", {"result": "corrupt"}) >= 1
        assert b.pool.used_pages == used
        assert torch.equal(bits(dst_layers[0]), bits(before))
    finally:
        a.close()
        b.close()

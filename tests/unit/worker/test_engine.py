"""KVEngine over L1: exact round trips for every layout, pins under pressure, lower-tier
promotion, prefetch, clear/freeze, metrics and events, and the builder."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch
from kvtest.paged import DTYPES, SPECS, bits, drain, drain_counting, make_cache, slot_tokens

from kvmesh.common.config import EngineConfig, L1Config
from kvmesh.common.keys import ChunkKey
from kvmesh.common.memory import MemoryObj
from kvmesh.services.worker.builder import (
    EngineConfigMismatch,
    destroy_engine,
    get_engine,
    get_or_create_engine,
)
from kvmesh.services.worker.engine import KVEngine
from kvmesh.services.worker.events import KVEventKind

CHUNK = 8
BLOCKS, BLOCK = 16, 4
SLOTS = BLOCKS * BLOCK


def config(**kw) -> EngineConfig:
    l1 = kw.pop("l1", None) or L1Config(max_size=8 << 20, reserve=0, alloc_timeout_s=0.2)
    return EngineConfig(**{"chunk_size": CHUNK, "model_name": "test", "l1": l1, **kw})


def engine_for(view, cfg: EngineConfig | None = None, **kw) -> KVEngine:
    return KVEngine("t", 0, cfg or config(), view, **kw)


def tokens(n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, 50_000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture
def cpu_engine():
    view, layers, kind = make_cache("cpu", torch.float16, True, blocks=BLOCKS, block_size=BLOCK)
    eng = engine_for(view)
    yield eng, layers, kind
    eng.close()


@pytest.mark.parametrize("layerwise", [False, True], ids=["whole", "layerwise"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("spec", SPECS)
def test_round_trip_is_bitwise_exact(spec: str, dtype: torch.dtype, layerwise: bool) -> None:
    shape = {"blocks": BLOCKS, "block_size": BLOCK}
    src_view, src_layers, kind = make_cache(spec, dtype, True, **shape)
    prompt = tokens(30)  # three full chunks of 8; the last 6 tokens are not stored
    src_slots = torch.randperm(SLOTS)[:30]
    eng = engine_for(src_view)
    try:
        if layerwise:
            stored, steps = drain_counting(eng.store_layer(prompt, src_slots))
            assert stored == 24
            assert steps == eng.layout.num_layers - 1  # one yield between layers
        else:
            assert eng.store(prompt, src_slots) == 24
        assert eng.lookup(prompt, "req") == 24

        dst_view, dst_layers, _ = make_cache(spec, dtype, False, **shape)
        eng.register_kv_caches(dst_view)
        dst_slots = torch.randperm(SLOTS)[:30]
        if layerwise:
            loaded = drain(eng.retrieve_layer(prompt, dst_slots, lookup_id="req"))
        else:
            loaded = eng.retrieve(prompt, dst_slots, lookup_id="req")
        assert loaded.tolist() == [True] * 24 + [False] * 6

        src, dst = slot_tokens(src_layers, kind), slot_tokens(dst_layers, kind)
        assert torch.equal(bits(dst[:, dst_slots[:24]]), bits(src[:, src_slots[:24]]))
        untouched = torch.ones(SLOTS, dtype=torch.bool)
        untouched[dst_slots[:24]] = False
        assert not bits(dst[:, untouched]).any()
        assert len(eng.pins) == 0  # the retrieve released the lookup's pins
    finally:
        eng.close()


def test_retrieve_stops_at_first_missing_chunk(cpu_engine) -> None:
    eng, _, _ = cpu_engine
    prompt = tokens(32)
    slots = torch.randperm(SLOTS)[:32]
    assert eng.store(prompt, slots) == 32
    second = eng.chunks(prompt)[1][2]
    assert eng.storage.remove(second) == 1
    assert eng.lookup(prompt) == 8
    loaded = eng.retrieve(prompt, torch.randperm(SLOTS)[:32])
    assert loaded.tolist() == [True] * 8 + [False] * 24


def test_store_with_mask_skips_the_cached_prefix(cpu_engine) -> None:
    eng, _, _ = cpu_engine
    prompt = tokens(24)
    slots = torch.randperm(SLOTS)[:24]
    assert eng.store(prompt[:8], slots[:8]) == 8
    mask = torch.tensor([False] * 8 + [True] * 16)
    assert eng.store(prompt, slots, mask) == 16
    assert eng.store(prompt, slots) == 0  # everything already there
    assert eng.lookup(prompt) == 24
    # retrieve with a mask loads only past the prefix the engine already has
    loaded = eng.retrieve(prompt, slots, mask)
    assert loaded.tolist() == [False] * 8 + [True] * 16


def test_prefix_sharing_prompts_reuse_common_chunks(cpu_engine) -> None:
    eng, _, _ = cpu_engine
    a = tokens(32, seed=1)
    b = a[:20] + tokens(12, seed=2)
    assert eng.store(a, torch.randperm(SLOTS)[:32]) == 32
    assert eng.lookup(b) == 16  # chunks 0 and 1 are shared; chunk 2 differs at token 20


def test_corrupt_chunk_shape_is_a_miss_not_garbage(cpu_engine) -> None:
    eng, _, _ = cpu_engine
    prompt = tokens(16)
    eng.store(prompt, torch.randperm(SLOTS)[:16])
    # A chunk whose shape does not fit this engine (e.g. from another model) stops the load.
    key = eng.chunks(prompt)[1][2]
    l1 = eng.storage.l1
    assert l1.remove(key)
    bad = l1.allocate((2, 3, 5), torch.float16, eng.chunk_format)
    l1.insert(key, bad)
    before = eng.stats.load_errors._value.get()
    loaded = eng.retrieve(prompt, torch.randperm(SLOTS)[:16])
    assert loaded.tolist() == [True] * 8 + [False] * 8
    assert eng.stats.load_errors._value.get() == before + 1


def small_l1(chunks: int, view) -> EngineConfig:
    # Pool pages are rounded up to 4 KiB so payloads stay aligned for O_DIRECT.
    page = -(-make_copier_layout(view).chunk_nbytes(CHUNK) // 4096) * 4096
    return config(l1=L1Config(max_size=chunks * page, reserve=0, alloc_timeout_s=0.2))


def make_copier_layout(view):
    from kvmesh.gpu_ext import make_copier

    return make_copier(view).layout


def test_eviction_never_drops_pinned_and_full_pins_fail_by_deadline() -> None:
    view, layers, kind = make_cache("cpu", torch.float16, True, blocks=BLOCKS, block_size=BLOCK)
    eng = engine_for(view, small_l1(4, view))
    try:
        pinned = tokens(16, seed=10)
        pinned_slots = torch.randperm(SLOTS)[:16]
        assert eng.store(pinned, pinned_slots) == 16
        assert eng.lookup(pinned, "keep") == 16  # two chunks pinned
        for i in range(6):  # 12 chunks through 2 free pages: evicts, but never "keep"
            assert eng.store(tokens(16, seed=100 + i), torch.randperm(SLOTS)[:16]) == 16
            assert eng.lookup(pinned) == 16
        assert eng.stats.evictions["l1"]._value.get() >= 10

        assert eng.lookup(tokens(16, seed=105), "also") == 16  # now all four pinned
        t0 = time.monotonic()
        assert eng.store(tokens(16, seed=200), torch.randperm(SLOTS)[:16]) == 0
        waited = time.monotonic() - t0
        assert 0.2 <= waited < 2.0
        assert eng.stats.alloc_failures._value.get() == 1

        # The pinned chunks still hold the right KV.
        dst = torch.randperm(SLOTS)[:16]
        src = slot_tokens(layers, kind)[:, pinned_slots].clone()
        assert eng.retrieve(pinned, dst, lookup_id="keep").all()
        assert torch.equal(bits(slot_tokens(layers, kind)[:, dst]), bits(src))
        eng.release_lookup("also")
        assert eng.store(tokens(16, seed=200), torch.randperm(SLOTS)[:16]) == 16
    finally:
        eng.close()


def test_allocation_error_names_the_cause() -> None:
    view, _, _ = make_cache("cpu", torch.float16, True, blocks=BLOCKS, block_size=BLOCK)
    eng = engine_for(view, small_l1(1, view))
    try:
        eng.store(tokens(8), torch.arange(8))
        eng.lookup(tokens(8), "p")
        from kvmesh.services.worker.tiers.host import AllocationError

        with pytest.raises(AllocationError, match=r"L1 is full.*pinned or in use"):
            eng._new_chunk_obj(CHUNK)
    finally:
        eng.close()


def _clear_once_expired(eng: KVEngine, within_s: float = 3.0) -> int:
    """clear() once the lookup pins have expired. The expiry pass forgets the lookup,
    then unpins its chunks on the engine's thread: clear() counts them only after
    that second step, so poll it rather than len(eng.pins)."""
    deadline = time.monotonic() + within_s
    cleared = 0
    while not cleared and time.monotonic() < deadline:
        time.sleep(0.05)
        cleared = eng.clear()
    return cleared


def test_pins_expire_after_timeout() -> None:
    view, _, _ = make_cache("cpu", torch.float16, True, blocks=BLOCKS, block_size=BLOCK)
    eng = engine_for(view, config(pin_timeout_s=0.2))
    try:
        prompt = tokens(16)
        eng.store(prompt, torch.randperm(SLOTS)[:16])
        assert eng.lookup(prompt, "gone") == 16
        assert eng.clear() == 0  # pinned chunks stay
        assert _clear_once_expired(eng) == 2
        assert len(eng.pins) == 0
        assert eng.lookup(prompt) == 0
    finally:
        eng.close()


def test_release_lookup_unpins(cpu_engine) -> None:
    eng, _, _ = cpu_engine
    prompt = tokens(16)
    eng.store(prompt, torch.randperm(SLOTS)[:16])
    eng.lookup(prompt, "x")
    assert eng.clear() == 0
    eng.release_lookup("x")
    assert eng.clear() == 2


def test_a_lookup_that_pins_nothing_holds_no_entry(cpu_engine) -> None:
    eng, _, _ = cpu_engine
    prompt = tokens(16)
    assert eng.lookup(prompt, "cold") == 0
    assert "cold" not in eng.pins and len(eng.pins) == 0  # not in pinned_lookups
    eng.store(prompt, torch.randperm(SLOTS)[:16])
    assert eng.lookup(prompt, "again") == 16
    assert "again" in eng.pins and eng.clear() == 0
    # The same id asked again, for a prompt now missing: the earlier pins go.
    assert eng.lookup(tokens(16, 9), "again") == 0
    assert "again" not in eng.pins
    assert eng.clear() == 2


def test_clear_by_tokens_and_by_tier(cpu_engine) -> None:
    eng, _, _ = cpu_engine
    a, b = tokens(16, 1), tokens(16, 2)
    eng.store(a, torch.randperm(SLOTS)[:16])
    eng.store(b, torch.randperm(SLOTS)[:16])
    assert eng.clear(a) == 2
    assert eng.lookup(a) == 0 and eng.lookup(b) == 16
    assert eng.clear(tier="l1") == 2
    assert eng.lookup(b) == 0
    assert eng.pool.used_bytes == 0
    with pytest.raises(KeyError, match="no tier named 'disk'"):
        eng.storage.tier("disk")


def test_freeze_skips_stores_but_serves_hits(cpu_engine) -> None:
    eng, _, _ = cpu_engine
    a, b = tokens(16, 1), tokens(16, 2)
    eng.store(a, torch.randperm(SLOTS)[:16])
    eng.freeze()
    assert eng.frozen
    assert eng.store(b, torch.randperm(SLOTS)[:16]) == 0
    assert drain(eng.store_layer(b, torch.randperm(SLOTS)[:16])) == 0
    assert eng.lookup(a) == 16 and eng.lookup(b) == 0
    assert eng.stats.stores_skipped._value.get() == 2
    eng.freeze(False)
    assert eng.store(b, torch.randperm(SLOTS)[:16]) == 16


def test_abandoned_layerwise_store_returns_its_pages(cpu_engine) -> None:
    eng, _, _ = cpu_engine
    gen = eng.store_layer(tokens(16), torch.randperm(SLOTS)[:16])
    next(gen)
    assert eng.pool.used_bytes > 0  # buffers taken for the chunks in flight
    gen.close()
    assert eng.pool.used_bytes == 0
    assert eng.lookup(tokens(16)) == 0


def test_metrics_and_events(cpu_engine) -> None:
    eng, _, _ = cpu_engine
    prompt = tokens(20)
    eng.store(prompt, torch.randperm(SLOTS)[:20])
    eng.lookup(prompt)
    eng.retrieve(prompt, torch.randperm(SLOTS)[:20])
    eng.clear(prompt)
    text = eng.stats.metrics.render().decode()
    for line in (
        'kvmesh_requests_total{instance="t",op="store",rank="0"} 1.0',
        'kvmesh_tokens_stored_total{instance="t",rank="0"} 16.0',
        'kvmesh_tokens_hit_total{instance="t",rank="0",tier="l1"} 16.0',
        'kvmesh_hit_rate{instance="t",rank="0",tier="l1"} 0.8',
        'kvmesh_l1_usage_bytes{instance="t",rank="0"} 0.0',
    ):
        assert line in text, line
    assert "kvmesh_op_latency_seconds_bucket" in text
    events = eng.events.drain()
    kinds = [(e.kind, e.tier) for e in events]
    assert kinds == [(KVEventKind.STORED, "l1")] * 2 + [(KVEventKind.REMOVED, "l1")] * 2
    assert events[0].key == eng.chunks(prompt)[0][2].to_str()


class MemoryTier:
    """A lower tier in this process's memory (the real ones come with the disk and
    remote tiers); it counts its calls so the tests can see the waterfall."""

    name = "mem"

    def __init__(self, fail: bool = False) -> None:
        self.data: dict[ChunkKey, torch.Tensor] = {}
        self.fail = fail
        self.gets = 0

    def contains(self, key, pin=False):
        return key in self.data

    def batched_contains(self, keys, pin=False):
        if self.fail:
            raise ConnectionError("tier down")
        n = 0
        for k in keys:
            if k not in self.data:
                break
            n += 1
        return n

    def submit_put(self, key, obj: MemoryObj):
        self.data[key] = obj.tensor.clone()

    def get(self, key, allocator):
        self.gets += 1
        if self.fail:
            raise ConnectionError("tier down")
        t = self.data.get(key)
        if t is None:
            return None
        obj = allocator.allocate(t.shape, t.dtype, None)
        obj.tensor.copy_(t)
        return obj

    async def aget(self, key, allocator):
        return self.get(key, allocator)

    def remove(self, key):
        return self.data.pop(key, None) is not None

    def clear(self):
        n = len(self.data)
        self.data.clear()
        return n

    def pin(self, key):
        return key in self.data

    def unpin(self, key):
        return key in self.data

    def touch(self, key):
        pass

    def flush(self, timeout=None):
        return True

    def close(self):
        self.data.clear()


def test_lower_tier_hit_is_promoted_to_l1_and_loads_exactly() -> None:
    view, layers, kind = make_cache("cpu", torch.float32, True, blocks=BLOCKS, block_size=BLOCK)
    mem = MemoryTier()
    eng = engine_for(view, lower_tiers=[mem])
    try:
        prompt = tokens(24)
        src_slots = torch.randperm(SLOTS)[:24]
        src = slot_tokens(layers, kind)[:, src_slots].clone()
        assert eng.store(prompt, src_slots) == 24
        assert len(mem.data) == 3  # write-all
        eng.clear(tier="l1")
        assert eng.lookup(prompt) == 24  # counted from the lower tier
        assert eng.stats.hit_rate["mem"]._value.get() > 0

        dst = torch.randperm(SLOTS)[:24]
        assert eng.retrieve(prompt, dst).all()
        assert torch.equal(bits(slot_tokens(layers, kind)[:, dst]), bits(src))
        assert mem.gets == 3
        assert len(eng.storage.l1) == 3  # promoted
        assert eng.retrieve(prompt, dst).all()
        assert mem.gets == 3  # second load served by L1
        text = eng.stats.metrics.render().decode()
        assert 'tokens_hit_total{instance="t",rank="0",tier="mem"} 24.0' in text
        assert 'tokens_hit_total{instance="t",rank="0",tier="l1"} 24.0' in text
        # The L1 gauges count the promoted chunks, though no store passed since the
        # clear that emptied L1.
        assert 'l1_chunks{instance="t",rank="0"} 3.0' in text
        assert f'l1_usage_bytes{{instance="t",rank="0"}} {float(eng.pool.used_bytes)}' in text
        assert eng.pool.used_bytes > 0
    finally:
        eng.close()


def test_failing_lower_tier_is_a_miss() -> None:
    view, _, _ = make_cache("cpu", torch.float16, True, blocks=BLOCKS, block_size=BLOCK)
    mem = MemoryTier()
    eng = engine_for(view, lower_tiers=[mem])
    try:
        prompt = tokens(24)
        eng.store(prompt, torch.randperm(SLOTS)[:24])
        eng.clear(tier="l1")
        mem.fail = True
        assert eng.lookup(prompt) == 0
        assert not eng.retrieve(prompt, torch.randperm(SLOTS)[:24]).any()
    finally:
        eng.close()


def test_prefetch_pulls_into_l1_and_pins_until_retrieve() -> None:
    view, _, _ = make_cache("cpu", torch.float16, True, blocks=BLOCKS, block_size=BLOCK)
    mem = MemoryTier()
    eng = engine_for(view, lower_tiers=[mem])
    try:
        prompt = tokens(24)
        eng.store(prompt, torch.randperm(SLOTS)[:24])
        eng.clear(tier="l1")
        assert eng.prefetch(prompt, "pf").result(timeout=5) == 24
        assert len(eng.storage.l1) == 3
        assert eng.clear(tier="l1") == 0  # pinned for the request
        gets = mem.gets
        assert eng.retrieve(prompt, torch.randperm(SLOTS)[:24], lookup_id="pf").all()
        assert mem.gets == gets
        assert eng.clear(tier="l1") == 3  # the retrieve released the pins

        # A prefetched request that never arrives is cleaned up.
        eng.prefetch(prompt, "lost").result(timeout=5)
        eng.release_lookup("lost")
        assert eng.clear(tier="l1") == 3
    finally:
        eng.close()


def test_builder_returns_the_same_engine_and_rejects_other_configs() -> None:
    view, _, _ = make_cache("cpu", torch.float16, True, blocks=BLOCKS, block_size=BLOCK)
    eng = get_or_create_engine("b", 0, config(), view)
    try:
        assert get_or_create_engine("b", 0, config(), view) is eng
        assert get_engine("b", 0) is eng
        with pytest.raises(EngineConfigMismatch, match="b/0"):
            get_or_create_engine("b", 0, config(chunk_size=16), view)
        other = get_or_create_engine("b", 1, config(), view, world_size=2)
        assert other is not eng
        assert destroy_engine("b", 1)
    finally:
        assert destroy_engine("b", 0)
    assert get_engine("b", 0) is None
    assert not destroy_engine("b", 0)
    assert eng.pool.closed
    with pytest.raises(RuntimeError, match="closed"):
        eng.lookup(tokens(8))


def test_close_releases_threads_and_memory() -> None:
    before = {t.name for t in threading.enumerate()}
    view, _, _ = make_cache("cpu", torch.float16, True, blocks=BLOCKS, block_size=BLOCK)
    eng = engine_for(view)
    eng.store(tokens(16), torch.randperm(SLOTS)[:16])
    eng.lookup(tokens(16), "held")
    assert any(t.name.startswith("kvmesh-engine-t-0") for t in threading.enumerate())
    eng.close()
    eng.close()  # idempotent
    time.sleep(0.1)
    assert {t.name for t in threading.enumerate()} <= before
    assert eng.pool.closed


class SlowTier(MemoryTier):
    """A MemoryTier whose gets take `delay` seconds on the loop, and whose unpin can
    fail as a plugin tier's would when its backend is down."""

    def __init__(self, delay: float = 0.0) -> None:
        super().__init__()
        self.delay = delay
        self.fail_unpin = False

    async def aget(self, key, allocator):
        await asyncio.sleep(self.delay)
        return self.get(key, allocator)

    def unpin(self, key):
        if self.fail_unpin:
            raise ConnectionError("backend down")
        return key in self.data


def test_cancelled_prefetch_returns_its_l1_references() -> None:
    view, _, _ = make_cache("cpu", torch.float16, True, blocks=BLOCKS, block_size=BLOCK)
    mem = SlowTier(delay=0.5)
    eng = engine_for(view, lower_tiers=[mem])
    try:
        prompt = tokens(24)
        eng.store(prompt, torch.randperm(SLOTS)[:24])
        keys = [k for _, _, k in eng.chunks(prompt)]
        for k in keys[1:]:  # chunk 0 in L1, the rest only in the slow tier
            eng.storage.remove(k, "l1")
        first = eng.storage.l1._objs[keys[0]]
        fut = eng.prefetch(prompt, "pf")
        time.sleep(0.1)  # the prefetch now waits on the slow tier
        eng.release_lookup("pf")
        time.sleep(0.6)
        assert fut.cancelled()
        assert first.ref_count == 1  # L1's own reference only
        assert eng.clear(tier="l1") == 1
        assert eng.pool.used_pages == 0
    finally:
        eng.close()


def test_failed_waterfall_get_returns_its_l1_references() -> None:
    view, _, _ = make_cache("cpu", torch.float16, True, blocks=BLOCKS, block_size=BLOCK)
    eng = engine_for(view, lower_tiers=[MemoryTier()])
    try:
        prompt = tokens(24)
        eng.store(prompt, torch.randperm(SLOTS)[:24])
        keys = [k for _, _, k in eng.chunks(prompt)]
        eng.storage.remove(keys[2], "l1")
        eng.loop.stop()  # the lower-tier part raises: the loop is gone
        with pytest.raises(RuntimeError, match="event loop is stopped"):
            eng.retrieve(prompt, torch.randperm(SLOTS)[:24])
        assert [eng.storage.l1._objs[k].ref_count for k in keys[:2]] == [1, 1]
        assert eng.clear(tier="l1") == 2
        assert eng.pool.used_pages == 0
    finally:
        eng.close()


def test_a_failing_tier_unpin_releases_the_other_pins() -> None:
    view, _, _ = make_cache("cpu", torch.float16, True, blocks=BLOCKS, block_size=BLOCK)
    mem = SlowTier()
    eng = engine_for(view, lower_tiers=[mem])
    try:
        prompt = tokens(24)
        eng.store(prompt, torch.randperm(SLOTS)[:24])
        keys = [k for _, _, k in eng.chunks(prompt)]
        assert eng.storage.l1.pin(keys[0])
        mem.fail_unpin = True
        eng.storage.unpin([(mem, keys[1]), (eng.storage.l1, keys[0])])  # no raise
        assert eng.storage.l1._objs[keys[0]].pin_count == 0

        # A retrieve whose lookup pinned in the failing tier still loads.
        eng.storage.remove(keys[2], "l1")
        assert eng.lookup(prompt, "req") == 24
        assert eng.retrieve(prompt, torch.randperm(SLOTS)[:24], lookup_id="req").all()
        assert len(eng.pins) == 0
        assert eng.clear(tier="l1") == 3
    finally:
        eng.close()


def test_pin_expiry_outlives_a_failing_pass(monkeypatch) -> None:
    view, _, _ = make_cache("cpu", torch.float16, True, blocks=BLOCKS, block_size=BLOCK)
    eng = engine_for(view, config(pin_timeout_s=0.2))
    try:
        expire = eng.pins.expire
        failed = threading.Event()

        def expire_once_failing() -> None:
            if not failed.is_set():
                failed.set()
                raise RuntimeError("a bad pass")
            expire()

        monkeypatch.setattr(eng.pins, "expire", expire_once_failing)
        assert failed.wait(3)
        prompt = tokens(16)
        eng.store(prompt, torch.randperm(SLOTS)[:16])
        assert eng.lookup(prompt, "gone") == 16
        assert _clear_once_expired(eng) == 2
        assert len(eng.pins) == 0
    finally:
        eng.close()


def test_layerwise_store_larger_than_l1_does_not_wait_for_its_own_pages() -> None:
    view, _, _ = make_cache("cpu", torch.float16, True, blocks=BLOCKS, block_size=BLOCK)
    cfg = small_l1(6, view)
    cfg = config(l1=L1Config(max_size=cfg.l1.max_size, reserve=0, alloc_timeout_s=2.0))
    eng = engine_for(view, cfg)
    try:
        assert eng.pool.num_pages == 6
        prompt = tokens(64, 3)  # 8 chunks for 6 pages
        gen = eng.store_layer(prompt, torch.randperm(SLOTS)[:64])
        started = time.monotonic()
        next(gen)  # the first layer: vLLM's forward pass waits on it
        assert time.monotonic() - started < 1.0
        assert drain(gen) == 48  # truncated to what L1 could hand out
        assert eng.stats.alloc_failures._value.get() == 1
    finally:
        gen.close()
        eng.close()


@pytest.mark.parametrize("call", ["store", "retrieve", "store_layer", "retrieve_layer"])
def test_a_slot_mapping_shorter_than_the_tokens_is_refused(cpu_engine, call: str) -> None:
    eng, _, _ = cpu_engine
    prompt = tokens(16)
    eng.store(prompt, torch.randperm(SLOTS)[:16])
    used = eng.pool.used_pages
    with pytest.raises(ValueError, match="12 slots for 16 tokens"):
        getattr(eng, call)(prompt if "retrieve" in call else tokens(16, 9), torch.arange(12))
    assert eng.pool.used_pages == used
    assert len(eng.storage.l1) == 2

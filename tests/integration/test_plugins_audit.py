"""Plugins that break their contract (docs/plugins.md), run by real engines: each is a
PluginError naming it at startup, or, for what only shows at run time, a miss within
the load deadline; never a crashed lookup or retrieve, a hung prefetch, a leaked L1
page or wrong KV.

The plugins are a real package written to a temporary directory on sys.path, with
its own dist-info, so one of them is found through a `kvmesh.tiers` entry point the
way an installed third-party package is."""

from __future__ import annotations

import importlib
import sys
import textwrap
import time
from collections.abc import Iterator
from importlib.metadata import entry_points
from pathlib import Path

import pytest
import torch
from kvtest.paged import bits, make_cache, slot_tokens

from kvmesh.common.config import EngineConfig, L1Config, RemoteConfig, TierPluginConfig
from kvmesh.common.plugins import PluginError
from kvmesh.services.worker.engine import KVEngine

BLOCKS = 64
PROMPT = list(range(900, 964))  # 8 chunks of 8
PKG = "kvmesh_audit_plugin"

SOURCE = '''
"""Tiers and a connector that each break one rule of the plugin contract."""
import asyncio
import threading

import numpy

from kvmesh.common.memory import HostMemoryPool
from kvmesh_example_plugin.connector import MemKvConnector
from kvmesh_example_plugin.tier import MemDictTier

CLOSED = []  # names of tiers whose close() ran


class Tier(MemDictTier):
    def close(self):
        CLOSED.append(self.name)
        super().close()


class PlainAget(Tier):
    def aget(self, key, allocator):  # not async def: the engine awaits it
        return self.get(key, allocator)


class AsyncContains(Tier):
    async def batched_contains(self, keys, pin=False):
        return super().batched_contains(keys, pin)


class AsyncGet(Tier):
    async def get(self, key, allocator):
        return super().get(key, allocator)


class NotAChunk(Tier):
    async def aget(self, key, allocator):
        obj = await asyncio.to_thread(self.get, key, allocator)
        if obj is not None:
            obj.ref_down()
            return bytes(obj.nbytes) if self.name == "bytes" else obj  # else: freed
        return None


class Overcount(Tier):
    def batched_contains(self, keys, pin=False):
        n = super().batched_contains(keys, pin)
        return n + 3 if n else 0


class NumpyCount(Tier):
    """Counts with numpy (a vectorised membership test): an integer, not an int."""

    def batched_contains(self, keys, pin=False):
        return numpy.int64(super().batched_contains(keys, pin))


class NeverAnswers(Tier):
    async def aget(self, key, allocator):
        self.gets += 1
        await asyncio.Event().wait()


class OwnPool(Tier):
    """Reads into a pool of its own instead of the allocator it is given."""

    def __init__(self, context):
        super().__init__(context)
        self.pool = HostMemoryPool(64 * context.chunk_bytes, context.chunk_bytes)

    async def aget(self, key, allocator):
        return self.get(key, self.pool)


class StuckOnce(Tier):
    """Its first lookup blocks until RELEASE is set (a plugin stuck on a lock, say)."""

    release = threading.Event()

    def __init__(self, context):
        super().__init__(context)
        self.lookups = self.answered = 0

    def batched_contains(self, keys, pin=False):
        self.lookups += 1
        if self.lookups == 1:
            self.release.wait(60)
        try:
            return super().batched_contains(keys, pin)
        finally:
            self.answered += 1


class PlainGetConnector(MemKvConnector):
    def get(self, key):  # not async def: the remote tier awaits it
        return None


def make(cls):
    return lambda context: cls(context)


plain_aget = make(PlainAget)
async_contains = make(AsyncContains)
async_get = make(AsyncGet)
not_a_chunk = make(NotAChunk)
overcount = make(Overcount)
numpy_count = make(NumpyCount)
never_answers = make(NeverAnswers)
own_pool = make(OwnPool)
stuck_once = make(StuckOnce)


def plain_get_connector(url, *, key_prefix, timeout_s):
    return PlainGetConnector(url, key_prefix=key_prefix, timeout_s=timeout_s)
'''


@pytest.fixture(scope="module")
def plugin_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    root = tmp_path_factory.mktemp("audit-plugins")
    (root / PKG).mkdir()
    (root / PKG / "__init__.py").write_text(textwrap.dedent(SOURCE))
    info = root / "kvmesh_audit_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: kvmesh-audit-plugin\nVersion: 0.1\n"
    )
    (info / "entry_points.txt").write_text(f"[kvmesh.tiers]\naudit-plain-aget = {PKG}:plain_aget\n")
    sys.path.insert(0, str(root))
    importlib.invalidate_caches()
    try:
        yield root
    finally:
        sys.path.remove(str(root))
        sys.modules.pop(PKG, None)
        importlib.invalidate_caches()


def config(spec: str, name: str = "t", **engine: object) -> EngineConfig:
    return EngineConfig(
        chunk_size=8,
        model_name="plugin-audit",
        l1=L1Config(max_size=8 << 20, reserve=0, alloc_timeout_s=0.2),
        tiers=[TierPluginConfig(plugin=spec, name=name)],
        **engine,
    )


def misses(eng: KVEngine, tier: str, reason: str) -> float:
    return eng.stats.metrics.value("chunk_misses_total", {"tier": tier, "reason": reason})


def test_the_entry_point_of_the_temporary_package_is_found(plugin_dir: Path) -> None:
    found = {ep.name: ep.value for ep in entry_points(group="kvmesh.tiers")}
    assert found["audit-plain-aget"] == f"{PKG}:plain_aget"


@pytest.mark.parametrize(
    "spec,expected",
    [
        # Found by its entry point. Before the check it loaded, and every get it answered
        # raised TypeError in the engine's await, leaking the L1 page it had filled.
        ("audit-plain-aget", r"'audit-plain-aget' returned a PlainAget .*aget is not async def"),
        # Before: every lookup reaching it raised TypeError (int += coroutine).
        (f"{PKG}:async_contains", r"AsyncContains .*: batched_contains is async def"),
        (f"{PKG}:async_get", r"returned a AsyncGet that breaks the Tier protocol: get is async"),
    ],
)
def test_a_tier_with_a_method_of_the_wrong_kind_is_refused_at_startup_and_closed(
    plugin_dir: Path, spec: str, expected: str
) -> None:
    closed = importlib.import_module(PKG).CLOSED
    closed.clear()
    view, _, _ = make_cache("cpu", torch.bfloat16, False, blocks=BLOCKS)
    with pytest.raises(PluginError, match=expected):
        KVEngine("audit-kind", 0, config(spec, name="refused"), view)
    assert closed == ["refused"]  # the tier it built was let go of


@pytest.mark.parametrize("name", ["bytes", "freed"])
def test_a_tier_get_that_answers_no_usable_chunk_is_a_miss(plugin_dir: Path, name: str) -> None:
    """Its aget gives back bytes, or a chunk whose page it already released: before the
    fix the retrieve raised (AttributeError / MemoryObjFreedError) out of the engine."""
    view, layers, kind = make_cache("cpu", torch.bfloat16, True, blocks=BLOCKS)
    eng = KVEngine("audit-chunk", 0, config(f"{PKG}:not_a_chunk", name=name), view)
    try:
        slots = torch.arange(64)
        assert eng.store(PROMPT, slots) == 64
        eng.clear(tier="l1")
        assert eng.lookup(PROMPT) == 64  # the tier says it holds them
        for t in layers:
            t.zero_()
        loaded = eng.retrieve(PROMPT, slots)
        assert not bool(loaded.any())  # a miss from the first chunk: recomputed
        assert misses(eng, name, "error") == 8
        assert not bool(slot_tokens(layers, kind)[:, slots].any())  # nothing written
        eng.clear(tier="l1")
        assert eng.pool.used_pages == 0  # no page kept by the failed gets
    finally:
        eng.close()


def test_a_tier_chunk_from_outside_l1s_pool_is_a_miss_and_l1_keeps_to_its_size(
    plugin_dir: Path,
) -> None:
    """Before the fix L1 took in every such chunk: 48 chunks held in a pool of 16 pages,
    with `used_bytes` 0, since none of them was L1's."""
    view, _, _ = make_cache("cpu", torch.bfloat16, True, blocks=BLOCKS)
    cfg = config(f"{PKG}:own_pool")
    cfg = EngineConfig(
        chunk_size=8,
        model_name="plugin-audit",
        l1=L1Config(max_size=16 * 4096, reserve=0, alloc_timeout_s=0.1),
        tiers=cfg.tiers,
    )
    eng = KVEngine("audit-pool", 0, cfg, view)
    try:
        tier, l1 = eng.storage.tier("t"), eng.storage.l1
        assert eng.pool.num_pages == 16
        prompts = [list(range(i * 1000, i * 1000 + 64)) for i in range(6)]
        for p in prompts:
            assert eng.store(p, torch.arange(64)) == 64
        eng.clear(tier="l1")
        for p in prompts:
            assert not bool(eng.retrieve(p, torch.arange(64)).any())
        assert len(l1) == 0 and eng.pool.used_pages == 0
        assert misses(eng, "t", "error") == 48  # every chunk is asked for at once
        assert tier.pool.used_pages == 0  # each page went back to the plugin's pool
    finally:
        eng.close()


def test_a_tier_that_counts_more_chunks_than_asked_is_a_lookup_miss(plugin_dir: Path) -> None:
    """Before the fix the lookup raised IndexError (it counted 11 chunks of 8)."""
    view, layers, kind = make_cache("cpu", torch.bfloat16, True, blocks=BLOCKS)
    eng = KVEngine("audit-count", 0, config(f"{PKG}:overcount"), view)
    try:
        slots = torch.randperm(BLOCKS * 4)[:64]
        want = slot_tokens(layers, kind)[:, slots].clone()
        assert eng.store(PROMPT, slots) == 64
        assert eng.lookup(PROMPT) == 64  # L1 answers first: the tier is not asked
        eng.clear(tier="l1")
        assert eng.lookup(PROMPT) == 0  # the tier's answer is refused, not believed
        # Asked to pin, it pinned what it holds before claiming more: a refused claim
        # is unpinned, or those chunks would stay pinned in the tier for good.
        assert eng.lookup(PROMPT, "audit-pinned") == 0
        eng.release_lookup("audit-pinned")
        assert eng.storage.tier("t")._pinned == set()
        # Its gets are still good: the chunks load, exactly.
        for t in layers:
            t.zero_()
        assert bool(eng.retrieve(PROMPT, slots).all())
        assert torch.equal(bits(slot_tokens(layers, kind)[:, slots]), bits(want))
    finally:
        eng.close()


def test_a_tier_whose_get_never_answers_lets_a_prefetch_end_at_the_deadline(
    plugin_dir: Path,
) -> None:
    """Before the fix the prefetch (no deadline of its own) never ended, each of its
    gets holding one of the engine's I/O slots."""
    view, _, _ = make_cache("cpu", torch.bfloat16, True, blocks=BLOCKS)
    cfg = config(f"{PKG}:never_answers", pin_timeout_s=3.0)
    eng = KVEngine("audit-hang", 0, cfg, view)
    try:
        assert eng.store(PROMPT, torch.arange(64)) == 64
        eng.clear(tier="l1")
        t0 = time.monotonic()
        fut = eng.prefetch(PROMPT, "audit-lookup")
        assert fut.result(timeout=15) == 0  # a miss: nothing prefetched
        took = time.monotonic() - t0
        assert 2.5 < took < 8, took  # pin_timeout_s: its pins would expire then anyway
        assert misses(eng, "t", "timeout") == 8
        assert eng.storage.tier("t").gets == 8
        assert eng.pool.used_pages == 0
    finally:
        eng.close()


def test_a_tier_whose_lookup_hangs_costs_one_deadline_not_the_callers_thread(
    plugin_dir: Path,
) -> None:
    """Before the fix the lookup waited for as long as the plugin did (here: until the
    test let it go), on the caller's (the scheduler's) thread."""
    view, _, _ = make_cache("cpu", torch.bfloat16, True, blocks=BLOCKS)
    eng = KVEngine("audit-stuck", 0, config(f"{PKG}:stuck_once"), view)
    tier = eng.storage.tier("t")
    try:
        assert eng.store(PROMPT, torch.arange(64)) == 64
        eng.clear(tier="l1")
        t0 = time.monotonic()
        assert eng.lookup(PROMPT, "stuck-1") == 0  # gave up on the tier
        assert 4 < time.monotonic() - t0 < 10  # the engine's deadline (5 s)
        t0 = time.monotonic()
        assert eng.lookup(PROMPT, "stuck-2") == 0  # still stuck: left out at once
        assert time.monotonic() - t0 < 0.5 and tier.lookups == 1
        type(tier).release.set()
        deadline = time.monotonic() + 10
        while tier.answered == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)  # the late answer's unpins run just after it
        assert tier._pinned == set()  # what the stuck lookup pinned was let go of
        assert eng.lookup(PROMPT) == 64  # answering again: asked again
        assert bool(eng.retrieve(PROMPT, torch.arange(64)).all())
    finally:
        type(tier).release.set()
        eng.close()


def test_a_connector_with_a_plain_get_is_refused_at_startup(plugin_dir: Path) -> None:
    """Before the check it loaded, and every remote get failed at run time, taking the
    store down and up again."""
    view, _, _ = make_cache("cpu", torch.bfloat16, False, blocks=BLOCKS)
    remote = RemoteConfig(enabled=True, url="memkv://audit", connector=f"{PKG}:plain_get_connector")
    cfg = EngineConfig(
        chunk_size=8,
        model_name="plugin-audit",
        l1=L1Config(max_size=8 << 20, reserve=0),
        remote=remote,
    )
    with pytest.raises(
        PluginError,
        match=r"plain_get_connector' returned a PlainGetConnector .*"
        r"get is not async def",
    ):
        KVEngine("audit-conn", 0, cfg, view)


def test_a_count_of_any_integer_type_is_a_count(plugin_dir: Path) -> None:
    """A numpy integer is a count (operator.index), not a refused answer."""
    view, _, _ = make_cache("cpu", torch.bfloat16, True, blocks=BLOCKS)
    eng = KVEngine("audit-numpy", 0, config(f"{PKG}:numpy_count"), view)
    try:
        assert eng.store(PROMPT, torch.arange(64)) == 64
        eng.clear(tier="l1")
        assert eng.lookup(PROMPT) == 64
    finally:
        eng.close()

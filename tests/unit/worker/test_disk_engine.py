"""KVEngine with `engine.disk` enabled: the tier is built from config, loads come back
from disk bitwise when L1 is empty (and are promoted), a new engine on the same
directory finds the chunks, and closing the engine lets go of the directory."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from kvtest.paged import bits, make_cache, slot_tokens

from kvmesh.common.config import DiskConfig, EngineConfig, L1Config
from kvmesh.services.worker.engine import KVEngine
from kvmesh.services.worker.tiers.disk import DiskTier

CHUNK = 8
BLOCKS, BLOCK = 16, 4
SLOTS = BLOCKS * BLOCK


def config(path: Path, **disk) -> EngineConfig:
    return EngineConfig(
        chunk_size=CHUNK,
        model_name="disk-test",
        l1=L1Config(max_size=8 << 20, reserve=0, alloc_timeout_s=0.2),
        disk=DiskConfig(enabled=True, path=str(path), max_size=64 << 20, **disk),
    )


def tokens(n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, 50_000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def disk_of(eng: KVEngine) -> DiskTier:
    tier = eng.storage.tier("disk")
    assert isinstance(tier, DiskTier)
    return tier


def test_disk_is_off_by_default() -> None:
    view, _, _ = make_cache("cpu", torch.float16, True, blocks=BLOCKS, block_size=BLOCK)
    eng = KVEngine("t", 0, EngineConfig(chunk_size=CHUNK, l1=L1Config(max_size=4 << 20)), view)
    try:
        assert [t.name for t in eng.storage.tiers] == ["l1"]
    finally:
        eng.close()


@pytest.mark.parametrize("spec", ["cpu", "BLNHC-cross", "mla"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_round_trip_from_disk_with_l1_cleared(tmp_path: Path, spec: str, dtype) -> None:
    shape = {"blocks": BLOCKS, "block_size": BLOCK}
    view, layers, kind = make_cache(spec, dtype, True, **shape)
    eng = KVEngine("t", 0, config(tmp_path), view)
    try:
        disk = disk_of(eng)
        assert Path(disk.path) == tmp_path / eng.namespace.ns_id
        prompt = tokens(30)
        src_slots = torch.randperm(SLOTS)[:30]
        src = slot_tokens(layers, kind)[:, src_slots[:24]].clone()
        assert eng.store(prompt, src_slots) == 24
        assert disk.flush(5) and len(disk) == 3  # write-all
        assert eng.clear(tier="l1") == 3
        assert len(eng.storage.l1) == 0
        assert eng.lookup(prompt) == 24  # counted from disk
        assert eng.stats.hit_rate["disk"]._value.get() > 0

        dst_view, dst_layers, _ = make_cache(spec, dtype, False, **shape)
        eng.register_kv_caches(dst_view)
        dst_slots = torch.randperm(SLOTS)[:30]
        loaded = eng.retrieve(prompt, dst_slots)
        assert loaded.tolist() == [True] * 24 + [False] * 6
        dst = slot_tokens(dst_layers, kind)
        assert torch.equal(bits(dst[:, dst_slots[:24]]), bits(src))
        assert len(eng.storage.l1) == 3  # promoted
        text = eng.stats.metrics.render().decode()
        assert 'kvmesh_tokens_hit_total{instance="t",rank="0",tier="disk"} 24.0' in text
        assert 'kvmesh_disk_gets_total{instance="t",rank="0",result="hit"} 3.0' in text
    finally:
        eng.close()


def test_new_engine_on_the_same_directory_finds_the_chunks(tmp_path: Path) -> None:
    view, layers, kind = make_cache("cpu", torch.bfloat16, True, blocks=BLOCKS, block_size=BLOCK)
    prompt = tokens(40, seed=3)
    src_slots = torch.randperm(SLOTS)[:40]
    src = slot_tokens(layers, kind)[:, src_slots].clone()
    first = KVEngine("a", 0, config(tmp_path), view)
    try:
        assert first.store(prompt, src_slots) == 40
        disk_of(first).flush(5)
    finally:
        first.close()

    dst_view, dst_layers, _ = make_cache(
        "cpu", torch.bfloat16, False, blocks=BLOCKS, block_size=BLOCK
    )
    second = KVEngine("b", 0, config(tmp_path), dst_view)
    try:
        assert disk_of(second).wait_indexed(10)
        assert len(second.storage.l1) == 0 and len(disk_of(second)) == 5
        # Its re-index leaves out files claiming more than a page (test_disk_tier).
        assert disk_of(second).max_chunk_bytes == second.pool.page_size
        assert second.lookup(prompt, "r") == 40
        dst_slots = torch.randperm(SLOTS)[:40]
        assert second.retrieve(prompt, dst_slots, lookup_id="r").all()
        assert torch.equal(bits(slot_tokens(dst_layers, kind)[:, dst_slots]), bits(src))
    finally:
        second.close()


def test_close_lets_queued_puts_finish(tmp_path: Path) -> None:
    """No flush before close: engine.close_flush_s keeps what was stored just before a
    shutdown (one IO thread and 16 chunks, so puts are still queued at close)."""
    view, _, _ = make_cache("cpu", torch.float16, True, blocks=BLOCKS, block_size=BLOCK)
    cfg = config(tmp_path, io_threads=1)
    first = KVEngine("a", 0, cfg, view)
    prompts = [tokens(64, seed=s) for s in range(2)]
    try:
        for p in prompts:
            assert first.store(p, torch.arange(64)) == 64
    finally:
        first.close()
    second = KVEngine("b", 0, cfg, view)
    try:
        assert disk_of(second).wait_indexed(10)
        assert len(disk_of(second)) == 16
        assert all(second.lookup(p) == 64 for p in prompts)
    finally:
        second.close()


def test_disk_sits_between_l1_and_passed_lower_tiers_and_close_closes_it(tmp_path: Path) -> None:
    from test_engine import MemoryTier  # the in-memory lower tier of the engine tests

    view, _, _ = make_cache("cpu", torch.float16, True, blocks=BLOCKS, block_size=BLOCK)
    mem = MemoryTier()
    eng = KVEngine("t", 0, config(tmp_path), view, lower_tiers=[mem])
    assert [t.name for t in eng.storage.tiers] == ["l1", "disk", "mem"]
    eng.store(tokens(16), torch.randperm(SLOTS)[:16])
    disk = disk_of(eng)
    disk.flush(5)
    assert len(mem.data) == 2 and len(disk) == 2
    eng.close()
    # The directory lock went with it: a new tier takes the directory at once.
    again = DiskTier(disk.path, 64 << 20)
    try:
        assert again.degraded is None and again.wait_indexed(5) and len(again) == 2
    finally:
        again.close()


def test_pinned_lookup_pins_disk_chunks_until_retrieve(tmp_path: Path) -> None:
    view, _, _ = make_cache("cpu", torch.float16, True, blocks=BLOCKS, block_size=BLOCK)
    eng = KVEngine("t", 0, config(tmp_path), view)
    try:
        prompt = tokens(16)
        eng.store(prompt, torch.randperm(SLOTS)[:16])
        disk = disk_of(eng)
        disk.flush(5)
        eng.clear(tier="l1")
        assert eng.lookup(prompt, "req") == 16
        assert eng.clear(tier="disk") == 0  # pinned by the lookup
        assert eng.retrieve(prompt, torch.randperm(SLOTS)[:16], lookup_id="req").all()
        assert eng.clear(tier="disk") == 2
    finally:
        eng.close()

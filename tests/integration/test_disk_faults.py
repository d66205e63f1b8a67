"""The disk tier on a real full, read-only or vanished filesystem, through KVEngine: the
tier logs once and degrades, every request still succeeds from L1 (and, read-only,
from the files already on disk), and it recovers once the disk does.

Full and read-only use a size-limited tmpfs mounted for the test, which needs root (CI
runs as root); without it these tests fail rather than skip.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from kvtest.disk import mount, tmpfs
from kvtest.paged import bits, make_cache, slot_tokens

from kvmesh.common.config import DiskConfig, EngineConfig, L1Config
from kvmesh.services.worker.engine import KVEngine
from kvmesh.services.worker.tiers.disk import DiskTier

CHUNK = 8
BLOCKS, BLOCK = 64, 4
SLOTS = BLOCKS * BLOCK
RETRY_S = 0.3


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs, unmounted after the test."""
    with tmpfs(tmp_path / "fs", "1m") as where:
        yield where


def engine_on(path: Path, view) -> KVEngine:
    cfg = EngineConfig(
        chunk_size=CHUNK,
        model_name="disk-faults",
        l1=L1Config(max_size=16 << 20, reserve=0, alloc_timeout_s=0.2),
        disk=DiskConfig(enabled=True, path=str(path), max_size=64 << 20, retry_s=RETRY_S),
    )
    return KVEngine("t", 0, cfg, view)


def disk_of(eng: KVEngine) -> DiskTier:
    tier = eng.storage.tier("disk")
    assert isinstance(tier, DiskTier)
    tier.flush(10)
    return tier


def prompt(seed: int, n: int = 40) -> list[int]:
    return torch.randint(0, 50_000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def store_and_load(eng: KVEngine, layers, kind, seed: int) -> torch.Tensor:
    """Store a 5-chunk prompt and load it back exactly (the request path must work);
    the KV stored."""
    tokens = prompt(seed)
    src_slots = torch.randperm(SLOTS)[:40]
    before = slot_tokens(layers, kind)[:, src_slots].clone()
    assert eng.store(tokens, src_slots) == 40
    assert eng.lookup(tokens, f"req-{seed}") == 40
    dst_slots = torch.randperm(SLOTS)[:40]
    assert eng.retrieve(tokens, dst_slots, lookup_id=f"req-{seed}").all()
    assert torch.equal(bits(slot_tokens(layers, kind)[:, dst_slots]), bits(before))
    return before


def degraded_gauge(eng: KVEngine) -> float:
    return eng.stats.metrics.value("disk_degraded") or 0.0


def wait_retry() -> None:
    time.sleep(RETRY_S + 0.1)


def test_full_filesystem_degrades_without_failing_a_request(
    small_fs: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    view, layers, kind = make_cache("cpu", torch.float16, True, blocks=BLOCKS, block_size=BLOCK)
    eng = engine_on(small_fs, view)
    try:
        disk = disk_of(eng)
        # Leave room for about two chunk files (8 KiB each on tmpfs) on the 1 MiB fs.
        filler = small_fs / "filler"
        with open(filler, "wb") as f:
            f.write(b"\0" * (1024 * 1024 - 20 * 1024))
        for seed in range(4):
            store_and_load(eng, layers, kind, seed)
            disk_of(eng)
        assert disk.degraded is not None and "ENOSPC" in disk.degraded
        assert degraded_gauge(eng) == 1
        assert 0 < len(disk) < 20  # some chunks fit before the disk filled
        assert eng.stats.metrics.value("disk_puts_total", {"result": "degraded"}) > 0
        assert capsys.readouterr().out.count("disk tier degraded") == 1  # logged once
        assert not [n for n in os.listdir(disk.path) if n.endswith(".tmp")]

        # Space comes back; after retry_s the next put probes, succeeds, and the tier
        # takes puts again.
        filler.unlink()
        wait_retry()
        store_and_load(eng, layers, kind, 10)
        disk_of(eng)
        store_and_load(eng, layers, kind, 11)
        disk_of(eng)
        assert disk.degraded is None and degraded_gauge(eng) == 0
        assert "disk tier recovered" in capsys.readouterr().out
        eng.clear(tier="l1")
        assert eng.lookup(prompt(11)) == 40  # from disk
    finally:
        eng.close()


def test_read_only_filesystem_still_serves_what_is_on_disk(small_fs: Path) -> None:
    view, layers, kind = make_cache("cpu", torch.float16, True, blocks=BLOCKS, block_size=BLOCK)
    eng = engine_on(small_fs, view)
    try:
        first = store_and_load(eng, layers, kind, 1)
        disk = disk_of(eng)
        assert len(disk) == 5
        mount("-o", "remount,ro", str(small_fs))
        store_and_load(eng, layers, kind, 2)  # its disk puts fail: EROFS
        disk_of(eng)
        assert disk.degraded is not None and "EROFS" in disk.degraded
        assert len(disk) == 5

        # L1 cleared: the first prompt comes back from the read-only disk, exactly.
        eng.clear(tier="l1")
        dst = torch.randperm(SLOTS)[:40]
        assert eng.retrieve(prompt(1), dst).all()
        assert torch.equal(bits(slot_tokens(layers, kind)[:, dst]), bits(first))
        assert eng.stats.tokens_hit["disk"]._value.get() == 40

        mount("-o", "remount,rw", str(small_fs))
        wait_retry()
        store_and_load(eng, layers, kind, 3)
        disk_of(eng)
        assert disk.degraded is None
    finally:
        eng.close()


def test_vanished_directory_degrades_and_recovers(tmp_path: Path) -> None:
    view, layers, kind = make_cache("cpu", torch.float16, True, blocks=BLOCKS, block_size=BLOCK)
    eng = engine_on(tmp_path / "cache", view)
    try:
        store_and_load(eng, layers, kind, 1)
        disk = disk_of(eng)
        shutil.rmtree(tmp_path / "cache")
        store_and_load(eng, layers, kind, 2)
        disk_of(eng)
        assert disk.degraded == "directory vanished" and len(disk) == 0
        tokens = prompt(1)
        assert eng.lookup(tokens) == 40  # still served, from L1
        assert eng.retrieve(tokens, torch.randperm(SLOTS)[:40]).all()
        wait_retry()
        store_and_load(eng, layers, kind, 3)  # its first chunk is the probe
        disk_of(eng)
        assert disk.degraded is None and Path(disk.path).is_dir()
        store_and_load(eng, layers, kind, 4)
        disk_of(eng)
        eng.clear(tier="l1")
        assert eng.lookup(prompt(4)) == 40  # from the recreated directory
    finally:
        eng.close()


def test_unusable_directory_at_start_does_not_stop_the_engine(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("a file where the cache directory should be")
    view, layers, kind = make_cache("cpu", torch.float16, True, blocks=BLOCKS, block_size=BLOCK)
    eng = engine_on(blocker, view)
    try:
        disk = disk_of(eng)
        assert disk.degraded is not None
        store_and_load(eng, layers, kind, 1)
        assert len(disk) == 0
    finally:
        eng.close()

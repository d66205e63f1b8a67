"""The disk tier with a codec: lossless files read back bit for bit, cachegen files
within its error, both smaller than the chunk, after a restart too (the file names its
codec, whatever the new tier is configured with); a damaged compressed file is a miss
and is deleted, never wrong bytes."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from kvtest.disk import MiB, key_of

from kvmesh.common.chunk_codec import FILE_LAYOUT, Codec
from kvmesh.common.codecs import CacheGenCodec, Lz4Codec, ZstdCodec
from kvmesh.common.memory import HostMemoryPool, MemoryFormat, MemoryObj
from kvmesh.services.worker.tiers.disk import DiskTier
from kvmesh.services.worker.tiers.disk_format import chunk_file_name
from kvmesh.services.worker.tiers.disk_scan import check_file

SHAPE = (2, 4, 256, 64)  # [2, layers, tokens, hidden], fp16: 256 KiB


@pytest.fixture
def pool() -> Iterator[HostMemoryPool]:
    p = HostMemoryPool(8 * MiB, 256 * 1024, pin_memory=False)
    yield p
    p.close()


def kv(i: int) -> torch.Tensor:
    """Smooth along tokens with per-channel scales, rounded to 1/8 so that lz4 also
    finds something to save."""
    g = torch.Generator().manual_seed(i)
    x = torch.randn(2, 4, 1, 64, generator=g) + torch.cumsum(
        0.05 * torch.randn(*SHAPE, generator=g), dim=2
    )
    return ((x * 8).round() / 8).half()


def put(tier: DiskTier, pool: HostMemoryPool, i: int) -> None:
    obj = pool.allocate(torch.Size(SHAPE), torch.float16, MemoryFormat.KV_2LTD)
    obj.tensor.copy_(kv(i))
    tier.submit_put(key_of(i), obj)
    obj.ref_down()
    assert tier.flush(10)


def get(tier: DiskTier, pool: HostMemoryPool, i: int) -> MemoryObj | None:
    return tier.get(key_of(i), pool)


def file_of(tier: DiskTier, i: int) -> str:
    return os.path.join(tier.path, chunk_file_name(key_of(i)))


@pytest.mark.parametrize("codec", [ZstdCodec(), Lz4Codec()], ids=lambda c: c.name)
def test_lossless_files_read_back_bitwise_also_after_a_restart(
    tmp_path: Path, pool: HostMemoryPool, codec
) -> None:
    tier = DiskTier(tmp_path / "d", 64 * MiB, io_threads=2, codec=codec)
    assert tier.wait_indexed(10)
    try:
        put(tier, pool, 1)
        size = os.path.getsize(file_of(tier, 1))
        assert size < FILE_LAYOUT.size + kv(1).nbytes
        assert tier.used_bytes == size  # the tier counts what the file takes, not the chunk
        obj = get(tier, pool, 1)
        assert obj is not None and torch.equal(obj.tensor, kv(1))
        assert obj.checksum is not None
        obj.ref_down()
    finally:
        tier.close()
    scanned = check_file(str(tmp_path / "d"), chunk_file_name(key_of(1)), size, 0, True)
    assert scanned.ok and scanned.header is not None and scanned.header.codec is codec.id
    # A tier writing raw still reads what the other wrote.
    again = DiskTier(tmp_path / "d", 64 * MiB, io_threads=2)
    assert again.wait_indexed(10)
    try:
        assert again.used_bytes == size
        obj = get(again, pool, 1)
        assert obj is not None and torch.equal(obj.tensor, kv(1))
        obj.ref_down()
        put(again, pool, 2)
        assert os.path.getsize(file_of(again, 2)) == FILE_LAYOUT.size + kv(2).nbytes
    finally:
        again.close()


def test_cachegen_files_are_small_and_close(tmp_path: Path, pool: HostMemoryPool) -> None:
    tier = DiskTier(tmp_path / "d", 64 * MiB, io_threads=2, codec=CacheGenCodec())
    assert tier.wait_indexed(10)
    try:
        put(tier, pool, 3)
        assert os.path.getsize(file_of(tier, 3)) < FILE_LAYOUT.size + kv(3).nbytes / 2
        obj = get(tier, pool, 3)
        assert obj is not None
        x = kv(3).float()
        err = (obj.tensor.float() - x).abs()
        # The last layer gets 4 bits: half a step is (max - min) / 15 / 2 per channel.
        step = (x.amax(2, keepdim=True) - x.amin(2, keepdim=True)) / 15
        assert err.max() > 0 and bool((err <= step / 2 + 2e-3 * x.abs() + 1e-6).all())
        assert obj.checksum is None  # the decoded bytes are not the raw chunk's
        obj.ref_down()
    finally:
        tier.close()


@pytest.mark.parametrize("codec", [ZstdCodec(), CacheGenCodec()], ids=lambda c: c.name)
def test_a_damaged_compressed_file_is_a_miss_and_deleted(
    tmp_path: Path, pool: HostMemoryPool, codec
) -> None:
    tier = DiskTier(tmp_path / "d", 64 * MiB, io_threads=2, codec=codec)
    assert tier.wait_indexed(10)
    try:
        put(tier, pool, 4)
        path = file_of(tier, 4)
        with open(path, "r+b") as f:
            f.seek(FILE_LAYOUT.size + (os.path.getsize(path) - FILE_LAYOUT.size) // 2)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0x41]))
        free = pool.free_pages
        assert get(tier, pool, 4) is None
        assert pool.free_pages == free
        assert tier.stats.metrics.value("kvmesh_disk_corrupt_total", {}) == 1
        assert not os.path.exists(path)
        assert Codec(codec.id) is codec.id
    finally:
        tier.close()

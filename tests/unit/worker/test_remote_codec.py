"""The remote value encoding: exact round trips, compression only when it pays, and every
kind of damage caught as CorruptChunk (never wrong bytes)."""

from __future__ import annotations

import itertools
import time

import pytest
import torch

from kvmesh.common.chunk_codec import VALUE_LAYOUT, Codec, CorruptChunk
from kvmesh.common.keys import ChunkKey
from kvmesh.common.memory import HostMemoryPool, MemoryFormat
from kvmesh.services.worker.tiers.remote_codec import decode_into, encode

KEY = ChunkKey("0123456789abcdef", bytes(range(16)))
OTHER = ChunkKey("0123456789abcdef", bytes(16))
SHAPE = (2, 2, 16, 64)


@pytest.fixture
def pool():
    p = HostMemoryPool(4 << 20, 64 * 1024, pin_memory=False)
    yield p
    p.close()


def chunk(pool: HostMemoryPool, compressible: bool = False, dtype=torch.float16):
    obj = pool.allocate(torch.Size(SHAPE), dtype, MemoryFormat.KV_2LTD)
    if compressible:
        obj.tensor.zero_()
        obj.tensor[0, 0, 0, :8] = 1.5
    else:
        obj.raw.copy_(torch.randint(0, 256, (obj.nbytes,), dtype=torch.uint8))
    return obj


@pytest.mark.parametrize("codec", [c for c in Codec if c.lossless], ids=lambda c: c.name)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_round_trip_is_bitwise_exact(pool, codec: Codec, dtype) -> None:
    src = chunk(pool, compressible=True, dtype=dtype)
    header, packed, payload = encode(KEY, src, codec, 0.05)
    assert len(packed) == VALUE_LAYOUT.size
    assert header.codec is codec  # zeros compress well under either codec
    if codec is not Codec.NONE:
        assert len(payload) < src.nbytes / 10
    parsed = VALUE_LAYOUT.parse(packed)
    assert parsed == header
    dst = decode_into(KEY, parsed, payload, pool)
    assert dst is not None and dst is not src
    assert torch.equal(dst.raw, src.raw)
    assert (tuple(dst.shape), dst.dtype, dst.fmt) == (SHAPE, dtype, MemoryFormat.KV_2LTD)
    assert dst.key == KEY and dst.checksum == header.checksum
    dst.ref_down()
    src.ref_down()


def test_incompressible_chunks_are_sent_raw_without_a_copy(pool) -> None:
    src = chunk(pool)
    header, _, payload = encode(KEY, src, Codec.ZSTD, 0.05)
    assert header.codec is Codec.NONE and header.stored_nbytes == src.nbytes
    assert isinstance(payload, memoryview)  # a view of the L1 page itself
    src.ref_down()


def damaged(pool, how: str):
    src = chunk(pool)
    _, packed, payload = encode(KEY, src, Codec.NONE)
    payload = bytearray(payload)
    packed = bytearray(packed)
    key = KEY
    if how == "payload-bit":
        payload[100] ^= 1
    elif how == "header-bit":
        packed[30] ^= 1
    elif how == "magic":
        packed[:4] = b"NOPE"
    elif how == "truncated":
        payload = payload[:-1]
    elif how == "other-key":
        key = OTHER
    elif how == "short-header":
        packed = packed[:50]
    src.ref_down()
    return key, bytes(packed), bytes(payload)


@pytest.mark.parametrize(
    "how", ["payload-bit", "header-bit", "magic", "truncated", "other-key", "short-header"]
)
def test_damage_is_caught_and_nothing_leaks(pool, how: str) -> None:
    key, packed, payload = damaged(pool, how)
    free_before = pool.free_pages
    with pytest.raises(CorruptChunk):
        decode_into(key, VALUE_LAYOUT.parse(packed), payload, pool)
    assert pool.free_pages == free_before, "a buffer of a rejected value leaked"


def test_corrupt_compressed_payload_is_caught(pool) -> None:
    src = chunk(pool, compressible=True)
    header, _, payload = encode(KEY, src, Codec.LZ4, 0.05)
    bad = bytearray(payload)
    bad[len(bad) // 2] ^= 0xFF
    with pytest.raises(CorruptChunk):
        decode_into(KEY, header, bytes(bad), pool)
    src.ref_down()


def test_a_full_allocator_is_a_miss_not_an_error(pool) -> None:
    src = chunk(pool)
    header, _, payload = encode(KEY, src, Codec.NONE)

    class Full:
        def allocate(self, *a):
            return None

    assert decode_into(KEY, header, payload, Full()) is None
    src.ref_down()


def in_parts(payload, cuts: list[int]) -> list[memoryview]:
    """payload cut at the given offsets, as a cache-server client receives a big value."""
    view = memoryview(bytes(payload))
    bounds = [0, *cuts, len(view)]
    return [view[a:b] for a, b in itertools.pairwise(bounds)]


@pytest.mark.parametrize("codec", list(Codec), ids=lambda c: c.name)
@pytest.mark.parametrize("cuts", [[1], [4096, 8000], [100, 101, 30000]], ids=str)
def test_a_payload_in_parts_decodes_like_one_buffer(pool, codec: Codec, cuts) -> None:
    src = chunk(pool, compressible=codec is not Codec.NONE)
    header, _, payload = encode(KEY, src, codec, 0.05)
    assert header.codec is codec
    cuts = [c for c in cuts if c < len(payload)]
    dst = decode_into(KEY, header, in_parts(payload, cuts), pool)
    whole = decode_into(KEY, header, bytes(payload), pool)
    assert dst is not None and whole is not None
    assert torch.equal(dst.raw, whole.raw) and dst.checksum == whole.checksum
    if codec.lossless:
        assert torch.equal(dst.raw, src.raw) and dst.checksum == header.checksum
    for obj in (dst, whole, src):
        obj.ref_down()


@pytest.mark.parametrize("how", ["bit-in-second-part", "part-missing", "extra-part"])
def test_damage_in_parts_is_caught_and_nothing_leaks(pool, how: str) -> None:
    src = chunk(pool)
    header, _, payload = encode(KEY, src, Codec.NONE)
    parts = in_parts(payload, [5000, 20000])
    if how == "bit-in-second-part":
        bad = bytearray(parts[1])
        bad[7] ^= 1
        parts[1] = memoryview(bytes(bad))
    elif how == "part-missing":
        del parts[1]
    else:
        parts.append(memoryview(b"x"))
    free_before = pool.free_pages
    with pytest.raises(CorruptChunk):
        decode_into(KEY, header, parts, pool)
    assert pool.free_pages == free_before
    src.ref_down()


def test_placement_takes_an_l1_page_only_when_one_is_there_at_once(pool) -> None:
    # place() runs on the engine's event loop: with every page held elsewhere it must
    # answer None at once (the decode that follows waits on a thread), not wait out
    # the L1's alloc_timeout_s.
    from kvmesh.common.chunk_codec import chunk_bytes
    from kvmesh.services.worker.tiers.host import HostTier
    from kvmesh.services.worker.tiers.remote_codec import finish_placed, placement

    small = HostMemoryPool(2 * 64 * 1024, 64 * 1024, pin_memory=False)
    tier = HostTier(small, alloc_timeout_s=5.0)
    src = chunk(pool)
    header, _, payload = encode(KEY, src)
    held = [small.allocate(torch.Size(SHAPE), torch.float16, MemoryFormat.KV_2LTD)]
    held.append(small.allocate(torch.Size(SHAPE), torch.float16, MemoryFormat.KV_2LTD))
    placed: list = []
    place = placement(KEY, tier, placed)
    t0 = time.monotonic()
    assert place(header, header.nbytes) is None and placed == []
    assert time.monotonic() - t0 < 1.0
    held.pop().ref_down()
    view = place(header, header.nbytes)
    assert view is not None and view.nbytes == header.nbytes and len(placed) == 1
    view[:] = payload
    obj = finish_placed(KEY, header, placed.pop())
    assert torch.equal(obj.raw, src.raw) and obj.checksum == header.checksum
    # Damaged in place: CorruptChunk, and the page goes back.
    obj.ref_down()
    placed = []
    view = placement(KEY, tier, placed)(header, header.nbytes)
    view[:] = payload
    view[7] ^= 1
    with pytest.raises(CorruptChunk):
        finish_placed(KEY, header, placed.pop())
    assert small.free_pages == 1
    # A header naming another key never gets a buffer.
    other, _, _ = encode(OTHER, src)
    with pytest.raises(CorruptChunk):
        placement(KEY, tier, placed)(other, other.nbytes)
    assert placed == [] and chunk_bytes(held[0]).nbytes == header.nbytes

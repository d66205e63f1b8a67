"""The chunk codec shared by the disk and remote tiers: both header layouts byte for
byte as files and values already stored hold them, exact round trips, and every kind
of damage (payload, header, truncation, another key) caught as CorruptChunk."""

from __future__ import annotations

import concurrent.futures
import os
import time

import pytest
import torch
import xxhash

from kvmesh.common import chunk_codec
from kvmesh.common.chunk_codec import (
    FILE_LAYOUT,
    VALUE_LAYOUT,
    ChunkHeader,
    Codec,
    CorruptChunk,
    HeaderLayout,
    check_key,
    check_payload,
    chunk_bytes,
    describe,
    payload_checksum,
)
from kvmesh.common.keys import ChunkKey
from kvmesh.common.memory import HostMemoryPool, MemoryFormat
from kvmesh.common.memory.errors import MemoryObjFreedError

KEY = ChunkKey("0123456789abcdef", bytes(range(16)))
OTHER = ChunkKey("0123456789abcdef", bytes(16))
SHAPE = (2, 3, 256, 128)
LAYOUTS = [FILE_LAYOUT, VALUE_LAYOUT]


def header(**kw) -> ChunkHeader:
    fields = {
        "key": KEY,
        "shape": SHAPE,
        "dtype": torch.bfloat16,
        "fmt": MemoryFormat.KV_2LTD,
        "nbytes": 2 * 3 * 256 * 128 * 2,
        "checksum": 0x0123456789ABCDEF,
    }
    fields.update(kw)
    return ChunkHeader(**fields)


def stored(layout: HeaderLayout, payload: bytes, key: ChunkKey = KEY) -> bytes:
    """header + payload as a tier stores an uncompressed chunk of payload."""
    h = header(
        key=key,
        shape=(len(payload),),
        dtype=torch.uint8,
        fmt=MemoryFormat.BINARY,
        nbytes=len(payload),
        checksum=payload_checksum(payload),
    )
    return layout.pack(h) + payload


def read_back(layout: HeaderLayout, data: bytes, key: ChunkKey = KEY) -> bytes:
    """What a tier does with stored bytes: parse, check key, size and payload."""
    h = layout.parse(data)
    check_key(h, key)
    if len(data) != layout.total_size(h):
        raise CorruptChunk(f"{len(data)} bytes, header says {layout.total_size(h)}")
    payload = data[layout.size :]
    check_payload(h, payload)
    return payload


# --- the bytes already on disks and in remote stores ------------------------------------

# Packed by the disk tier's and the remote tier's own header code before they shared
# this module: files and values written then must still read.
OLD_FILE_HEADER = bytes.fromhex(
    "4b564d4553484c33010000100100040062666c6f617431360000000000000000"
    "0200000000000000030000000000000000010000000000008000000000000000"
    "0000000000000000000000000000000000000000000000000000000000000000"
    "0000060000000000efcdab896745230100002a36fe9c97170123456789abcdef"
    "000102030405060708090a0b0c0d0e0f0953a9345883e890"
)
OLD_VALUE_HEADER = bytes.fromhex(
    "4b564d520101010462666c6f6174313600000000000000000200000000000000"
    "0300000000000000000100000000000080000000000000000000000000000000"
    "0000000000000000000000000000000000000000000000000000060000000000"
    "e803000000000000efcdab89674523010123456789abcdef0001020304050607"
    "08090a0b0c0d0e0f55d73242dc6188bf"
)


def test_file_layout_is_the_existing_disk_format() -> None:
    h = header(written_ns=1_700_000_000_000_000_000)
    raw = FILE_LAYOUT.pack(h)
    assert (FILE_LAYOUT.size, FILE_LAYOUT.used) == (4096, 152)
    assert raw == OLD_FILE_HEADER + bytes(4096 - 152)
    assert FILE_LAYOUT.parse(raw) == h


def test_value_layout_is_the_existing_wire_format() -> None:
    h = header(codec=Codec.ZSTD, stored_nbytes=1000)
    assert VALUE_LAYOUT.size == VALUE_LAYOUT.used == 144
    assert VALUE_LAYOUT.pack(h) == OLD_VALUE_HEADER
    assert VALUE_LAYOUT.parse(OLD_VALUE_HEADER) == h


# --- round trips ----------------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: lay.what)
@pytest.mark.parametrize(
    "dtype", [torch.float16, torch.bfloat16, torch.float32, torch.uint8, torch.float8_e4m3fn]
)
@pytest.mark.parametrize("fmt", list(MemoryFormat), ids=lambda f: f.name)
def test_header_round_trips(layout: HeaderLayout, dtype: torch.dtype, fmt: MemoryFormat) -> None:
    written = 123456789 if layout is FILE_LAYOUT else 0  # only files keep it
    h = header(dtype=dtype, fmt=fmt, nbytes=2 * 3 * 256 * 128 * dtype.itemsize, written_ns=written)
    raw = layout.pack(h)
    assert len(raw) == layout.size
    assert raw[layout.used :] == bytes(layout.size - layout.used)
    assert layout.parse(raw) == h
    buf = bytearray(b"\xff" * (layout.size + 10))
    layout.pack_into(h, buf)
    assert bytes(buf[: layout.size]) == raw  # in place, padding zeroed
    assert buf[layout.size :] == b"\xff" * 10  # and nothing past it touched


def test_value_layout_drops_the_write_time() -> None:
    h = header(written_ns=99)
    assert VALUE_LAYOUT.parse(VALUE_LAYOUT.pack(h)).written_ns == 0


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: lay.what)
@pytest.mark.parametrize("n", [0, 1, 4096, 300_001])
def test_stored_chunk_round_trips(layout: HeaderLayout, n: int) -> None:
    payload = os.urandom(n)
    assert read_back(layout, stored(layout, payload)) == payload


def test_describe_hashes_the_chunk_once_given_its_checksum() -> None:
    with HostMemoryPool(1 << 20, 64 * 1024, pin_memory=False) as pool:
        obj = pool.allocate((2, 2, 16, 64), torch.float16, MemoryFormat.KV_2LTD)
        assert obj is not None
        obj.raw.copy_(torch.randint(0, 256, (obj.nbytes,), dtype=torch.uint8))
        h = describe(KEY, obj, written_ns=5)
        assert h.checksum == xxhash.xxh3_64_intdigest(bytes(chunk_bytes(obj)))
        assert (h.key, h.shape, h.dtype, h.fmt, h.nbytes, h.written_ns) == (
            KEY,
            (2, 2, 16, 64),
            torch.float16,
            MemoryFormat.KV_2LTD,
            obj.nbytes,
            5,
        )
        assert h.codec is Codec.NONE and h.stored_nbytes == obj.nbytes
        # A checksum the caller already has is taken as is, not recomputed.
        assert describe(KEY, obj, 42).checksum == 42
        obj.ref_down()


def test_threads_asking_for_one_chunks_checksum_hash_it_once(monkeypatch) -> None:
    # The disk and remote tiers take a new chunk on their own threads at once: whoever
    # asks while another hashes the same chunk waits for that hash.
    calls: list[int] = []
    real = chunk_codec.payload_checksum

    def slow(data) -> int:
        calls.append(len(data))
        time.sleep(0.2)  # long enough that every thread below asks meanwhile
        return real(data)

    monkeypatch.setattr(chunk_codec, "payload_checksum", slow)
    with HostMemoryPool(1 << 20, 64 * 1024, pin_memory=False) as pool:
        objs = [
            pool.allocate((2, 2, 16, 64), torch.float16, MemoryFormat.KV_2LTD) for _ in range(2)
        ]
        for i, obj in enumerate(objs):
            assert obj is not None
            obj.raw.copy_(torch.full((obj.nbytes,), i + 1, dtype=torch.uint8))
        with concurrent.futures.ThreadPoolExecutor(8) as pool_threads:
            got = list(pool_threads.map(lambda o: describe(KEY, o).checksum, objs * 4))
        want = [xxhash.xxh3_64_intdigest(bytes(chunk_bytes(o))) for o in objs]
        assert got == want * 4
        assert sorted(calls) == [objs[0].nbytes] * 2  # one hash per chunk, not four
        assert [o.checksum for o in objs] == want  # kept on the chunk
        assert chunk_codec._summing == {}
        for obj in objs:
            obj.ref_down()


# --- damage -------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: lay.what)
def test_corrupted_payload_is_caught(layout: HeaderLayout) -> None:
    data = bytearray(stored(layout, os.urandom(5000)))
    data[layout.size + 1234] ^= 0x01
    with pytest.raises(CorruptChunk, match="payload checksum mismatch"):
        read_back(layout, bytes(data))


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: lay.what)
def test_every_flipped_header_byte_is_caught(layout: HeaderLayout) -> None:
    raw = layout.pack(header(codec=Codec.LZ4 if layout is VALUE_LAYOUT else Codec.NONE))
    for i in range(layout.used):
        bad = bytearray(raw)
        bad[i] ^= 0x01
        with pytest.raises(CorruptChunk):
            layout.parse(bytes(bad))


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: lay.what)
def test_truncated_data_is_caught(layout: HeaderLayout) -> None:
    data = stored(layout, os.urandom(5000))
    with pytest.raises(CorruptChunk, match="too short"):
        layout.parse(data[: layout.used - 1])
    with pytest.raises(CorruptChunk):
        read_back(layout, data[:-1])
    h = layout.parse(data)
    with pytest.raises(CorruptChunk, match="payload of 4999 bytes"):
        check_payload(h, data[layout.size : -1])


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: lay.what)
def test_wrong_key_is_caught(layout: HeaderLayout) -> None:
    data = stored(layout, os.urandom(100), key=OTHER)
    with pytest.raises(CorruptChunk, match="another key"):
        read_back(layout, data, key=KEY)
    assert read_back(layout, data, key=OTHER)


def test_headers_reject_inconsistent_fields() -> None:
    for layout in LAYOUTS:
        with pytest.raises(CorruptChunk, match="payload length"):
            layout.parse(layout.pack(header(nbytes=12)))  # checksummed, but wrong
        with pytest.raises(CorruptChunk, match="magic"):
            layout.parse(b"\0" * layout.size)
        with pytest.raises(ValueError, match="dimensions"):
            layout.pack(header(shape=(1,) * 9, nbytes=2))
    with pytest.raises(CorruptChunk, match="too short"):
        FILE_LAYOUT.parse(b"KVMESHL3")
    with pytest.raises(CorruptChunk, match="stored length"):
        VALUE_LAYOUT.parse(VALUE_LAYOUT.pack(header(stored_nbytes=10)))
    with pytest.raises(CorruptChunk, match="magic"):
        VALUE_LAYOUT.parse(FILE_LAYOUT.pack(header()))  # one layout is never the other
    with pytest.raises(ValueError, match="uncompressed"):  # version 1 has no codec field
        chunk_codec.FILE_LAYOUT_V1.pack(header(codec=Codec.ZSTD, stored_nbytes=10))


# --- the checksum --------------------------------------------------------------------------


@pytest.mark.parametrize("native", [True, False], ids=["ctypes-nogil", "module-pieces"])
def test_checksum_equals_xxh3_64(native: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if native:
        assert chunk_codec._xxh3_nogil is not None  # found in this environment
    else:
        monkeypatch.setattr(chunk_codec, "_xxh3_nogil", None)
    data = os.urandom(3 * (1 << 20) + 123)
    writable = memoryview(bytearray(data))
    for piece in (data, data[:100], b"", writable, writable[5:], writable[:0]):
        assert payload_checksum(piece) == xxhash.xxh3_64_intdigest(piece)


@pytest.mark.parametrize("how", ["a batch fails", "the caller is cancelled"])
def test_chunk_checksums_ends_every_batch_before_it_raises(
    how: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The batches hash pages by address on threads. Whoever gets the error (or is
    # cancelled) frees the pages next, so a batch still hashing then reads freed
    # memory: with a closed pool the process faulted (SIGSEGV in 3 of 3 runs).
    import asyncio

    monkeypatch.setattr(chunk_codec, "_PARALLEL_HASH_BYTES", 1)
    monkeypatch.setattr(chunk_codec.os, "cpu_count", lambda: 2)
    real = chunk_codec.payload_checksum
    ended: list[float] = []

    def slow(data):
        time.sleep(0.3)
        digest = real(data)
        ended.append(time.monotonic())
        return digest

    monkeypatch.setattr(chunk_codec, "payload_checksum", slow)
    with HostMemoryPool(1 << 20, 4096, pin_memory=False) as pool:
        objs = [pool.allocate((4096,), torch.uint8, MemoryFormat.BINARY) for _ in range(2)]
        if how == "a batch fails":
            objs[1].ref_down()  # freed: the second batch raises at once

        async def call() -> float:
            task = asyncio.ensure_future(chunk_codec.chunk_checksums(objs, max_threads=2))
            if how == "the caller is cancelled":
                await asyncio.sleep(0.05)
                task.cancel()
            with pytest.raises((asyncio.CancelledError, MemoryObjFreedError)):
                await task
            return time.monotonic()

        raised_at = asyncio.run(call())
        assert ended, "the first batch never finished"
        assert max(ended) <= raised_at, "a batch was still hashing when the call raised"

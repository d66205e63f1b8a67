"""How a chunk travels to and from a remote store: a checked header, then the payload.

The header (HEADER_SIZE = 144 bytes, little-endian, fixed offsets):

| offset | size | field |
|---:|---:|---|
| 0 | 4 | magic `b"KVMR"` |
| 4 | 1 | version (1) |
| 5 | 1 | codec: 0 none, 1 zstd, 2 lz4 |
| 6 | 1 | memory format (`MemoryFormat`) |
| 7 | 1 | number of dimensions (at most 8) |
| 8 | 16 | dtype name, ASCII, zero-padded |
| 24 | 64 | shape: 8 × u64 |
| 88 | 8 | raw length: the chunk's bytes before compression |
| 96 | 8 | stored length: the payload's bytes as sent |
| 104 | 8 | xxh3-64 of the raw bytes |
| 112 | 8 | key: namespace id |
| 120 | 16 | key: chunk hash |
| 136 | 8 | xxh3-64 of bytes 0–135 |

The cache-server keeps the header as the value's meta (the payload is the value,
untouched); Redis stores header + payload as one string. A reader checks the header's
own checksum, that the key is the one asked for, that shape × dtype = raw length and
the payload's length = stored length, decompresses, and checks the raw bytes' checksum
after they land in the L1 buffer. Anything that fails is `CorruptValue`: a miss, never
wrong KV.

Compression (zstd level 1 or lz4) is kept only when it saves at least `min_saving` of
the bytes; KV in fp16/bf16 rarely compresses much, so it is off by default.
"""

from __future__ import annotations

import asyncio
import ctypes
import struct
import threading
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import torch
import xxhash

from kvmesh.common.keys import ChunkKey
from kvmesh.common.memory import MemoryFormat, MemoryObj
from kvmesh.services.worker.tiers.base import Allocator
from kvmesh.services.worker.tiers.disk_format import (
    dtype_from_name,
    dtype_name,
    payload_checksum,
)

MAGIC = b"KVMR"
VERSION = 1
MAX_DIMS = 8
_BODY = struct.Struct("<4sBBBB16s8QQQQ8s16s")
_CHECK = struct.Struct("<Q")
HEADER_SIZE = _BODY.size + _CHECK.size  # 144


class Codec(IntEnum):
    NONE = 0
    ZSTD = 1
    LZ4 = 2


CODECS = {"none": Codec.NONE, "zstd": Codec.ZSTD, "lz4": Codec.LZ4}


class CorruptValue(ValueError):
    """A fetched value failed a check; the message says which."""


@dataclass(frozen=True, slots=True)
class ValueHeader:
    key: ChunkKey
    shape: tuple[int, ...]
    dtype: torch.dtype
    fmt: MemoryFormat
    codec: Codec
    raw_len: int
    stored_len: int
    checksum: int

    def pack(self) -> bytes:
        if len(self.shape) > MAX_DIMS:
            raise ValueError(f"a chunk has at most {MAX_DIMS} dimensions")
        body = _BODY.pack(
            MAGIC,
            VERSION,
            int(self.codec),
            int(self.fmt),
            len(self.shape),
            dtype_name(self.dtype).encode("ascii"),
            *(tuple(self.shape) + (0,) * (MAX_DIMS - len(self.shape))),
            self.raw_len,
            self.stored_len,
            self.checksum,
            bytes.fromhex(self.key.namespace_id),
            self.key.chunk_hash,
        )
        return body + _CHECK.pack(xxhash.xxh3_64_intdigest(body))


def parse_header(data: bytes | memoryview) -> ValueHeader:
    """The header at the start of data; CorruptValue if any check fails."""
    mv = memoryview(data).cast("B")
    if len(mv) < HEADER_SIZE:
        raise CorruptValue(f"value too short for a header ({len(mv)} bytes)")
    if bytes(mv[:4]) != MAGIC:
        raise CorruptValue("bad magic: not a kvmesh remote value")
    (check,) = _CHECK.unpack_from(mv, _BODY.size)
    if xxhash.xxh3_64_intdigest(mv[: _BODY.size]) != check:
        raise CorruptValue("header checksum mismatch")
    fields = _BODY.unpack_from(mv)
    _magic, version, codec, fmt, ndim, raw_dtype = fields[:6]
    dims = fields[6 : 6 + MAX_DIMS]
    raw_len, stored_len, checksum, ns_raw, chunk_hash = fields[6 + MAX_DIMS :]
    if version != VERSION:
        raise CorruptValue(f"unsupported value version {version}")
    try:
        codec_v, fmt_v = Codec(codec), MemoryFormat(fmt)
    except ValueError as exc:
        raise CorruptValue(str(exc)) from None
    if ndim > MAX_DIMS:
        raise CorruptValue(f"too many dimensions ({ndim})")
    try:
        dtype = dtype_from_name(raw_dtype.rstrip(b"\0").decode("ascii"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise CorruptValue(f"bad dtype: {exc}") from None
    shape = tuple(dims[:ndim])
    expected = dtype.itemsize
    for d in shape:
        expected *= d
    if expected != raw_len:
        raise CorruptValue(f"raw length {raw_len} does not match shape {shape} of {dtype}")
    if codec_v is Codec.NONE and stored_len != raw_len:
        raise CorruptValue("uncompressed value whose stored length differs from its raw length")
    key = ChunkKey(ns_raw.hex(), chunk_hash)
    return ValueHeader(key, shape, dtype, fmt_v, codec_v, raw_len, stored_len, checksum)


def obj_bytes(obj: MemoryObj) -> memoryview:
    """A writable byte view of obj's bytes (no copy); valid while a reference is held."""
    return memoryview((ctypes.c_char * obj.nbytes).from_address(obj.data_ptr)).cast("B")


# -- compression ----------------------------------------------------------------------------

_local = threading.local()


def _zstd() -> Any:
    c = getattr(_local, "zstd", None)
    if c is None:
        import zstandard

        c = _local.zstd = (zstandard.ZstdCompressor(level=1), zstandard.ZstdDecompressor())
    return c


def available(codec: Codec) -> bool:
    try:
        if codec is Codec.ZSTD:
            import zstandard  # noqa: F401
        elif codec is Codec.LZ4:
            import lz4.frame  # noqa: F401
    except ImportError:
        return False
    return True


def compress(codec: Codec, data: memoryview) -> bytes:
    if codec is Codec.ZSTD:
        return _zstd()[0].compress(data)
    if codec is Codec.LZ4:
        import lz4.frame

        return lz4.frame.compress(data)
    raise ValueError(f"not a compressing codec: {codec!r}")


def decompress(codec: Codec, data: memoryview | bytes, raw_len: int) -> bytes:
    try:
        if codec is Codec.ZSTD:
            return _zstd()[1].decompress(data, max_output_size=raw_len)
        if codec is Codec.LZ4:
            import lz4.frame

            return lz4.frame.decompress(data)
    except Exception as exc:  # each library has its own error type
        raise CorruptValue(f"{codec.name.lower()} decompression failed: {exc}") from None
    raise CorruptValue(f"unknown codec {codec!r}")


# -- encode / decode ------------------------------------------------------------------------


def encode(
    key: ChunkKey, obj: MemoryObj, codec: Codec = Codec.NONE, min_saving: float = 0.05
) -> tuple[ValueHeader, bytes, memoryview | bytes]:
    """(header, packed header, payload) for obj. The payload is a view of obj's own
    bytes unless compression paid off; the caller keeps its reference until sent."""
    raw = obj_bytes(obj)
    checksum = payload_checksum(raw)
    payload: memoryview | bytes = raw
    used = Codec.NONE
    if codec is not Codec.NONE:
        packed = compress(codec, raw)
        if len(packed) <= len(raw) * (1.0 - min_saving):
            payload, used = packed, codec
    header = ValueHeader(
        key,
        tuple(int(d) for d in obj.shape),
        obj.dtype,
        MemoryFormat(obj.fmt),
        used,
        obj.nbytes,
        len(payload),
        checksum,
    )
    return header, header.pack(), payload


def decode_into(
    key: ChunkKey, header: ValueHeader, payload: memoryview | bytes, allocator: Allocator
) -> MemoryObj | None:
    """A new object from allocator holding the verified chunk (one reference, the
    caller's), None when the allocator has no room; CorruptValue on a failed check."""
    if header.key != key:
        raise CorruptValue(f"value holds {header.key.to_str()}, not {key.to_str()}")
    payload = memoryview(payload).cast("B")
    if payload.nbytes != header.stored_len:
        raise CorruptValue(f"payload of {payload.nbytes} bytes, header says {header.stored_len}")
    if header.codec is not Codec.NONE:
        payload = memoryview(decompress(header.codec, payload, header.raw_len))
        if payload.nbytes != header.raw_len:
            raise CorruptValue("decompressed length does not match the header")
    obj = allocator.allocate(torch.Size(header.shape), header.dtype, header.fmt)
    if obj is None:
        return None
    try:
        dst = obj_bytes(obj)
        dst[:] = payload
        if payload_checksum(dst) != header.checksum:
            raise CorruptValue("payload checksum mismatch")
    except BaseException:
        obj.ref_down()
        raise
    obj.key = key
    obj.checksum = header.checksum
    return obj


def decode_or_none(
    key: ChunkKey, header: ValueHeader, payload: memoryview | bytes, allocator: Allocator
) -> MemoryObj | None:
    """`decode_into`, with an allocator that cannot make room (L1 full: AllocationError
    and the like) answered as None; CorruptValue still raises."""
    try:
        return decode_into(key, header, payload, allocator)
    except CorruptValue:
        raise
    except Exception:
        return None


async def decode_off_loop(
    key: ChunkKey, header: ValueHeader, payload: memoryview | bytes, allocator: Allocator
) -> MemoryObj | None:
    """`decode_or_none` on a worker thread (copy, checksum and decompression of a large
    chunk would stall the event loop). A caller cancelled meanwhile does not leak the
    buffer: the thread's result is released when it arrives."""
    work = asyncio.ensure_future(asyncio.to_thread(decode_or_none, key, header, payload, allocator))
    try:
        return await asyncio.shield(work)
    except asyncio.CancelledError:
        work.add_done_callback(_release_result)
        raise


def _release_result(fut: asyncio.Future) -> None:
    if not fut.cancelled() and fut.exception() is None and fut.result() is not None:
        fut.result().ref_down()

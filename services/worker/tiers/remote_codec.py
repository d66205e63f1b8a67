"""How a chunk travels to and from a remote store: a `VALUE_LAYOUT` header (see
common/chunk_codec.py: key, shape, dtype, format, codec, lengths, checksums), then the
payload.

The cache-server keeps the header as the value's meta (the payload is the value,
untouched); Redis stores header + payload as one string. A reader checks the header
(`VALUE_LAYOUT.parse`), that the key is the one asked for, that the payload's length is
the stored length, decompresses, and checks the raw bytes' length and checksum after
they land in the L1 buffer. Anything that fails is `CorruptChunk`: a miss, never wrong
KV.

Compression (zstd level 1 or lz4) is kept only when it saves at least `min_saving` of
the bytes; KV in fp16/bf16 rarely compresses much, so it is off by default.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from typing import Any

import torch

from kvmesh.common.chunk_codec import (
    VALUE_LAYOUT,
    ChunkHeader,
    Codec,
    CorruptChunk,
    check_key,
    check_payload,
    chunk_bytes,
    describe,
)
from kvmesh.common.keys import ChunkKey
from kvmesh.common.memory import MemoryObj
from kvmesh.services.worker.tiers.base import Allocator

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
        raise CorruptChunk(f"{codec.name.lower()} decompression failed: {exc}") from None
    raise CorruptChunk(f"unknown codec {codec!r}")


# -- encode / decode ------------------------------------------------------------------------


def encode(
    key: ChunkKey,
    obj: MemoryObj,
    codec: Codec = Codec.NONE,
    min_saving: float = 0.05,
    checksum: int | None = None,
) -> tuple[ChunkHeader, bytes, memoryview | bytes]:
    """(header, packed header, payload) for obj. The payload is a view of obj's own
    bytes unless compression paid off; the caller keeps its reference until sent.
    checksum, when the caller already has it, spares hashing the bytes again."""
    header = describe(key, obj, checksum)
    payload: memoryview | bytes = chunk_bytes(obj)
    if codec is not Codec.NONE:
        packed = compress(codec, payload)
        if len(packed) <= len(payload) * (1.0 - min_saving):
            payload = packed
            header = dataclasses.replace(header, codec=codec, stored_nbytes=len(packed))
    return header, VALUE_LAYOUT.pack(header), payload


def decode_into(
    key: ChunkKey, header: ChunkHeader, payload: memoryview | bytes, allocator: Allocator
) -> MemoryObj | None:
    """A new object from allocator holding the verified chunk (one reference, the
    caller's), None when the allocator has no room; CorruptChunk on a failed check."""
    check_key(header, key)
    payload = memoryview(payload).cast("B")
    if payload.nbytes != header.stored_nbytes:
        raise CorruptChunk(f"payload of {payload.nbytes} bytes, header says {header.stored_nbytes}")
    if header.codec is not Codec.NONE:
        payload = memoryview(decompress(header.codec, payload, header.nbytes))
        if payload.nbytes != header.nbytes:
            raise CorruptChunk("decompressed length does not match the header")
    obj = allocator.allocate(torch.Size(header.shape), header.dtype, header.fmt)
    if obj is None:
        return None
    try:
        dst = chunk_bytes(obj)
        dst[:] = payload
        check_payload(header, dst)
    except BaseException:
        obj.ref_down()
        raise
    obj.key = key
    obj.checksum = header.checksum
    return obj


def decode_or_none(
    key: ChunkKey, header: ChunkHeader, payload: memoryview | bytes, allocator: Allocator
) -> MemoryObj | None:
    """`decode_into`, with an allocator that cannot make room (L1 full: AllocationError
    and the like) answered as None; CorruptChunk still raises."""
    try:
        return decode_into(key, header, payload, allocator)
    except CorruptChunk:
        raise
    except Exception:
        return None


async def decode_off_loop(
    key: ChunkKey, header: ChunkHeader, payload: memoryview | bytes, allocator: Allocator
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

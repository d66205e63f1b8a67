"""How a chunk travels to and from a remote store: a `VALUE_LAYOUT` header (see
common/chunk_codec.py: key, shape, dtype, format, codec, lengths, checksums), then the
payload.

The cache-server keeps the header as the value's meta (the payload is the value,
untouched); Redis stores header + payload as one string. A reader checks the header
(`VALUE_LAYOUT.parse`), that the key is the one asked for, that the payload's length is
the stored length, decompresses, and checks the raw bytes' length and checksum after
they land in the L1 buffer. Anything that fails is `CorruptChunk`: a miss, never wrong
KV.

Compression (a codec from common/codecs/: zstd, lz4, or the lossy cachegen) is kept
only when it saves at least `min_saving` of the bytes; KV in fp16/bf16 rarely
compresses much losslessly, so it is off by default.
"""

from __future__ import annotations

import asyncio

import torch

from kvmesh.common.chunk_codec import (
    VALUE_LAYOUT,
    ChunkHeader,
    Codec,
    CorruptChunk,
    Payload,
    check_key,
    check_stored,
)
from kvmesh.common.codecs import Codec as ChunkCodec
from kvmesh.common.codecs import codec_by_id
from kvmesh.common.codecs.stored import decode_chunk, encode_chunk
from kvmesh.common.keys import ChunkKey
from kvmesh.common.memory import MemoryObj
from kvmesh.services.worker.tiers.base import Allocator

# -- compression ----------------------------------------------------------------------------


def available(codec: Codec) -> bool:
    try:
        if codec is Codec.ZSTD or codec is Codec.CACHEGEN:
            import zstandard  # noqa: F401
        elif codec is Codec.LZ4:
            import lz4.frame  # noqa: F401
    except ImportError:
        return False
    return True


# -- encode / decode ------------------------------------------------------------------------


def encode(
    key: ChunkKey,
    obj: MemoryObj,
    codec: ChunkCodec | Codec | None = None,
    min_saving: float = 0.05,
    checksum: int | None = None,
) -> tuple[ChunkHeader, bytes, memoryview | bytes]:
    """(header, packed header, payload) for obj. The payload is a view of obj's own
    bytes unless the codec's form paid off; the caller keeps its reference until sent.
    codec: a codec, or a codec id for its default settings. checksum, when the caller
    already has it, spares hashing the bytes again."""
    if isinstance(codec, Codec):
        codec = None if codec is Codec.NONE else codec_by_id(codec)
    header, payload, _ = encode_chunk(key, obj, codec, checksum=checksum, min_saving=min_saving)
    return header, VALUE_LAYOUT.pack(header), payload


def decode_into(
    key: ChunkKey, header: ChunkHeader, payload: Payload, allocator: Allocator
) -> MemoryObj | None:
    """A new object from allocator holding the verified chunk (one reference, the
    caller's), None when the allocator has no room; CorruptChunk on a failed check."""
    check_key(header, key)
    check_stored(header, payload)
    obj = allocator.allocate(torch.Size(header.shape), header.dtype, header.fmt)
    if obj is None:
        return None
    try:
        checksum = decode_chunk(header, payload, obj)
    except BaseException:
        obj.ref_down()
        raise
    obj.key = key
    obj.checksum = checksum
    return obj


def decode_or_none(
    key: ChunkKey, header: ChunkHeader, payload: Payload, allocator: Allocator
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
    key: ChunkKey, header: ChunkHeader, payload: Payload, allocator: Allocator
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

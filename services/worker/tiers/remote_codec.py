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
    chunk_bytes,
)
from kvmesh.common.codecs import Codec as ChunkCodec
from kvmesh.common.codecs import codec_by_id
from kvmesh.common.codecs.stored import decode_chunk, encode_chunk
from kvmesh.common.keys import ChunkKey
from kvmesh.common.memory import MemoryObj
from kvmesh.services.worker.tiers.base import Allocator, without_wait

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
    return _filled(key, header, payload, obj)


def _filled(key: ChunkKey, header: ChunkHeader, payload: Payload, obj: MemoryObj) -> MemoryObj:
    """obj holding the chunk decoded from payload, checked; on any failure obj is
    released and the error raised."""
    try:
        check_key(header, key)
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


def placement(key: ChunkKey, allocator: Allocator, placed: list[MemoryObj]):
    """A `place(header, nbytes)` for a connector's get_into: an uncompressed chunk of
    key gets a new buffer from allocator (appended to placed: the caller owns it and
    must pass it to `finish_placed` or release it); anything else gets None (the
    connector then receives into its own buffer and the chunk is decoded as usual).
    A header naming another key is CorruptChunk before a byte is received.

    place runs on the event loop, so it takes a buffer only if one is there without
    waiting (`without_wait`); a full L1 whose pages are all in use gets None, and the
    decode that follows waits for a page on a worker thread."""
    allocate = without_wait(allocator).allocate

    def place(header: ChunkHeader, nbytes: int) -> memoryview | None:
        check_key(header, key)
        if header.codec is not Codec.NONE or nbytes != header.nbytes:
            return None
        try:
            obj = allocate(torch.Size(header.shape), header.dtype, header.fmt)
        except Exception:  # no room (AllocationError and the like): decoded later, or not
            return None
        if obj is None:
            return None
        if obj.nbytes != nbytes:
            obj.ref_down()
            return None
        placed.append(obj)
        return chunk_bytes(obj)

    return place


def finish_placed(key: ChunkKey, header: ChunkHeader, obj: MemoryObj) -> MemoryObj:
    """obj, whose bytes were received in place, once its length and checksum match
    header; CorruptChunk (and obj released) otherwise."""
    return _filled(key, header, chunk_bytes(obj), obj)


def release_result(fut: asyncio.Future[MemoryObj | None]) -> None:
    """`offload`'s `abandoned` for a decode: the buffer it returns, nobody's now, is freed."""
    if not fut.cancelled() and fut.exception() is None and fut.result() is not None:
        fut.result().ref_down()

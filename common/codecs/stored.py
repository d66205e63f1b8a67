"""A chunk through a codec and back, with its header: what a tier's write path and
read path call (disk and remote alike).

`encode_chunk` keeps the codec's payload only where it is smaller than the chunk by at
least `min_saving` (and strictly smaller: a compressed file is told apart from a raw
one by its length); anything the codec refuses (a layout it does not take, non-finite
values under cachegen) is stored raw. `decode_chunk` checks and decodes whatever codec
the header names, into a buffer of the header's shape.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
import xxhash

from kvmesh.common.chunk_codec import (
    ChunkHeader,
    CorruptChunk,
    Payload,
    check_payload,
    check_stored,
    chunk_bytes,
    describe,
    dtype_name,
    joined,
    payload_checksum,
)
from kvmesh.common.chunk_codec import (
    Codec as CodecId,
)
from kvmesh.common.codecs import codec_by_id
from kvmesh.common.codecs.base import Codec, KVLayout
from kvmesh.common.keys import ChunkKey
from kvmesh.common.memory import MemoryFormat, MemoryObj


def layout_of(header: ChunkHeader) -> KVLayout:
    return KVLayout(tuple(header.shape), dtype_name(header.dtype), int(header.fmt))


def encode_chunk(
    key: ChunkKey,
    obj: MemoryObj,
    codec: Codec | None,
    *,
    checksum: int | None = None,
    min_saving: float = 0.0,
    written_ns: int = 0,
) -> tuple[ChunkHeader, memoryview | bytes, int | None]:
    """(header, payload to store, the raw chunk's checksum where it was computed).
    The payload is a view of obj's bytes when stored raw: hold obj until it is written.
    checksum, when the caller has it, spares hashing the raw bytes again."""
    if codec is not None:
        layout = KVLayout(tuple(int(d) for d in obj.shape), dtype_name(obj.dtype), int(obj.fmt))
        stored: bytes | None = None
        if codec.supports(layout):
            try:
                stored = codec.encode(obj.tensor, layout)
            except ValueError:
                stored = None  # this chunk cannot go through the codec: stored raw
        if stored is not None and len(stored) < min(
            obj.nbytes, obj.nbytes * (1.0 - min_saving) + 1e-9
        ):
            if codec.lossless:
                header = describe(key, obj, checksum, written_ns=written_ns)
                raw_sum: int | None = header.checksum
            else:
                header = ChunkHeader(
                    key,
                    tuple(int(d) for d in obj.shape),
                    obj.dtype,
                    MemoryFormat(obj.fmt),
                    obj.nbytes,
                    payload_checksum(stored),
                    written_ns=written_ns,
                )
                raw_sum = checksum
            header = dataclasses.replace(header, codec=codec.id, stored_nbytes=len(stored))
            return header, stored, raw_sum
    header = describe(key, obj, checksum, written_ns=written_ns)
    return header, chunk_bytes(obj), header.checksum


def decode_chunk(header: ChunkHeader, stored: Payload, out: MemoryObj) -> int | None:
    """Check stored (the payload as stored under header, one buffer or its parts) and
    put the chunk into out (a buffer of the header's shape, dtype and format). Returns
    the checksum of out's bytes when known (None after a lossy decode, whose bytes are
    not the raw chunk's); CorruptChunk when a check fails."""
    if (tuple(out.shape), out.dtype) != (tuple(header.shape), header.dtype):
        raise ValueError(f"buffer {tuple(out.shape)} {out.dtype} does not match the header")
    check_stored(header, stored)
    dst = chunk_bytes(out)
    if header.codec is CodecId.NONE:
        if isinstance(stored, list):  # parts go straight to their place in out
            at = 0
            for part in stored:
                n = memoryview(part).nbytes
                dst[at : at + n] = part
                at += n
        elif _address(stored) != _address(dst):
            dst[:] = stored
        check_payload(header, dst)
        return header.checksum
    stored = joined(stored)  # codecs decode one buffer
    if _address(stored) == _address(dst):
        raise ValueError("a compressed payload cannot be decoded into its own buffer")
    try:
        codec_by_id(header.codec).decode(stored, layout_of(header), out.tensor)
    except CorruptChunk:
        raise
    except Exception as exc:  # a damaged payload must be a miss whatever it trips over
        name = header.codec.name.lower()
        raise CorruptChunk(f"{name} payload did not decode: {exc!r}") from None
    if header.codec.lossless:
        check_payload(header, dst)
        return header.checksum
    return None


def _address(data: memoryview | bytes) -> int:
    mv = memoryview(data)
    if not mv.nbytes:
        return 0
    return int(np.frombuffer(mv, dtype=np.uint8).ctypes.data)


# A lossless payload claiming more than this is verified piece by piece (bounded
# memory) rather than decoded whole like a read; below it both take the same path.
VERIFY_WHOLE_BYTES = 64 << 20


def verify_stored(
    header: ChunkHeader, stored: memoryview | bytes, max_nbytes: int | None = None
) -> None:
    """CorruptChunk unless stored passes the checks a read would make (a lossless
    payload is decoded to check the raw chunk's checksum); nothing is kept.

    The chunk's size comes from the header, which a damaged or forged file sets at
    will: a caller that knows the largest chunk it could have written (its pool's page
    size) passes it as max_nbytes, and a header over it fails without any decoding.
    Without one, a lossless payload over VERIFY_WHOLE_BYTES is decoded and hashed a
    piece at a time, so no buffer of the claimed size is ever allocated."""
    if max_nbytes is not None and header.nbytes > max_nbytes:
        raise CorruptChunk(
            f"header says {header.nbytes} bytes, more than a chunk here ({max_nbytes})"
        )
    check_stored(header, stored)
    if header.codec is CodecId.NONE:
        check_payload(header, stored)
    elif header.codec.lossless:
        name = header.codec.name.lower()
        codec = codec_by_id(header.codec)
        try:
            if header.nbytes <= VERIFY_WHOLE_BYTES:
                raw = codec.decode(stored, layout_of(header))
                check_payload(header, memoryview(raw.reshape(-1).view(torch.uint8).numpy()))
                return
            digest = xxhash.xxh3_64()
            for piece in codec.decoded_pieces(stored, layout_of(header)):
                digest.update(piece)
        except CorruptChunk:
            raise
        except Exception as exc:
            raise CorruptChunk(f"{name} payload did not decode: {exc!r}") from None
        if digest.intdigest() != header.checksum:
            raise CorruptChunk("payload checksum mismatch")

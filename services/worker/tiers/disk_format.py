"""The on-disk format of the L3 tier: one self-describing file per chunk.

A chunk file is a HEADER_SIZE (4096-byte) header followed by the payload, the chunk's
bytes exactly as they sit in memory. The header is padded to the disk block size so the
payload starts aligned and can be written and read with O_DIRECT. Every field is
little-endian at a fixed offset:

| offset | size | field |
|---:|---:|---|
| 0 | 8 | magic `b"KVMESHL3"` |
| 8 | 2 | format version (1) |
| 10 | 2 | header size (4096): where the payload starts |
| 12 | 2 | memory format (`MemoryFormat` value) |
| 14 | 2 | number of dimensions (at most 8) |
| 16 | 16 | dtype name, ASCII, zero-padded (`float16`, `bfloat16`, ...) |
| 32 | 64 | shape: 8 × u64, unused dimensions zero |
| 96 | 8 | payload length in bytes |
| 104 | 8 | xxh3-64 of the payload |
| 112 | 8 | when the chunk was written (ns since the epoch): the restart's eviction order |
| 120 | 8 | the key's namespace id (8 bytes; 16 hex chars in `ChunkKey`) |
| 128 | 16 | the key's chunk hash |
| 144 | 8 | xxh3-64 of bytes 0–143: a flipped bit anywhere in the header is caught |
| 152 | 3944 | zeros |

A file is valid only if the magic, version, header checksum, key (against the file
name and the index) and size (HEADER_SIZE + payload length) agree, and, when read,
the payload's checksum. Anything else is dropped: the cache never serves wrong KV.

File names derive from the key alone (`<ns id>-<hash hex>.kv`, see `ChunkKey.to_str`),
never from a user string. A write goes to a temporary name first (`.<key>.<run>.tmp`,
hidden and ending in `.tmp`) and is renamed into place, so a crash never leaves a
half-written file under a real name.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import struct
from collections.abc import Callable
from dataclasses import dataclass

import torch
import xxhash

from kvmesh.common.keys import ChunkKey
from kvmesh.common.memory import MemoryFormat

MAGIC = b"KVMESHL3"
VERSION = 1
HEADER_SIZE = 4096
MAX_DIMS = 8
CHUNK_SUFFIX = ".kv"
TEMP_SUFFIX = ".tmp"

# magic, version, header size, format, ndim, dtype, shape[8], payload length, payload
# checksum, written_ns, namespace id, chunk hash.
_BODY = struct.Struct("<8sHHHH16s8QQQQ8s16s")
_CHECK = struct.Struct("<Q")
HEADER_USED = _BODY.size + _CHECK.size  # 152

# The xxhash module holds the GIL for the whole call (about 0.1 ms per MiB), which would
# serialise the I/O threads' checksums and stall the engine's event loop. Called through
# ctypes, which lets go of the GIL, the same C function hashes on every core at once.
# Without it, a large payload is hashed in pieces so other threads run in between.
_CHECKSUM_PIECE = 1 << 20


class HeaderError(ValueError):
    """The bytes are not a valid chunk header; the message says which check failed."""


@dataclass(frozen=True, slots=True)
class ChunkHeader:
    """What a chunk file says about itself."""

    key: ChunkKey
    shape: tuple[int, ...]
    dtype: torch.dtype
    fmt: MemoryFormat
    payload_len: int
    checksum: int
    written_ns: int

    @property
    def file_size(self) -> int:
        return HEADER_SIZE + self.payload_len


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None) if name.isidentifier() else None
    if not isinstance(dtype, torch.dtype):
        raise HeaderError(f"unknown dtype {name!r}")
    return dtype


def _native_xxh3() -> Callable[[int, int], int] | None:
    """XXH3_64bits(address, length) through ctypes (no GIL held), if it can be found:
    exported by the xxhash module's own extension, or the system's libxxhash. Used only
    if it agrees with the xxhash module."""
    candidates = [getattr(getattr(xxhash, "_xxhash", None), "__file__", None)]
    candidates.append(ctypes.util.find_library("xxhash"))
    probe = bytes(range(256)) * 5
    for lib in filter(None, candidates):
        try:
            fn = ctypes.CDLL(lib).XXH3_64bits
        except (OSError, AttributeError):
            continue
        fn.restype = ctypes.c_uint64
        fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
        if fn(probe, len(probe)) == xxhash.xxh3_64_intdigest(probe):
            return fn
    return None


_xxh3_nogil = _native_xxh3()


def payload_checksum(data: memoryview | bytes) -> int:
    """xxh3-64 of data, without holding the GIL where possible (see _native_xxh3)."""
    if _xxh3_nogil is not None:
        if isinstance(data, bytes):
            return _xxh3_nogil(data, len(data))
        mv = memoryview(data).cast("B")
        if not mv.readonly and mv.contiguous:
            if not len(mv):
                return xxhash.xxh3_64_intdigest(b"")
            return _xxh3_nogil(ctypes.addressof(ctypes.c_char.from_buffer(mv)), len(mv))
    mv = memoryview(data).cast("B")
    n = len(mv)
    if n <= _CHECKSUM_PIECE:
        return xxhash.xxh3_64_intdigest(mv)
    h = xxhash.xxh3_64()
    for start in range(0, n, _CHECKSUM_PIECE):
        h.update(mv[start : start + _CHECKSUM_PIECE])
    return h.intdigest()


def pack_header(header: ChunkHeader, out: memoryview | bytearray | None = None) -> bytes | None:
    """The HEADER_SIZE bytes of header: written into out (zeroing its tail) when given,
    else returned."""
    shape = tuple(int(d) for d in header.shape)
    if len(shape) > MAX_DIMS:
        raise ValueError(f"a chunk has at most {MAX_DIMS} dimensions, got {len(shape)}")
    name = dtype_name(header.dtype).encode("ascii")
    if len(name) > 16:
        raise ValueError(f"dtype name too long for the header: {name!r}")
    body = _BODY.pack(
        MAGIC,
        VERSION,
        HEADER_SIZE,
        int(header.fmt),
        len(shape),
        name,
        *(shape + (0,) * (MAX_DIMS - len(shape))),
        header.payload_len,
        header.checksum,
        header.written_ns,
        bytes.fromhex(header.key.namespace_id),
        header.key.chunk_hash,
    )
    check = _CHECK.pack(xxhash.xxh3_64_intdigest(body))
    if out is None:
        return body + check + bytes(HEADER_SIZE - HEADER_USED)
    buf = memoryview(out).cast("B")
    buf[: _BODY.size] = body
    buf[_BODY.size : HEADER_USED] = check
    buf[HEADER_USED:HEADER_SIZE] = bytes(HEADER_SIZE - HEADER_USED)
    return None


def parse_header(data: bytes | memoryview) -> ChunkHeader:
    """The header at the start of data; HeaderError if any check fails."""
    mv = memoryview(data).cast("B")
    if len(mv) < HEADER_USED:
        raise HeaderError(f"file too short for a header ({len(mv)} bytes)")
    if bytes(mv[:8]) != MAGIC:
        raise HeaderError("bad magic: not a kvmesh chunk file")
    (stored_check,) = _CHECK.unpack_from(mv, _BODY.size)
    if xxhash.xxh3_64_intdigest(mv[: _BODY.size]) != stored_check:
        raise HeaderError("header checksum mismatch")
    fields = _BODY.unpack_from(mv)
    _magic, version, header_size, fmt, ndim, raw_dtype = fields[:6]
    dims = fields[6 : 6 + MAX_DIMS]
    payload_len, checksum, written_ns, ns_raw, chunk_hash = fields[6 + MAX_DIMS :]
    if version != VERSION:
        raise HeaderError(f"unsupported format version {version}")
    if header_size != HEADER_SIZE:
        raise HeaderError(f"unexpected header size {header_size}")
    try:
        mem_fmt = MemoryFormat(fmt)
    except ValueError:
        raise HeaderError(f"unknown memory format {fmt}") from None
    if ndim > MAX_DIMS:
        raise HeaderError(f"too many dimensions ({ndim})")
    try:
        dtype = dtype_from_name(raw_dtype.rstrip(b"\0").decode("ascii"))
    except UnicodeDecodeError:
        raise HeaderError("dtype name is not ASCII") from None
    shape = tuple(dims[:ndim])
    expected = dtype.itemsize
    for d in shape:
        expected *= d
    if expected != payload_len:
        raise HeaderError(
            f"payload length {payload_len} does not match shape {shape} of {dtype_name(dtype)}"
        )
    key = ChunkKey(ns_raw.hex(), chunk_hash)
    return ChunkHeader(key, shape, dtype, mem_fmt, payload_len, checksum, written_ns)


# -- file names ---------------------------------------------------------------------------


def chunk_file_name(key: ChunkKey) -> str:
    return key.to_str() + CHUNK_SUFFIX


def temp_file_name(key: ChunkKey, run_id: str) -> str:
    return f".{key.to_str()}.{run_id}{TEMP_SUFFIX}"


def key_of_file_name(name: str) -> ChunkKey | None:
    """The key a chunk file's name stands for, or None if it is not one."""
    if not name.endswith(CHUNK_SUFFIX):
        return None
    try:
        return ChunkKey.from_str(name[: -len(CHUNK_SUFFIX)])
    except ValueError:
        return None


def is_temp_file_name(name: str) -> bool:
    return name.startswith(".") and name.endswith(TEMP_SUFFIX)

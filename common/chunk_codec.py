"""A chunk as self-checking bytes: the header that goes with a chunk's payload wherever
it leaves memory, the payload's xxh3 checksum, and the checks a reader makes.

One `ChunkHeader` (key, shape, dtype, memory format, length, checksum) is laid out two
ways, both little-endian at fixed offsets and ending in the xxh3-64 of the bytes before
it, so a flipped bit anywhere in the header is caught:

`FILE_LAYOUT`: a disk tier chunk file and an `fs://` remote file (4096 bytes, padded
with zeros so the payload after it starts block-aligned for O_DIRECT):

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
| 144 | 8 | xxh3-64 of bytes 0–143 |
| 152 | 3944 | zeros |

A compressed chunk's file is version 2: the same fields, then at 144 the codec (u16,
as in the value layout) and at 146 the stored (compressed) payload length (u64), the
header checksum at 154 over bytes 0–153, zeros from 162.

`VALUE_LAYOUT`: a value in a remote store (144 bytes; the cache-server keeps it as the
value's meta, Redis in front of the payload):

| offset | size | field |
|---:|---:|---|
| 0 | 4 | magic `b"KVMR"` |
| 4 | 1 | version (1) |
| 5 | 1 | codec: 0 none, 1 zstd, 2 lz4, 3 cachegen (`Codec`) |
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

A reader parses the header (magic, header checksum, version, known codec and format,
shape × dtype = length), checks that the key is the one asked for (`check_key`) and
that the uncompressed payload has the header's length and checksum (`check_payload`).
The checksum is of the raw chunk, except under a lossy codec (cachegen), whose decoded
bytes differ from the raw ones: there it is of the stored payload, checked before
decoding (`check_stored`; common/codecs/stored.py decodes). Any failure is
`CorruptChunk`: the chunk is dropped and the read is a miss, never
wrong KV.
"""

from __future__ import annotations

import ctypes
import os
import struct
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import TypeAlias

import torch
import xxhash

from kvmesh.common import xxh3_native
from kvmesh.common.keys import ChunkKey
from kvmesh.common.memory import MemoryFormat, MemoryObj
from kvmesh.common.thread_jobs import LazyPool, map_all_async

# A stored payload as read back: one buffer, or its parts in order (a cache-server
# value received in several frames).
Payload: TypeAlias = memoryview | bytes | list[memoryview]

MAX_DIMS = 8
_DTYPE_BYTES = 16
_CHECK = struct.Struct("<Q")

# Checksums run on I/O and worker threads, so they must not hold the GIL. Called through
# ctypes the C function lets go of it whatever the xxhash release does; xxhash 4.1.0's
# own call lets go of it too on large inputs (measured 2026-11-26: a Python thread kept
# its full rate during a 256 MiB xxh3_64_intdigest), which the cache-server relies on
# (services/cacheserver/store.py). Without the C symbol, a large payload is hashed in
# pieces so other threads run in between whatever the module does.
_CHECKSUM_PIECE = 1 << 20


class CorruptChunk(ValueError):
    """Stored chunk bytes failed a check; the message says which."""


class Codec(IntEnum):
    """How a payload is compressed (the headers' codec field; common/codecs/ holds the
    codecs). Stable values: append, never renumber."""

    NONE = 0
    ZSTD = 1
    LZ4 = 2
    CACHEGEN = 3

    @property
    def lossless(self) -> bool:
        """Whether decoding gives back the raw bytes; a lossy codec's header checksum
        covers the stored payload instead (`check_stored`)."""
        return self is not Codec.CACHEGEN


CODECS = {"none": Codec.NONE, "zstd": Codec.ZSTD, "lz4": Codec.LZ4, "cachegen": Codec.CACHEGEN}


# -- checksum ---------------------------------------------------------------------------


def _native_xxh3() -> Callable[[int | bytes, int], int] | None:
    """XXH3_64bits(address, length) through ctypes (no GIL held), if it can be found
    (common/xxh3_native.py). Used only if it agrees with the xxhash module."""
    probe = bytes(range(256)) * 5
    for fn in xxh3_native.symbols("XXH3_64bits"):
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


_summing_lock = threading.Lock()
_summing: dict[int, threading.Event] = {}  # id(obj) → set once obj.checksum is written


def raw_checksum(obj: MemoryObj) -> int:
    """The xxh3-64 of obj's bytes, computed once and kept in `obj.checksum` (a stored
    chunk's bytes never change). The disk and remote tiers take a new chunk on their
    own threads at the same moment: the second to ask waits for the first one's hash
    instead of reading every byte again."""
    while True:
        known = obj.checksum
        if known is not None:
            return known
        with _summing_lock:
            if obj.checksum is not None:
                continue
            busy = _summing.get(id(obj))
            if busy is None:
                busy = _summing[id(obj)] = threading.Event()
                mine = True
            else:
                mine = False
        if not mine:
            busy.wait()  # then read what the other thread kept (or hash it here)
            continue
        try:
            checksum = obj.checksum = payload_checksum(chunk_bytes(obj))
            return checksum
        finally:
            with _summing_lock:
                del _summing[id(obj)]
            busy.set()


# Below this many bytes per batch, hashing on one more thread does not pay.
_PARALLEL_HASH_BYTES = 16 << 20
# As many threads as asyncio's default executor: a call uses at most one per core, so
# a small call (a pin's few chunks) starts at once beside a large one instead of
# waiting for a whole batch of it (126-206 ms measured with one thread per core).
_hash_pool = LazyPool(lambda: min(32, (os.cpu_count() or 1) + 4), "kvmesh-hash")


async def chunk_checksums(objs: Sequence[MemoryObj], max_threads: int = 0) -> list[int]:
    """The xxh3-64 of each chunk, off the event loop: in one batch per core (or per
    `max_threads`, when given), side by side (the native hash drops the GIL), so
    verifying a transfer costs about its bytes over the cores rather than over one;
    small transfers stay in one batch, where a thread hop costs more than it saves."""
    if not objs:
        return []
    total = sum(o.nbytes for o in objs)
    threads = os.cpu_count() or 1
    if max_threads > 0:
        threads = min(threads, max_threads)
    batches = max(1, min(threads, len(objs), total // _PARALLEL_HASH_BYTES))
    size = -(-len(objs) // batches)
    parts = [objs[i : i + size] for i in range(0, len(objs), size)]

    def run(part: Sequence[MemoryObj]) -> list[int]:
        return [payload_checksum(chunk_bytes(o)) for o in part]

    # Every batch has ended before this returns or raises, cancelled or not: the native
    # hash reads the pages by address, and a caller handed an error (or cancelled)
    # frees them next; a batch still reading then reads freed memory (a pool closed
    # under it faults).
    sums = await map_all_async(_hash_pool.get(), run, parts)
    return [s for part in sums for s in part]


def chunk_bytes(obj: MemoryObj) -> memoryview:
    """A writable byte view of obj's bytes (no copy); valid while a reference is held."""
    return memoryview((ctypes.c_char * obj.nbytes).from_address(obj.data_ptr)).cast("B")


# -- the header -------------------------------------------------------------------------


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """The torch dtype called name; CorruptChunk if there is none."""
    dtype = getattr(torch, name, None) if name.isidentifier() else None
    if not isinstance(dtype, torch.dtype):
        raise CorruptChunk(f"unknown dtype {name!r}")
    return dtype


@dataclass(frozen=True, slots=True)
class ChunkHeader:
    """What stored chunk bytes say about themselves."""

    key: ChunkKey
    shape: tuple[int, ...]
    dtype: torch.dtype
    fmt: MemoryFormat
    nbytes: int  # the chunk's bytes, uncompressed
    checksum: int  # xxh3-64 of those nbytes bytes
    codec: Codec = Codec.NONE
    stored_nbytes: int | None = None  # the payload as stored; None: nbytes (uncompressed)
    written_ns: int = 0  # when it was written; only FILE_LAYOUT keeps it

    def __post_init__(self) -> None:
        # Normalised so a header equals its own parse whichever way it was built.
        if self.stored_nbytes is None:
            object.__setattr__(self, "stored_nbytes", self.nbytes)


def describe(
    key: ChunkKey, obj: MemoryObj, checksum: int | None = None, *, written_ns: int = 0
) -> ChunkHeader:
    """The uncompressed header of obj's bytes under key. checksum, when the caller
    already has it (`MemoryObj.checksum`), spares hashing the bytes again."""
    if checksum is None:
        checksum = raw_checksum(obj)
    return ChunkHeader(
        key,
        tuple(int(d) for d in obj.shape),
        obj.dtype,
        MemoryFormat(obj.fmt),
        obj.nbytes,
        checksum,
        written_ns=written_ns,
    )


class HeaderLayout:
    """One byte layout of a ChunkHeader: named fields in struct order, then the xxh3-64
    of them, then zeros up to size. Fields a layout lacks are not stored: a missing
    `written_ns` reads back as 0, and a layout without `codec` holds uncompressed
    chunks only."""

    def __init__(
        self,
        what: str,
        magic: bytes,
        fields: Sequence[tuple[str, str]],
        size: int = 0,
        version: int = 1,
    ) -> None:
        self.what = what
        self.magic = magic
        self.version = version
        self._names = tuple(name for name, _ in fields)
        self._body = struct.Struct("<" + "".join(code for _, code in fields))
        # Where each field sits in the unpacked tuple (the shape spans MAX_DIMS items).
        self._at: dict[str, int] = {}
        i = 0
        for name, _ in fields:
            self._at[name] = i
            i += MAX_DIMS if name == "shape" else 1
        self.used = self._body.size + _CHECK.size
        self.size = size or self.used
        if self.size < self.used:
            raise ValueError(f"{what}: a header of {self.used} bytes does not fit in {size}")
        self._zeros = bytes(self.size - self.used)

    def total_size(self, header: ChunkHeader) -> int:
        """Bytes of header and payload together."""
        assert header.stored_nbytes is not None
        return self.size + header.stored_nbytes

    def pack(self, header: ChunkHeader) -> bytes:
        """The size bytes of header."""
        body, check = self._body_and_check(header)
        return body + check + self._zeros

    def pack_into(self, header: ChunkHeader, out: memoryview | bytearray) -> None:
        """pack(header) written into the start of out, without allocating its padding."""
        body, check = self._body_and_check(header)
        buf = memoryview(out).cast("B")
        buf[: self._body.size] = body
        buf[self._body.size : self.used] = check
        buf[self.used : self.size] = self._zeros

    def _body_and_check(self, header: ChunkHeader) -> tuple[bytes, bytes]:
        shape = tuple(int(d) for d in header.shape)
        if len(shape) > MAX_DIMS:
            raise ValueError(f"a chunk has at most {MAX_DIMS} dimensions, got {len(shape)}")
        name = dtype_name(header.dtype).encode("ascii")
        if len(name) > _DTYPE_BYTES:
            raise ValueError(f"dtype name too long for the header: {name!r}")
        if header.codec is not Codec.NONE and "codec" not in self._at:
            raise ValueError(f"a {self.what} holds uncompressed chunks only")
        values = {
            "magic": self.magic,
            "version": self.version,
            "header_size": self.size,
            "codec": int(header.codec),
            "fmt": int(header.fmt),
            "ndim": len(shape),
            "dtype": name,
            "nbytes": header.nbytes,
            "stored_nbytes": header.stored_nbytes,
            "checksum": header.checksum,
            "written_ns": header.written_ns,
            "namespace": bytes.fromhex(header.key.namespace_id),
            "chunk_hash": header.key.chunk_hash,
        }
        args: list[object] = []
        for field in self._names:
            if field == "shape":
                args.extend(shape + (0,) * (MAX_DIMS - len(shape)))
            else:
                args.append(values[field])
        body = self._body.pack(*args)
        return body, _CHECK.pack(xxhash.xxh3_64_intdigest(body))

    def parse(self, data: bytes | memoryview) -> ChunkHeader:
        """The header at the start of data; CorruptChunk if any check fails."""
        mv = memoryview(data).cast("B")
        if len(mv) < self.used:
            raise CorruptChunk(f"{self.what} too short for a header ({len(mv)} bytes)")
        if bytes(mv[: len(self.magic)]) != self.magic:
            raise CorruptChunk(f"bad magic: not a kvmesh {self.what}")
        (stored_check,) = _CHECK.unpack_from(mv, self._body.size)
        if xxhash.xxh3_64_intdigest(mv[: self._body.size]) != stored_check:
            raise CorruptChunk("header checksum mismatch")
        fields = self._body.unpack_from(mv)
        at = self._at

        def field(name: str, default: int = 0) -> int:
            return fields[at[name]] if name in at else default

        version = field("version")
        if version != self.version:
            raise CorruptChunk(f"unsupported {self.what} version {version}")
        if "header_size" in at and field("header_size") != self.size:
            raise CorruptChunk(f"unexpected header size {field('header_size')}")
        try:
            codec = Codec(field("codec"))
        except ValueError:
            raise CorruptChunk(f"unknown codec {field('codec')}") from None
        try:
            fmt = MemoryFormat(field("fmt"))
        except ValueError:
            raise CorruptChunk(f"unknown memory format {field('fmt')}") from None
        ndim = field("ndim")
        if ndim > MAX_DIMS:
            raise CorruptChunk(f"too many dimensions ({ndim})")
        try:
            dtype = dtype_from_name(fields[at["dtype"]].rstrip(b"\0").decode("ascii"))
        except UnicodeDecodeError:
            raise CorruptChunk("dtype name is not ASCII") from None
        shape = tuple(fields[at["shape"] : at["shape"] + ndim])
        nbytes = field("nbytes")
        expected = dtype.itemsize
        for d in shape:
            expected *= d
        if expected != nbytes:
            raise CorruptChunk(
                f"payload length {nbytes} does not match shape {shape} of {dtype_name(dtype)}"
            )
        stored_nbytes = field("stored_nbytes", nbytes)
        if codec is Codec.NONE and stored_nbytes != nbytes:
            raise CorruptChunk("uncompressed chunk whose stored length differs from its length")
        key = ChunkKey(fields[at["namespace"]].hex(), fields[at["chunk_hash"]])
        return ChunkHeader(
            key,
            shape,
            dtype,
            fmt,
            nbytes,
            field("checksum"),
            codec,
            stored_nbytes,
            field("written_ns"),
        )


_FILE_FIELDS = (
    ("magic", "8s"),
    ("version", "H"),
    ("header_size", "H"),
    ("fmt", "H"),
    ("ndim", "H"),
    ("dtype", f"{_DTYPE_BYTES}s"),
    ("shape", f"{MAX_DIMS}Q"),
    ("nbytes", "Q"),
    ("checksum", "Q"),
    ("written_ns", "Q"),
    ("namespace", "8s"),
    ("chunk_hash", "16s"),
)
FILE_LAYOUT_V1 = HeaderLayout("chunk file", b"KVMESHL3", _FILE_FIELDS, size=4096)
# Version 2 appends the codec and the stored length (the padding had room); an
# uncompressed chunk is still written as version 1, byte for byte as before.
FILE_LAYOUT_V2 = HeaderLayout(
    "chunk file",
    b"KVMESHL3",
    (*_FILE_FIELDS, ("codec", "H"), ("stored_nbytes", "Q")),
    size=4096,
    version=2,
)
_FILE_VERSION = struct.Struct("<8sH")


class _FileLayout:
    """FILE_LAYOUT: version 1 for uncompressed chunks, version 2 for compressed ones;
    a reader takes either."""

    what = FILE_LAYOUT_V1.what
    magic = FILE_LAYOUT_V1.magic
    size = FILE_LAYOUT_V1.size
    used = FILE_LAYOUT_V1.used

    def _for(self, header: ChunkHeader) -> HeaderLayout:
        return FILE_LAYOUT_V1 if header.codec is Codec.NONE else FILE_LAYOUT_V2

    def total_size(self, header: ChunkHeader) -> int:
        return FILE_LAYOUT_V1.total_size(header)

    def pack(self, header: ChunkHeader) -> bytes:
        return self._for(header).pack(header)

    def pack_into(self, header: ChunkHeader, out: memoryview | bytearray) -> None:
        self._for(header).pack_into(header, out)

    def parse(self, data: bytes | memoryview) -> ChunkHeader:
        mv = memoryview(data).cast("B")
        if len(mv) >= _FILE_VERSION.size and _FILE_VERSION.unpack_from(mv)[1] == 2:
            header = FILE_LAYOUT_V2.parse(mv)
            # A compressed file is always smaller than the chunk (a writer stores the
            # raw bytes otherwise), which is how the disk tier tells the two apart.
            assert header.stored_nbytes is not None
            if header.codec is Codec.NONE or header.stored_nbytes >= header.nbytes:
                raise CorruptChunk("version 2 chunk file that is not compressed")
            return header
        return FILE_LAYOUT_V1.parse(mv)


FILE_LAYOUT = _FileLayout()

VALUE_LAYOUT = HeaderLayout(
    "remote value",
    b"KVMR",
    (
        ("magic", "4s"),
        ("version", "B"),
        ("codec", "B"),
        ("fmt", "B"),
        ("ndim", "B"),
        ("dtype", f"{_DTYPE_BYTES}s"),
        ("shape", f"{MAX_DIMS}Q"),
        ("nbytes", "Q"),
        ("stored_nbytes", "Q"),
        ("checksum", "Q"),
        ("namespace", "8s"),
        ("chunk_hash", "16s"),
    ),
)


# -- the checks after the header --------------------------------------------------------


def check_key(header: ChunkHeader, key: ChunkKey) -> None:
    """CorruptChunk unless header names key: a chunk stored under one key but holding
    another's bytes (a misplaced file, a colliding remote name) is never served."""
    if header.key != key:
        raise CorruptChunk(f"holds another key ({header.key.to_str()}, not {key.to_str()})")


def check_stored(header: ChunkHeader, data: Payload) -> None:
    """CorruptChunk unless data, the payload as stored, has the header's stored length
    and, under a lossy codec, its checksum (a lossless payload is checked after
    decoding, by check_payload)."""
    n = payload_nbytes(data)
    if n != header.stored_nbytes:
        raise CorruptChunk(f"stored payload of {n} bytes, header says {header.stored_nbytes}")
    if not header.codec.lossless and payload_checksum(joined(data)) != header.checksum:
        raise CorruptChunk("stored payload checksum mismatch")


def payload_nbytes(data: Payload) -> int:
    if isinstance(data, list):
        return sum(memoryview(part).nbytes for part in data)
    return memoryview(data).nbytes


def joined(data: Payload) -> memoryview | bytes:
    """One buffer: data itself, or its parts copied into one."""
    if isinstance(data, list):
        return data[0] if len(data) == 1 else b"".join(data)
    return data


def check_payload(header: ChunkHeader, data: memoryview | bytes) -> None:
    """CorruptChunk unless data (uncompressed) has the header's length and checksum."""
    n = memoryview(data).nbytes
    if n != header.nbytes:
        raise CorruptChunk(f"payload of {n} bytes, header says {header.nbytes}")
    if payload_checksum(data) != header.checksum:
        raise CorruptChunk("payload checksum mismatch")

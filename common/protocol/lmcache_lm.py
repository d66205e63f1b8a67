"""LMCache's `lm://` remote-server wire format (as LMCache 0.5.6 speaks it).

Plain TCP, one persistent connection per client, requests answered in order. All
integers are int32 in native byte order (little-endian on x86), packed without padding.

- Request header (186 bytes): command, length, fmt, dtype, location, shape0..3, then
  the key as 150 bytes of UTF-8 right-padded with spaces.
- Reply header (36 bytes): code, length, fmt, dtype, shape0..3, location (location is
  last here, fifth in the request).
- PUT: header then `length` payload bytes; no reply. GET: reply header (200 with the
  stored length/fmt/dtype/shape, then the payload; or 400 and length 0). EXIST: reply
  header only, 200 or 400. HEALTH: reply header, 200. LIST: the reference server never
  answers it.

Only the framing lives here; what is stored is up to the server.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import IntEnum

KEY_BYTES = 150
_REQUEST = struct.Struct(f"=9i{KEY_BYTES}s")
_REPLY = struct.Struct("=9i")
REQUEST_SIZE = _REQUEST.size  # 186
REPLY_SIZE = _REPLY.size  # 36
# The metadata kept with a stored value: fmt, dtype, shape0..3, location.
_META = struct.Struct("=7i")

INT32_MAX = 2**31 - 1


class Command(IntEnum):
    PUT = 1
    GET = 2
    EXIST = 3
    LIST = 4
    HEALTH = 5


class Code(IntEnum):
    SUCCESS = 200
    FAIL = 400


class LmFrameError(ValueError):
    """A request header that cannot be valid (the connection should be closed)."""


@dataclass(frozen=True, slots=True)
class LmRequest:
    command: int
    length: int
    fmt: int
    dtype: int
    location: int
    shape: tuple[int, int, int, int]
    key: str

    def pack(self) -> bytes:
        raw = self.key.encode("utf-8")
        if len(raw) > KEY_BYTES:
            raise ValueError(f"lm:// keys are at most {KEY_BYTES} bytes, got {len(raw)}")
        return _REQUEST.pack(
            self.command,
            self.length,
            self.fmt,
            self.dtype,
            self.location,
            *self.shape,
            raw.ljust(KEY_BYTES, b" "),
        )


@dataclass(frozen=True, slots=True)
class LmReply:
    code: int
    length: int = 0
    fmt: int = 1
    dtype: int = 2
    shape: tuple[int, int, int, int] = (0, 0, 0, 0)
    location: int = 0

    def pack(self) -> bytes:
        return _REPLY.pack(self.code, self.length, self.fmt, self.dtype, *self.shape, self.location)

    def meta(self) -> bytes:
        return _META.pack(self.fmt, self.dtype, *self.shape, self.location)


def parse_request(data: bytes | bytearray | memoryview) -> LmRequest:
    """The request in the first REQUEST_SIZE bytes; LmFrameError when the length is
    negative or the key is empty or not UTF-8 (the command is checked by the caller,
    which knows what it serves)."""
    fields = _REQUEST.unpack_from(data)
    command, length, fmt, dtype, location = fields[:5]
    shape = tuple(fields[5:9])
    raw_key = fields[9].rstrip(b" ")
    if length < 0:
        raise LmFrameError(f"negative payload length {length}")
    try:
        key = raw_key.decode("utf-8")
    except UnicodeDecodeError:
        raise LmFrameError("key is not UTF-8") from None
    if not key or not key.isprintable():
        raise LmFrameError("empty key or a key with control characters")
    return LmRequest(command, length, fmt, dtype, location, shape, key)  # type: ignore[arg-type]


def parse_reply(data: bytes | bytearray | memoryview) -> LmReply:
    code, length, fmt, dtype, s0, s1, s2, s3, location = _REPLY.unpack_from(data)
    return LmReply(code, length, fmt, dtype, (s0, s1, s2, s3), location)


def reply_from_meta(meta: bytes, length: int) -> LmReply:
    """The success reply of a GET for a value stored with `LmReply.meta()`."""
    fmt, dtype, s0, s1, s2, s3, location = _META.unpack(meta)
    return LmReply(int(Code.SUCCESS), length, fmt, dtype, (s0, s1, s2, s3), location)


def meta_of(request: LmRequest) -> bytes:
    """What a PUT's header says about its value, kept with the value for GETs."""
    return _META.pack(request.fmt, request.dtype, *request.shape, request.location)


META_SIZE = _META.size
FAIL = LmReply(int(Code.FAIL))
SUCCESS = LmReply(int(Code.SUCCESS))

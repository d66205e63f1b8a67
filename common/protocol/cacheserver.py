"""The cache-server's wire protocol (version 1): msgspec headers plus raw value frames.

Every message is a ZMQ multipart `[header, *values]`. The header is one of the tagged,
array-like Structs below, encoded as msgpack; the values are raw bytes frames (sent
and received without a copy). A client talks to the server's ROUTER through a DEALER
socket, so the server sees `[routing id, header, *values]`.

- A session starts with `Hello`; the server answers `HelloReply` (its version and
  limits) or `ErrorReply(VERSION_MISMATCH)`. Any other request before a hello gets
  `ErrorReply(NO_HELLO)`, which is retryable: a client that reconnected (and so has a
  new routing id) says hello again.
- Every request carries `rid`, a client-chosen id the reply echoes, so one connection
  can have many requests in flight (replies may come back in any order).
- Every reply is the matching `...Reply` or an `ErrorReply(rid, code, message,
  retryable)`; a header that does not decode gets `ErrorReply` with `rid` 0 unless
  the id could still be read.
- Values: `PutValue` is followed by exactly one value frame; `PutValues` by one frame
  per key. `GetValueReply` is followed by the value when `found`; `GetValuesReply` by
  one frame per found key, in key order. `meta` is a small opaque blob stored with a
  value and returned with it (the worker's remote tier keeps its chunk header there).
- `checksum` is xxh3-64 of the value. The server computes it on every put, rejects a
  put whose client-given checksum differs, keeps it with the value and returns it on
  every get, so readers can check the bytes end to end.

Evolution: fields are only appended, with defaults; new messages get new tags; a
change of meaning bumps PROTOCOL_VERSION.
"""

from __future__ import annotations

from enum import IntEnum

import msgspec

PROTOCOL_VERSION = 1
MAX_KEY_BYTES = 512
MAX_META_BYTES = 4096
MAX_BATCH = 4096
MAX_LIST_LIMIT = 10_000


class ErrorCode(IntEnum):
    """Why a request failed. Values travel on the wire: append, never renumber."""

    BAD_MESSAGE = 1
    UNKNOWN_MESSAGE = 2
    VERSION_MISMATCH = 3
    NO_HELLO = 4
    TOO_MANY_CONNECTIONS = 5
    VALUE_TOO_LARGE = 6
    BAD_KEY = 7
    BAD_FRAMES = 8
    CHECKSUM_MISMATCH = 9
    BATCH_TOO_LARGE = 10
    INTERNAL = 11
    SHUTTING_DOWN = 12


# Codes a client may retry after doing something about them (hello again, back off).
RETRYABLE = frozenset({ErrorCode.NO_HELLO, ErrorCode.TOO_MANY_CONNECTIONS, ErrorCode.SHUTTING_DOWN})


class _Msg(msgspec.Struct, tag=True, frozen=True, array_like=True, gc=False):
    """Base of every header: tagged (the tag is the first array element)."""


# -- requests ----------------------------------------------------------------------------


class Hello(_Msg, tag="hello"):
    rid: int
    version: int
    client: str = ""


class PutValue(_Msg, tag="put"):
    rid: int
    key: str
    meta: bytes = b""
    checksum: int | None = None


class GetValue(_Msg, tag="get"):
    rid: int
    key: str


class CheckValue(_Msg, tag="exists"):
    rid: int
    key: str


class DeleteValue(_Msg, tag="delete"):
    rid: int
    key: str


class PutValues(_Msg, tag="mput"):
    rid: int
    keys: list[str]
    metas: list[bytes] = []
    # Empty, or one per key (None where the client gives none).
    checksums: list[int | None] = []


class GetValues(_Msg, tag="mget"):
    rid: int
    keys: list[str]


class CheckValues(_Msg, tag="mexists"):
    rid: int
    keys: list[str]


class DeleteValues(_Msg, tag="mdelete"):
    rid: int
    keys: list[str]


class ListKeys(_Msg, tag="list"):
    """One page of keys starting with prefix; cursor "" starts, and the reply's cursor
    continues (empty when done). Every key present for the whole listing is returned
    exactly once; keys added or removed meanwhile may or may not be."""

    rid: int
    prefix: str = ""
    cursor: str = ""
    limit: int = 1000


class GetStats(_Msg, tag="stats"):
    rid: int


class CheckHealth(_Msg, tag="health"):
    rid: int


Request = (
    Hello
    | PutValue
    | GetValue
    | CheckValue
    | DeleteValue
    | PutValues
    | GetValues
    | CheckValues
    | DeleteValues
    | ListKeys
    | GetStats
    | CheckHealth
)

# -- replies -----------------------------------------------------------------------------


class HelloReply(_Msg, tag="hello_r"):
    rid: int
    version: int
    server: str
    max_value_size: int
    max_batch: int = MAX_BATCH


class PutValueReply(_Msg, tag="put_r"):
    rid: int
    checksum: int = 0


class GetValueReply(_Msg, tag="get_r"):
    rid: int
    found: bool
    meta: bytes = b""
    checksum: int = 0


class CheckValueReply(_Msg, tag="exists_r"):
    rid: int
    found: bool


class DeleteValueReply(_Msg, tag="delete_r"):
    rid: int
    deleted: bool


class PutValuesReply(_Msg, tag="mput_r"):
    rid: int
    # One per key: 0 stored, else the ErrorCode that key failed with.
    errors: list[int]


class GetValuesReply(_Msg, tag="mget_r"):
    rid: int
    found: list[bool]
    # One per key (empty bytes and 0 where not found).
    metas: list[bytes]
    checksums: list[int]


class CheckValuesReply(_Msg, tag="mexists_r"):
    rid: int
    found: list[bool]


class DeleteValuesReply(_Msg, tag="mdelete_r"):
    rid: int
    deleted: list[bool]


class ListKeysReply(_Msg, tag="list_r"):
    rid: int
    keys: list[str]
    cursor: str


class GetStatsReply(_Msg, tag="stats_r"):
    rid: int
    keys: int
    memory_bytes: int
    max_memory: int
    spilled_keys: int
    spilled_bytes: int
    hits: int
    misses: int
    evictions: int
    connections: int
    uptime_s: float


class CheckHealthReply(_Msg, tag="health_r"):
    rid: int
    ok: bool
    version: int = PROTOCOL_VERSION
    uptime_s: float = 0.0


class ErrorReply(_Msg, tag="error"):
    rid: int
    code: int
    message: str
    retryable: bool = False


Reply = (
    HelloReply
    | PutValueReply
    | GetValueReply
    | CheckValueReply
    | DeleteValueReply
    | PutValuesReply
    | GetValuesReply
    | CheckValuesReply
    | DeleteValuesReply
    | ListKeysReply
    | GetStatsReply
    | CheckHealthReply
    | ErrorReply
)

REQUEST_TAGS = frozenset(t.__struct_config__.tag for t in Request.__args__)

# One encoder and one decoder per direction, built once (msgspec's advice).
encoder = msgspec.msgpack.Encoder()
request_decoder = msgspec.msgpack.Decoder(Request)
reply_decoder = msgspec.msgpack.Decoder(Reply)
_raw_decoder = msgspec.msgpack.Decoder()


def error_for(exc: Exception, raw: bytes | memoryview) -> ErrorReply:
    """The ErrorReply for a header that failed to decode: UNKNOWN_MESSAGE when it is a
    well-formed message of a tag this version does not know, BAD_MESSAGE otherwise.
    The request id is echoed when it can still be read."""
    rid, code = 0, ErrorCode.BAD_MESSAGE
    try:
        arr = _raw_decoder.decode(raw)
    except (msgspec.DecodeError, ValueError):  # ValueError: invalid UTF-8 in a str
        arr = None
    if isinstance(arr, list) and arr:
        if len(arr) > 1 and isinstance(arr[1], int) and not isinstance(arr[1], bool):
            rid = arr[1] if 0 <= arr[1] < 2**63 else 0
        if isinstance(arr[0], str) and arr[0] not in REQUEST_TAGS:
            code = ErrorCode.UNKNOWN_MESSAGE
    what = "unknown message type" if code is ErrorCode.UNKNOWN_MESSAGE else "bad message"
    return ErrorReply(rid, int(code), f"{what}: {exc}"[:300])


def valid_key(key: str) -> bool:
    """Keys are non-empty, at most MAX_KEY_BYTES of UTF-8, with no control characters."""
    if not key or len(key) > MAX_KEY_BYTES:
        return False
    if len(key.encode("utf-8", "surrogatepass")) > MAX_KEY_BYTES:
        return False
    return key.isprintable()

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
- Large values in parts: a client that says `value_part_bytes = P` in its hello gets a
  found value longer than P as several consecutive frames of at most P bytes each (the
  reply's `parts` says how many; `GetValuesReply.parts` one count per found key, empty
  when every value is one frame). A receiver then never needs one huge allocation per
  value: libzmq mallocs each received frame, and glibc maps every allocation above
  its largest dynamic threshold (32 MiB) afresh, faulting in each page. A client that
  says nothing (0) gets every value as one frame.
- Data connections: a `HelloReply` with `data_port` > 0 offers gets over a plain TCP
  stream beside this socket (common/protocol/cacheserver_data.py), opened with its
  `data_token`; 0 (an older server, CURVE on, or `data_enabled: false`) offers none.
- `checksum` is xxh3-64 of the value. The server computes it on every put, rejects a
  put whose client-given checksum differs, keeps it with the value and returns it on
  every get, so readers can check the bytes end to end.

Evolution: fields are only appended, with defaults; new messages get new tags; a
change of meaning bumps PROTOCOL_VERSION.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Annotated

import msgspec

from kvmesh.common.protocol import wire

PROTOCOL_VERSION = 1
MAX_KEY_BYTES = 512
MAX_META_BYTES = 4096
MAX_BATCH = 4096
MAX_LIST_LIMIT = 10_000
MIN_PART_BYTES = 1 << 20
MAX_CLIENT_NAME = 256

# A request's lists are bounded where they are decoded: a header of millions of tiny keys
# (a frame may hold up to max_value_size) would otherwise cost seconds of the server's
# loop and gigabytes before the batch rule refused it.
Keys = Annotated[list[str], msgspec.Meta(max_length=MAX_BATCH)]
Metas = Annotated[list[bytes], msgspec.Meta(max_length=MAX_BATCH)]
Checksums = Annotated[list[int | None], msgspec.Meta(max_length=MAX_BATCH)]


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


# -- requests ----------------------------------------------------------------------------


class Hello(wire.Message, tag="hello"):
    rid: int
    version: int
    client: Annotated[str, msgspec.Meta(max_length=MAX_CLIENT_NAME)] = ""
    # 0: values come back as one frame each; else in parts of at most this many bytes
    # (the server raises anything below MIN_PART_BYTES to it).
    value_part_bytes: int = 0


class PutValue(wire.Message, tag="put"):
    rid: int
    key: str
    meta: bytes = b""
    checksum: int | None = None


class GetValue(wire.Message, tag="get"):
    rid: int
    key: str


class CheckValue(wire.Message, tag="exists"):
    rid: int
    key: str


class DeleteValue(wire.Message, tag="delete"):
    rid: int
    key: str


class PutValues(wire.Message, tag="mput"):
    rid: int
    keys: Keys
    metas: Metas = []
    # Empty, or one per key (None where the client gives none).
    checksums: Checksums = []


class GetValues(wire.Message, tag="mget"):
    rid: int
    keys: Keys


class CheckValues(wire.Message, tag="mexists"):
    rid: int
    keys: Keys


class DeleteValues(wire.Message, tag="mdelete"):
    rid: int
    keys: Keys


class ListKeys(wire.Message, tag="list"):
    """One page of keys starting with prefix; cursor "" starts, and the reply's cursor
    continues (empty when done). Every key present for the whole listing is returned
    exactly once; keys added or removed meanwhile may or may not be. A page may hold
    fewer than limit keys, none even, before the end: the server looks at a bounded
    number of keys per page."""

    rid: int
    prefix: str = ""
    cursor: str = ""
    limit: int = 1000


class GetStats(wire.Message, tag="stats"):
    rid: int


class CheckHealth(wire.Message, tag="health"):
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


class HelloReply(wire.Message, tag="hello_r"):
    rid: int
    version: int
    server: str
    max_value_size: int
    max_batch: int = MAX_BATCH
    # The data connection (cacheserver_data.py): its port (0 = not offered) and the
    # token a data connection must present.
    data_port: int = 0
    data_token: bytes = b""


class PutValueReply(wire.Message, tag="put_r"):
    rid: int
    checksum: int = 0


class GetValueReply(wire.Message, tag="get_r"):
    rid: int
    found: bool
    meta: bytes = b""
    checksum: int = 0
    parts: int = 1  # value frames that follow, when found


class CheckValueReply(wire.Message, tag="exists_r"):
    rid: int
    found: bool


class DeleteValueReply(wire.Message, tag="delete_r"):
    rid: int
    deleted: bool


class PutValuesReply(wire.Message, tag="mput_r"):
    rid: int
    # One per key: 0 stored, else the ErrorCode that key failed with.
    errors: list[int]


class GetValuesReply(wire.Message, tag="mget_r"):
    rid: int
    found: list[bool]
    # One per key (empty bytes and 0 where not found).
    metas: list[bytes]
    checksums: list[int]
    # Frames of each found value, in order; empty when each is one frame.
    parts: list[int] = []


class CheckValuesReply(wire.Message, tag="mexists_r"):
    rid: int
    found: list[bool]


class DeleteValuesReply(wire.Message, tag="mdelete_r"):
    rid: int
    deleted: list[bool]


class ListKeysReply(wire.Message, tag="list_r"):
    rid: int
    keys: list[str]
    cursor: str


class GetStatsReply(wire.Message, tag="stats_r"):
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


class CheckHealthReply(wire.Message, tag="health_r"):
    rid: int
    ok: bool
    version: int = PROTOCOL_VERSION
    uptime_s: float = 0.0


class ErrorReply(wire.Message, tag="error"):
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

codec: wire.Codec[Request, Reply, ErrorReply] = wire.Codec(
    Request, Reply, ErrorReply, ErrorCode, RETRYABLE
)
MalformedMessage = wire.MalformedMessage
REQUEST_TAGS = codec.request_tags
encode = codec.encode
error_reply = codec.error_reply
decode_request = codec.decode_request
decode_reply = codec.decode_reply


def valid_key(key: str) -> bool:
    """Keys are non-empty, at most MAX_KEY_BYTES of UTF-8, with no control characters."""
    if not key or len(key) > MAX_KEY_BYTES:
        return False
    if len(key.encode("utf-8", "surrogatepass")) > MAX_KEY_BYTES:
        return False
    return key.isprintable()

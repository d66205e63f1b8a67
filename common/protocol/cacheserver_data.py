"""The cache-server's data connection: values read over a plain TCP stream.

Why beside ZMQ: a ZMQ round trip passes every message through an I/O thread on each
side (four thread hand-offs a blocking socket does not make) and lands a value in a
buffer libzmq mallocs, which the reader then copies into its own memory. Over this
connection the reader receives a value straight into the buffer it will keep (an L1
page), with no thread between the socket and the event loop. ZMQ keeps everything
else: the hello, puts, batches, listing, stats.

Framing (all integers little-endian):

- The connection opens with the client's `PREAMBLE`: `MAGIC` (which carries the
  framing version) and the 16-byte token the server gave in its `HelloReply`. The
  server answers `READY` and serves, or closes the connection. The token ties a data
  connection to a server process whose hello the client passed (and changes when the
  server restarts); the server offers no data connection when CURVE is on, since this
  stream is not encrypted.
- A request is `REQUEST` (op, key length) then the key's UTF-8 bytes. The only op is
  `OP_GET`. One request at a time per connection: the client sends the next only after
  reading the whole reply.
- A reply is `REPLY` (status, meta length, payload length, checksum), then the meta,
  then the payload. `FOUND` carries the value's meta and bytes and the xxh3-64 of the
  bytes (as the ZMQ get does); `MISSING` carries nothing; `REFUSED` carries a UTF-8
  message as meta and the server then closes the connection.
"""

from __future__ import annotations

import struct

from kvmesh.common.protocol.cacheserver import MAX_KEY_BYTES, MAX_META_BYTES

MAGIC = b"KVD\x01"
TOKEN_BYTES = 16
PREAMBLE = struct.Struct(f"<4s{TOKEN_BYTES}s")
READY = b"KVOK"
REQUEST = struct.Struct("<BH")
OP_GET = 1
REPLY = struct.Struct("<BIQQ")
FOUND, MISSING, REFUSED = 0, 1, 2
MAX_REFUSAL_BYTES = 1024


class DataFrameError(ValueError):
    """Bytes that are not a valid frame of this protocol."""


def pack_get(key: str) -> bytes:
    raw = key.encode("utf-8")
    if not 0 < len(raw) <= MAX_KEY_BYTES:
        raise DataFrameError(f"keys are 1–{MAX_KEY_BYTES} bytes, got {len(raw)}")
    return REQUEST.pack(OP_GET, len(raw)) + raw


def parse_reply(head: bytes, max_payload: int) -> tuple[int, int, int, int]:
    """(status, meta length, payload length, checksum), or DataFrameError for a
    header no server of ours sends (a client must then drop the connection)."""
    status, meta_len, payload_len, checksum = REPLY.unpack(head)
    if status not in (FOUND, MISSING, REFUSED):
        raise DataFrameError(f"unknown reply status {status}")
    limit = MAX_REFUSAL_BYTES if status == REFUSED else MAX_META_BYTES
    if meta_len > limit:
        raise DataFrameError(f"reply meta of {meta_len} bytes (max {limit})")
    if payload_len > max_payload or (status != FOUND and payload_len):
        raise DataFrameError(f"reply payload of {payload_len} bytes")
    return status, meta_len, payload_len, checksum

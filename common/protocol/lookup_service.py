"""The lookup-server's protocol (version 1): schedulers and routers ask the mesh.

One ZMQ frame per message, a tagged array-like Struct encoded as msgpack; clients
connect DEALER sockets to the lookup-server's ROUTER. Every request carries `rid`
(echoed by its reply) and `version` (checked on every request: a mismatch gets
`ErrorReply(VERSION_MISMATCH)`).

- `Lookup(instance_id, lookup_id, tokens | hashes, pin)` (scheduler-facing): how many
  leading tokens of a prompt one instance holds. With `tokens` (little-endian uint32,
  `lookup.encode_tokens`) the server asks each of the instance's workers at their
  registered lookup endpoints (deadline `worker_timeout_s`), answers the minimum over
  ranks, and the workers pin what they counted under `lookup_id` when `pin`. A rank
  that does not answer makes the answer 0 (`per_rank` holds -1 for it), and so does a
  rank not registered (none is asked; `per_rank` is empty). With
  `hashes` (16-byte chained chunk hashes) there are no tokens to give the workers:
  the answer comes from the controller's registry (its copy in the lookup-server while
  in sync: `source` "index"), in chunks × `chunk_size`, and nothing is pinned.
  `tenant` salts the workers' keys, so it needs `tokens`: a tenant's lookup by hashes
  is refused (BAD_MESSAGE), the registry knowing no tenant's chunks.
  `l1_tokens` is the part of the prefix every rank holds in L1
  (registry view; -1 when the controller did not answer).
- `Release(instance_id, lookup_id)`: drop the pins of a lookup on every rank.
- `BestInstances(tokens | hashes, limit)` (router-facing): instances ranked by the
  cached prefix length, from the controller's registry (no worker is asked): the
  lookup-server's own in-sync copy of it (`source` "index"), or the controller itself
  (`source` "controller") while that copy is not in sync.
- `Hello` → `HelloReply(version, server, chunk_size)`.
- Errors: `ErrorReply(rid, code, message, retryable)`; anything malformed gets one,
  with `rid` 0 unless it could still be read.

Evolution: fields are only appended, with defaults; new messages get new tags; a
change of meaning bumps PROTOCOL_VERSION.
"""

from __future__ import annotations

from enum import IntEnum

import msgspec

from kvmesh.common.protocol import wire
from kvmesh.common.protocol.lookup import MAX_ID_CHARS, MAX_TOKENS, TOKEN_BYTES

PROTOCOL_VERSION = 1
HASH_BYTES = 16
MAX_HASHES = 16_384  # the controller's own limit per lookup


class ErrorCode(IntEnum):
    """Why a request failed. Values travel on the wire: append, never renumber."""

    BAD_MESSAGE = 1
    UNKNOWN_MESSAGE = 2
    VERSION_MISMATCH = 3
    BAD_TOKENS = 4
    UNKNOWN_INSTANCE = 5
    UNAVAILABLE = 6  # the controller did not answer in time
    INTERNAL = 7
    SHUTTING_DOWN = 8


RETRYABLE = frozenset({ErrorCode.UNAVAILABLE, ErrorCode.SHUTTING_DOWN})


# -- requests ----------------------------------------------------------------------------


class Hello(wire.Message, tag="hello"):
    rid: int
    version: int
    client: str = ""


class Lookup(wire.Message, tag="lookup"):
    rid: int
    version: int
    instance_id: str
    lookup_id: str = ""
    tokens: bytes = b""
    hashes: list[bytes] = []
    pin: bool = True
    tenant: str = ""


class Release(wire.Message, tag="release"):
    rid: int
    version: int
    instance_id: str
    lookup_id: str


class BestInstances(wire.Message, tag="best"):
    rid: int
    version: int
    tokens: bytes = b""
    hashes: list[bytes] = []
    limit: int = 0  # 0 = every instance


Request = Hello | Lookup | Release | BestInstances

# -- replies -----------------------------------------------------------------------------


class HelloReply(wire.Message, tag="hello_r"):
    rid: int
    version: int
    server: str
    chunk_size: int


class LookupReply(wire.Message, tag="lookup_r"):
    rid: int
    hit_tokens: int
    # Each rank's answer (index = rank); -1: no answer. Empty when a rank of the
    # instance is not registered (the answer is then 0, and no rank is asked).
    per_rank: list[int]
    l1_tokens: int = -1
    # "workers", or for a lookup by hashes "index" or "controller" (see BestInstances)
    source: str = "workers"


class ReleaseReply(wire.Message, tag="release_r"):
    rid: int
    ranks: int  # how many ranks it was sent to


class InstanceHit(msgspec.Struct, frozen=True, array_like=True, gc=False):
    instance_id: str
    hit_tokens: int
    l1_tokens: int
    world_size: int


class BestInstancesReply(wire.Message, tag="best_r"):
    rid: int
    instances: list[InstanceHit]  # longest cached prefix first
    # "index": the lookup-server's own copy of the registry (in sync, see server.py);
    # "controller": asked the controller.
    source: str = "controller"


class ErrorReply(wire.Message, tag="error"):
    rid: int
    code: int
    message: str
    retryable: bool = False


Reply = HelloReply | LookupReply | ReleaseReply | BestInstancesReply | ErrorReply


def _check(msg: Request) -> tuple[ErrorCode, str] | None:
    if isinstance(msg, Lookup | Release) and not 0 < len(msg.instance_id) <= MAX_ID_CHARS:
        return ErrorCode.BAD_MESSAGE, f"instance_id must have 1 to {MAX_ID_CHARS} characters"
    if isinstance(msg, Release) and not 0 < len(msg.lookup_id) <= MAX_ID_CHARS:
        return ErrorCode.BAD_MESSAGE, f"lookup_id must have 1 to {MAX_ID_CHARS} characters"
    if isinstance(msg, Lookup):
        if len(msg.lookup_id) > MAX_ID_CHARS or len(msg.tenant) > MAX_ID_CHARS:
            return ErrorCode.BAD_MESSAGE, f"ids must have at most {MAX_ID_CHARS} characters"
        if msg.pin and msg.tokens and not msg.lookup_id:
            return ErrorCode.BAD_MESSAGE, "pin needs a lookup_id"
        if msg.tenant and not msg.tokens:
            # The registry holds the engines' own namespaces only: answering from it
            # would hand this tenant the hits of requests without a tenant.
            return ErrorCode.BAD_MESSAGE, "a tenant's lookup needs tokens, not hashes"
    if isinstance(msg, Lookup | BestInstances):
        if msg.tokens and msg.hashes:
            return ErrorCode.BAD_MESSAGE, "give tokens or hashes, not both"
        if len(msg.tokens) % TOKEN_BYTES:
            return ErrorCode.BAD_TOKENS, f"tokens must be uint32s; got {len(msg.tokens)} bytes"
        if len(msg.tokens) > MAX_TOKENS * TOKEN_BYTES or len(msg.hashes) > MAX_HASHES:
            return ErrorCode.BAD_TOKENS, "prompt too long"
        if any(len(h) != HASH_BYTES for h in msg.hashes):
            return ErrorCode.BAD_TOKENS, f"chunk hashes must be {HASH_BYTES} bytes each"
    if isinstance(msg, BestInstances) and msg.limit < 0:
        return ErrorCode.BAD_MESSAGE, "limit must be >= 0"
    return None


codec: wire.Codec[Request, Reply, ErrorReply] = wire.Codec(
    Request,
    Reply,
    ErrorReply,
    ErrorCode,
    RETRYABLE,
    version=PROTOCOL_VERSION,
    speaker="the lookup-server",
    check=_check,
)
MalformedMessage = wire.MalformedMessage
encode = codec.encode
error_reply = codec.error_reply
decode_request = codec.decode_request
decode_reply = codec.decode_reply

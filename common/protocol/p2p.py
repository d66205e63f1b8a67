"""The peer protocol (version 1): one engine reads chunks from another engine's L1.

Every request is one ZMQ frame, a tagged array-like Struct encoded as msgpack; a
reader talks through a DEALER, the serving engine's ROUTER sees `[routing id, frame]`.
Replies are `[header, *payloads]`.

- `Hello` tells who the peer is and, when it serves over NIXL, its agent's name and
  metadata (what `add_remote_agent` takes). An empty agent means "ZMQ only".
- `ReadChunks(keys)` (the ZMQ channel): the reply lists a `ChunkMeta` for each key the
  peer holds in L1 (missing keys are left out, order kept) and carries one payload
  frame per listed chunk, in the same order.
- `PinChunks(keys)` (the NIXL channel): the peer takes a reference on each chunk it
  holds, so its page can be neither evicted nor reused, and answers with each chunk's
  address (`ChunkMeta.addr`) in its registered pool and a lease. The reader pulls the
  bytes itself, then sends `ReleaseChunks(lease)`; a lease that is never released ends
  after the peer's lease time.
- Every `ChunkMeta` carries the xxh3-64 of the chunk's bytes: the reader checks it
  after the bytes have landed, and a chunk that does not verify is a miss.
- `deadline` is a Unix time after which the reader has given up (0: none).
- Anything else gets `ErrorReply(rid, code, message, retryable)`; decoding raises only
  `MalformedMessage`, which carries the reply to send.

Evolution: fields are only appended, with defaults; new messages get new tags; a
change of meaning bumps PROTOCOL_VERSION.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import IntEnum

import msgspec

PROTOCOL_VERSION = 1
MAX_KEYS = 4096  # per request: ~16 GiB of 4 MiB chunks, far beyond one prompt
MAX_KEY_CHARS = 64  # "<16 hex>-<32 hex>" is 49


class ErrorCode(IntEnum):
    """Why a request failed. Values travel on the wire: append, never renumber."""

    BAD_MESSAGE = 1
    UNKNOWN_MESSAGE = 2
    VERSION_MISMATCH = 3
    BAD_KEY = 4
    DEADLINE_EXCEEDED = 5
    INTERNAL = 6
    SHUTTING_DOWN = 7
    NO_NIXL = 8  # PinChunks to a peer that does not serve over NIXL


RETRYABLE = frozenset({ErrorCode.DEADLINE_EXCEEDED, ErrorCode.SHUTTING_DOWN})


class _Msg(msgspec.Struct, tag=True, frozen=True, array_like=True, gc=False):
    """Base of every message: tagged (the tag is the first array element)."""


class ChunkMeta(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """One chunk a peer holds: enough to allocate a buffer for it and check it."""

    key: str  # ChunkKey.to_str()
    nbytes: int
    checksum: int  # xxh3-64 of the nbytes bytes
    shape: list[int]
    dtype: str  # torch dtype name without "torch."
    fmt: int  # MemoryFormat
    addr: int = 0  # PinChunks only: address in the peer's registered pool


# -- requests ----------------------------------------------------------------------------


class Hello(_Msg, tag="hello"):
    rid: int
    version: int
    client: str = ""


class ReadChunks(_Msg, tag="read"):
    rid: int
    version: int
    keys: list[str]
    deadline: float = 0.0


class PinChunks(_Msg, tag="pin"):
    rid: int
    version: int
    keys: list[str]
    deadline: float = 0.0


class ReleaseChunks(_Msg, tag="release"):
    rid: int
    version: int
    lease: int


Request = Hello | ReadChunks | PinChunks | ReleaseChunks

# -- replies -----------------------------------------------------------------------------


class HelloReply(_Msg, tag="hello_r"):
    rid: int
    version: int
    instance_id: str
    rank: int
    agent: str = ""
    agent_metadata: bytes = b""


class ReadChunksReply(_Msg, tag="read_r"):
    rid: int
    chunks: list[ChunkMeta]


class PinChunksReply(_Msg, tag="pin_r"):
    rid: int
    lease: int
    chunks: list[ChunkMeta]


class ReleaseChunksReply(_Msg, tag="release_r"):
    rid: int
    released: bool


class ErrorReply(_Msg, tag="error"):
    rid: int
    code: int
    message: str
    retryable: bool = False


Reply = HelloReply | ReadChunksReply | PinChunksReply | ReleaseChunksReply | ErrorReply

REQUEST_TAGS = frozenset(t.__struct_config__.tag for t in Request.__args__)
REPLY_TAGS = frozenset(t.__struct_config__.tag for t in Reply.__args__)

_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(Request)
_reply_decoder = msgspec.msgpack.Decoder(Reply)
_raw_decoder = msgspec.msgpack.Decoder()


class MalformedMessage(ValueError):
    """Frames that are not a valid message; `reply` is the ErrorReply for them."""

    def __init__(self, reply: ErrorReply) -> None:
        super().__init__(reply.message)
        self.reply = reply


def encode(msg: _Msg) -> bytes:
    return _encoder.encode(msg)


def error_reply(rid: int, code: ErrorCode, message: str) -> ErrorReply:
    return ErrorReply(rid, int(code), message[:300], code in RETRYABLE)


def decode_request(frames: Sequence[bytes | memoryview]) -> Request:
    """The request in frames (what follows the routing id), validated; otherwise
    MalformedMessage: not one frame, not msgpack, unknown tag, wrong fields, another
    version, too many keys."""
    if len(frames) != 1:
        raw = frames[0] if frames else b""
        msg = f"expected 1 frame, got {len(frames)}"
        raise MalformedMessage(error_reply(_read_rid(raw), ErrorCode.BAD_MESSAGE, msg))
    raw = frames[0]
    try:
        msg = _request_decoder.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise MalformedMessage(_error_for(exc, raw, REQUEST_TAGS)) from None
    if not 0 <= msg.rid < 2**63:
        raise MalformedMessage(error_reply(0, ErrorCode.BAD_MESSAGE, "rid must be in [0, 2**63)"))
    if msg.version != PROTOCOL_VERSION:
        raise MalformedMessage(
            error_reply(
                msg.rid,
                ErrorCode.VERSION_MISMATCH,
                f"protocol version {msg.version} not supported; this peer speaks "
                f"{PROTOCOL_VERSION}",
            )
        )
    if isinstance(msg, ReadChunks | PinChunks):
        if len(msg.keys) > MAX_KEYS:
            raise MalformedMessage(
                error_reply(msg.rid, ErrorCode.BAD_MESSAGE, f"more than {MAX_KEYS} keys")
            )
        if any(len(k) > MAX_KEY_CHARS for k in msg.keys):
            raise MalformedMessage(error_reply(msg.rid, ErrorCode.BAD_KEY, "key too long"))
    return msg


def decode_reply(frames: Sequence[bytes | memoryview]) -> Reply:
    """The reply header in frames[0], checked against the payload count; otherwise
    MalformedMessage (with a local ErrorReply)."""
    if not frames:
        raise MalformedMessage(error_reply(0, ErrorCode.BAD_MESSAGE, "empty reply"))
    try:
        reply = _reply_decoder.decode(frames[0])
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise MalformedMessage(_error_for(exc, frames[0], REPLY_TAGS)) from None
    want = len(reply.chunks) if isinstance(reply, ReadChunksReply) else 0
    if len(frames) - 1 != want:
        problem = f"reply carries {len(frames) - 1} payload frames, expected {want}"
        raise MalformedMessage(error_reply(reply.rid, ErrorCode.BAD_MESSAGE, problem))
    return reply


def _read_rid(raw: bytes | memoryview) -> int:
    try:
        arr = _raw_decoder.decode(raw)
    except (msgspec.DecodeError, TypeError):
        return 0
    if isinstance(arr, list) and len(arr) > 1:
        rid = arr[1]
        if isinstance(rid, int) and not isinstance(rid, bool) and 0 <= rid < 2**63:
            return rid
    return 0


def _error_for(exc: Exception, raw: bytes | memoryview, tags: frozenset[str]) -> ErrorReply:
    code = ErrorCode.BAD_MESSAGE
    try:
        arr = _raw_decoder.decode(raw)
    except (msgspec.DecodeError, TypeError):
        arr = None
    if isinstance(arr, list) and arr and isinstance(arr[0], str) and arr[0] not in tags:
        code = ErrorCode.UNKNOWN_MESSAGE
    what = "unknown message type" if code is ErrorCode.UNKNOWN_MESSAGE else "bad message"
    return error_reply(_read_rid(raw), code, f"{what}: {exc}")

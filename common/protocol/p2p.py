"""The peer protocol (version 1): one engine reads chunks from another engine's L1.

Every request is one ZMQ frame, a tagged array-like Struct encoded as msgpack; a
reader talks through a DEALER, the serving engine's ROUTER sees `[routing id, frame]`.
Replies are `[header, *payloads]`.

- `Hello` tells who the peer is and, when it serves over NIXL, its agent's name and
  metadata (what `add_remote_agent` takes). An empty agent means "ZMQ only". Replies
  that hand out addresses (`PinChunksReply`, `AllocChunksReply`) name the agent they
  belong to, so a peer restarted behind the same endpoint is noticed before any
  transfer, not by a failed one.
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
- Disaggregated prefill (a prefiller writes into a decoder; pd_receiver.py):
  `AllocChunks` asks for receive buffers (refused with NO_ROOM rather than evicting),
  the prefiller writes each layer (NIXL WRITE, or `PushChunks` with payload frames over
  ZMQ), then `CommitChunks` carries each chunk's xxh3 for the receiver to verify;
  `CancelChunks` frees an allocation at once.
- Anything else gets `ErrorReply(rid, code, message, retryable)`; decoding raises only
  `MalformedMessage`, which carries the reply to send.

Evolution: fields are only appended, with defaults; new messages get new tags; a
change of meaning bumps PROTOCOL_VERSION.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import IntEnum

import msgspec

from kvmesh.common.protocol import wire

PROTOCOL_VERSION = 1
MAX_KEYS = 4096  # per request: ~16 GiB of 4 MiB chunks, far beyond one prompt
MAX_KEY_CHARS = 64  # "<16 hex>-<32 hex>" is 49
# A message's header frame (payloads aside): MAX_KEYS keys or chunk metas take ~0.5 MiB.
# A larger one is refused before it is decoded.
MAX_HEADER_BYTES = 1 << 20


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
    NO_ROOM = 9  # AllocChunks beyond the receiver's share of free memory
    UNKNOWN_TRANSFER = 10  # an allocation that was never made, was cancelled or expired
    BAD_LAYOUT = 11  # chunks of another shape, dtype or format than the receiver's
    NOT_RECEIVER = 12  # PD messages to an engine whose pd.role does not receive


RETRYABLE = frozenset({ErrorCode.DEADLINE_EXCEEDED, ErrorCode.SHUTTING_DOWN})


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


class Hello(wire.Message, tag="hello"):
    rid: int
    version: int
    client: str = ""


class ReadChunks(wire.Message, tag="read"):
    rid: int
    version: int
    keys: list[str]
    deadline: float = 0.0


class PinChunks(wire.Message, tag="pin"):
    rid: int
    version: int
    keys: list[str]
    deadline: float = 0.0


class ReleaseChunks(wire.Message, tag="release"):
    rid: int
    version: int
    lease: int


class AllocChunks(wire.Message, tag="alloc"):
    """PD: allocate one receive buffer per key (full chunks of chunk_shape; the last
    holds last_tokens tokens) for a prefiller to write into."""

    rid: int
    version: int
    transfer_id: str
    keys: list[str]
    chunk_shape: list[int]
    dtype: str
    fmt: int
    last_tokens: int
    deadline: float = 0.0


class PushChunks(wire.Message, tag="push"):
    """PD over ZMQ: one payload frame per listed chunk index, that chunk's `layer`
    (its regions concatenated, see common/transport/chunk_regions.py; -1: the whole
    chunk)."""

    rid: int
    version: int
    alloc_id: int
    layer: int
    chunks: list[int]


class CommitChunks(wire.Message, tag="commit"):
    """PD: every layer of the chunks listed (by index; empty: all still uncommitted) is
    written; checksums[i] is the xxh3-64 of chunks[i]. The allocation ends with the
    commit of its last chunk."""

    rid: int
    version: int
    alloc_id: int
    checksums: list[int]
    chunks: list[int] = []


class CancelChunks(wire.Message, tag="cancel"):
    rid: int
    version: int
    alloc_id: int


Request = (
    Hello | ReadChunks | PinChunks | ReleaseChunks | AllocChunks | PushChunks | CommitChunks
    | CancelChunks
)  # fmt: skip

# -- replies -----------------------------------------------------------------------------


class HelloReply(wire.Message, tag="hello_r"):
    rid: int
    version: int
    instance_id: str
    rank: int
    agent: str = ""
    agent_metadata: bytes = b""


class ReadChunksReply(wire.Message, tag="read_r"):
    rid: int
    chunks: list[ChunkMeta]


class PinChunksReply(wire.Message, tag="pin_r"):
    rid: int
    lease: int
    chunks: list[ChunkMeta]
    # The NIXL agent whose memory the addresses are in: a reader that hello'd another
    # process behind this endpoint (it restarted since) hellos again before reading.
    agent: str = ""


class ReleaseChunksReply(wire.Message, tag="release_r"):
    rid: int
    released: bool


class ErrorReply(wire.Message, tag="error"):
    rid: int
    code: int
    message: str
    retryable: bool = False


class Slot(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """A receive buffer: where to write, or `have` when the receiver holds the chunk
    already (nothing to write)."""

    addr: int
    nbytes: int
    have: bool = False


class AllocChunksReply(wire.Message, tag="alloc_r"):
    rid: int
    alloc_id: int
    slots: list[Slot]
    # The NIXL agent whose memory the slots are in; a prefiller writes into that agent
    # only (never into another process that took over the endpoint since).
    agent: str = ""


class PushChunksReply(wire.Message, tag="push_r"):
    rid: int
    written: int


class CommitChunksReply(wire.Message, tag="commit_r"):
    rid: int
    committed: int
    rejected: int  # chunks whose bytes did not match their checksum: dropped


class CancelChunksReply(wire.Message, tag="cancel_r"):
    rid: int
    cancelled: bool


Reply = (
    HelloReply | ReadChunksReply | PinChunksReply | ReleaseChunksReply | AllocChunksReply
    | PushChunksReply | CommitChunksReply | CancelChunksReply | ErrorReply
)  # fmt: skip


def _check_request(msg: Request) -> tuple[ErrorCode, str] | None:
    if isinstance(msg, PushChunks | CommitChunks) and len(msg.chunks) > MAX_KEYS:
        return ErrorCode.BAD_MESSAGE, f"more than {MAX_KEYS} chunks"
    if isinstance(msg, CommitChunks) and len(msg.checksums) > MAX_KEYS:
        return ErrorCode.BAD_MESSAGE, f"more than {MAX_KEYS} checksums"
    if isinstance(msg, ReadChunks | PinChunks | AllocChunks):
        if len(msg.keys) > MAX_KEYS:
            return ErrorCode.BAD_MESSAGE, f"more than {MAX_KEYS} keys"
        if any(len(k) > MAX_KEY_CHARS for k in msg.keys):
            return ErrorCode.BAD_KEY, "key too long"
    return None


codec: wire.Codec[Request, Reply, ErrorReply] = wire.Codec(
    Request,
    Reply,
    ErrorReply,
    ErrorCode,
    RETRYABLE,
    version=PROTOCOL_VERSION,
    speaker="this peer",
    check=_check_request,
)
MalformedMessage = wire.MalformedMessage
encode = codec.encode
error_reply = codec.error_reply


def decode_request(frames: Sequence[bytes | memoryview]) -> Request:
    """The request in the frames that follow the routing id: its header, then (only
    PushChunks) one payload frame per chunk it lists; MalformedMessage otherwise."""
    if len(frames) == 1:
        return codec.decode_request(frames[0])
    if not frames:
        raise MalformedMessage(error_reply(0, ErrorCode.BAD_MESSAGE, "expected 1 frame, got 0"))
    msg = codec.decode_request(frames[0])
    want = 1 + (len(msg.chunks) if isinstance(msg, PushChunks) else 0)
    if len(frames) != want:
        problem = f"expected {want} frame{'s' if want > 1 else ''}, got {len(frames)}"
        raise MalformedMessage(error_reply(msg.rid, ErrorCode.BAD_MESSAGE, problem))
    return msg


def decode_reply(frames: Sequence[bytes | memoryview]) -> Reply:
    """The reply header in frames[0], checked against the payload count; otherwise
    MalformedMessage (with a local ErrorReply)."""
    if not frames:
        raise MalformedMessage(error_reply(0, ErrorCode.BAD_MESSAGE, "empty reply"))
    reply = codec.decode_reply(frames[0])
    want = len(reply.chunks) if isinstance(reply, ReadChunksReply) else 0
    if len(frames) - 1 != want:
        problem = f"reply carries {len(frames) - 1} payload frames, expected {want}"
        raise MalformedMessage(error_reply(reply.rid, ErrorCode.BAD_MESSAGE, problem))
    return reply

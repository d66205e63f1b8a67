"""The controller's external KV-event feed (version 1): who stored or removed which chunk
in which tier, for routers, schedulers and scripts outside the mesh.

Two sockets on `controller.host`, both CURVE-protected when `security` is configured:

- **PUB** (`controller.events_port`, an XPUB): every message is three frames
  `[topic, seq, payload]`.
  - `topic`: the chunk namespace id, 16 lower-case hex digits (the part of a chunk key
    before the `-`), ASCII. Subscribe to a namespace id to get only its chunks, or to
    b"" for everything.
  - `seq`: 8-byte big-endian unsigned. It grows by one per published message within an
    `epoch` (every topic shares it): an unfiltered subscriber sees every seq.
  - `payload`: msgpack of one `Payload` (a map with `kind` "events", "state" or
    "left"). Each carries `epoch` and `prev_seq`, the seq of the previous message of
    the same topic in this epoch (0: none), so a subscriber filtered on some topics
    still sees a gap: `prev_seq` newer than the last seq it got on that topic.
  A KV event batch from a worker becomes one message per namespace it touches;
  `state` says the worker's chunks in that namespace are now exactly `events` (a
  resync: its earlier events there are void); `left` says the worker and all its
  chunks are gone (`reason` "deregistered" or "dropped").
  `epoch` is new at every controller start, and whenever the feed restarts after
  changes went unpublished because nobody was subscribed: either way what a
  subscriber knew is void, and it resyncs (seq starts again at 1).
- **Replay** (`controller.events_replay_port`, a ROUTER; clients connect a DEALER):
  `Hello` → `HelloReply(epoch, last_seq)`: where the feed is now.
  `Replay(since_seq, namespaces, epoch)` → zero or more `ReplayBatch` (at most
  MAX_REPLAY_ENTRIES messages each, in seq order) then `ReplayEnd(last_seq)`: every
  kept message after `since_seq` of those namespaces (all: empty), exactly as
  published. When a message that the answer should hold is no longer kept (the ring
  keeps the last `events_replay_size` events), or `epoch` is not the current one, the
  answer is one `ErrorReply` (TOO_OLD, EPOCH_CHANGED) instead. Anything malformed gets
  an ErrorReply too.

Evolution: fields are only appended, with defaults; new messages get new tags; a
change of meaning bumps PROTOCOL_VERSION.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Literal

import msgspec

from kvmesh.common.protocol import wire

PROTOCOL_VERSION = 1
SEQ_BYTES = 8
TOPIC_BYTES = 16
MAX_REPLAY_ENTRIES = 256
MAX_REPLAY_NAMESPACES = 256
TOO_OLD_MESSAGE = "too old; resync from the controller's workers list"

Op = Literal["stored", "removed"]


# -- the PUB socket's payloads -----------------------------------------------------------


class KVEvent(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """One chunk change: `[op, key, tier]` on the wire (thousands per batch)."""

    op: Op
    key: str  # ChunkKey.to_str(): "<16 hex namespace>-<32 hex hash>"
    tier: str  # "l1", "disk", "remote", ...


class _Payload(msgspec.Struct, frozen=True, tag_field="kind", gc=False):
    epoch: str
    prev_seq: int  # the previous message of this topic in this epoch; 0: none
    worker_id: str  # "<instance_id>/<rank>"
    instance_id: str
    ts: float  # controller wall clock (seconds since the epoch) when published


class EventBatch(_Payload, tag="events"):
    events: list[KVEvent]


class WorkerState(_Payload, tag="state"):
    """The worker's chunks in this namespace are exactly `events` (all "stored")."""

    events: list[KVEvent]


class WorkerLeft(_Payload, tag="left"):
    """The worker is gone, and every chunk it held with it."""

    reason: Literal["deregistered", "dropped"]


Payload = EventBatch | WorkerState | WorkerLeft

_payload_encoder = msgspec.msgpack.Encoder()
_payload_decoder = msgspec.msgpack.Decoder(Payload)


def encode_payload(msg: Payload) -> bytes:
    return _payload_encoder.encode(msg)


def decode_payload(raw: wire.Buffer) -> Payload:
    """A payload frame; msgspec.ValidationError or DecodeError when it is not one."""
    return _payload_decoder.decode(raw)


def encode_seq(seq: int) -> bytes:
    return seq.to_bytes(SEQ_BYTES, "big")


def decode_seq(raw: wire.Buffer) -> int:
    """A seq frame; ValueError when it is not 8 bytes."""
    if len(raw) != SEQ_BYTES:
        raise ValueError(f"seq frame of {len(raw)} bytes, expected {SEQ_BYTES}")
    return int.from_bytes(raw, "big")


# -- the replay socket -------------------------------------------------------------------


class ErrorCode(IntEnum):
    """Why a replay failed. Values travel on the wire: append, never renumber."""

    BAD_MESSAGE = 1
    UNKNOWN_MESSAGE = 2
    VERSION_MISMATCH = 3
    INTERNAL = 4
    TOO_OLD = 5  # a message the answer needs is no longer kept: resync
    EPOCH_CHANGED = 6  # the controller restarted or the feed restarted: resync


RETRYABLE: frozenset[ErrorCode] = frozenset()


class Hello(wire.Message, tag="hello"):
    rid: int
    version: int
    client: str = ""


class Replay(wire.Message, tag="replay"):
    rid: int
    version: int
    since_seq: int  # answer the messages after this one (0: every kept message)
    namespaces: list[str] = []  # topics wanted; empty: all
    epoch: str = ""  # the epoch since_seq belongs to; "": the current one


Request = Hello | Replay


class HelloReply(wire.Message, tag="hello_r"):
    rid: int
    version: int
    epoch: str
    last_seq: int  # the newest seq published


class ReplayEntry(msgspec.Struct, frozen=True, array_like=True, gc=False):
    seq: int
    topic: str
    payload: bytes  # the PUB payload frame, byte for byte


class ReplayBatch(wire.Message, tag="replay_batch"):
    rid: int
    epoch: str
    entries: list[ReplayEntry]


class ReplayEnd(wire.Message, tag="replay_end"):
    rid: int
    epoch: str
    last_seq: int  # the newest seq published when the replay was answered
    count: int  # entries sent in the batches before this


class ErrorReply(wire.Message, tag="error"):
    rid: int
    code: int
    message: str
    retryable: bool = False


Reply = HelloReply | ReplayBatch | ReplayEnd | ErrorReply

_HEX = frozenset("0123456789abcdef")


def is_topic(ns: str) -> bool:
    """A namespace id as chunk keys carry it: 16 lower-case hex digits."""
    return len(ns) == TOPIC_BYTES and _HEX.issuperset(ns)


def _check(msg: Request) -> tuple[ErrorCode, str] | None:
    if isinstance(msg, Hello):
        return None
    if msg.since_seq < 0:
        return ErrorCode.BAD_MESSAGE, "since_seq must be >= 0"
    if len(msg.namespaces) > MAX_REPLAY_NAMESPACES:
        return ErrorCode.BAD_MESSAGE, f"at most {MAX_REPLAY_NAMESPACES} namespaces"
    bad = next((ns for ns in msg.namespaces if not is_topic(ns)), None)
    if bad is not None:
        return ErrorCode.BAD_MESSAGE, f"namespaces must be 16 hex digits, got {bad[:40]!r}"
    if len(msg.epoch) > 64:
        return ErrorCode.BAD_MESSAGE, "epoch too long"
    return None


codec: wire.Codec[Request, Reply, ErrorReply] = wire.Codec(
    Request,
    Reply,
    ErrorReply,
    ErrorCode,
    RETRYABLE,
    version=PROTOCOL_VERSION,
    speaker="the controller's event replay",
    check=_check,
)
MalformedMessage = wire.MalformedMessage
encode = codec.encode
error_reply = codec.error_reply
decode_request = codec.decode_request
decode_reply = codec.decode_reply

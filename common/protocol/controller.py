"""The controller's wire protocol (version 1): workers, admin clients and the controller.

Every message is one ZMQ frame: a tagged, array-like Struct encoded as msgpack. The
controller binds one ROUTER; workers and admin clients connect DEALER sockets.

Why one socket for KV events too (not a separate PULL): a worker's `Register`, its
`KVEventBatch`es, `FullState` and `Heartbeat`s then travel on one connection in the
order they were sent, so the controller never sees events of a worker it has not
registered yet, and a heartbeat's `last_seq` is only compared after every batch sent
before it was applied. Batches are fire-and-forget (no reply) unless refused.

- A session starts with `Hello`; `HelloReply` or `ErrorReply(VERSION_MISMATCH)`. Any
  other request before a hello gets `ErrorReply(NO_HELLO)` (retryable: say hello again).
- Every request carries `rid`, echoed by its reply; pushes from the controller to a
  worker (`Resync`, `Command`) carry the controller's own rid, and the worker answers
  a `Command` with `CommandReply` of the same rid.
- Workers: `Register` → `RegisterReply(worker_id)`; then `KVEventBatch`es whose
  `first_seq` continues the previous batch (a gap, or a heartbeat's `last_seq` ahead
  of what arrived, makes the controller push `Resync`; the worker answers with
  `FullState`); `Heartbeat` every `heartbeat_s` (a worker silent for three periods is
  dropped with its chunks); `Deregister` on a clean shutdown.
- `P2PLookup(keys, exclude_instance)` → the peer whose L1 holds the longest run of
  keys from the first (count 0: nobody). Only workers that registered a P2P endpoint.
- `PrefixCounts(hashes, instance_id)` → per instance, the leading chunks of a prompt
  that all of its ranks hold (any tier, and L1): what the lookup-server ranks
  instances by. Only workers' registered namespaces are matched (no tenants).
- Admin: `Clear`, `Pin`, `Health`, `Move`, `Compress` fan out to the workers (all, or
  one instance's) and answer `AdminReply(event_id, results)` with one `WorkerResult`
  per worker, a worker that missed the deadline included (ok=False, error "timeout").
  `CheckFinish(event_id)` answers the stored result of an earlier command.
- `Move(keys, src_instance, dst_instance, copy)`: per rank r, the controller tells
  dst's worker r to fetch the keys (none: everything src's worker r holds in L1, asked
  of it first with op "keys") from src's worker r's P2P endpoint; the fetching worker
  verifies each chunk as the P2P tier does and names the chunks it now holds in its
  reply's `keys`. Unless `copy`, only those are then removed from src's worker r (op
  "remove"). Chunk keys carry rank and namespace, so src and dst must have the same
  world size and per-rank namespaces (refused with BAD_REQUEST otherwise, as is an
  unknown instance). The results hold one `WorkerResult` per dst worker (fetch) and,
  for a move, per src worker (remove).
- Index subscription (the lookup-server's copy of the registry, on the same ROUTER):
  `IndexSubscribe` → `IndexSnapshotReply(epoch, seq, workers)`: every worker with its
  chunks per tier as of publication `seq`, and the asking connection becomes a
  subscriber. From then on the controller pushes, in order, one message per registry
  change with the next seq: `WorkerJoined` (register, also of a worker already known:
  its info is replaced, its chunks stay), `WorkerLeft` (deregister or dropped for
  silence: its chunks go), `WorkerReplaced` (a FullState: the worker's chunks are
  exactly these now) and `IndexEvents` (a KV event batch as runs of admits or evicts
  in one tier). `IndexPing(epoch)` every few hundred ms keeps the subscription (one not
  pinged for `index_subscriber_timeout_s` is dropped) and is answered by
  `IndexTick(epoch, seq)`, which travels behind every push it counts: a tick with a
  seq beyond the last push received means pushes were lost (the controller drops them
  for a subscriber too far behind), and the subscriber subscribes again. A ping of a
  connection that is not subscribed, or of another epoch (the controller restarted:
  `epoch` is new each start), gets `ErrorReply(NOT_SUBSCRIBED)`; a restarted controller
  first answers `NO_HELLO`.
  Chunks travel as little-endian uint64 arrays of the registry's chunk ints:
  `(low 64 bits of the chunk hash ^ namespace id) & CHUNK_INT_MASK`, the namespace
  being the 16 hex digits before the `-` of a chunk key. 8 bytes a chunk, not a
  49-character string; a prompt's chunk hash folds the same way per namespace.
- Every reply is the matching `...Reply` or `ErrorReply(rid, code, message, retryable)`.

Chunk keys travel as `ChunkKey.to_str()` strings. Evolution: fields are only appended,
with defaults; new messages get new tags; a change of meaning bumps PROTOCOL_VERSION.
"""

from __future__ import annotations

from enum import IntEnum

import msgspec

from kvmesh.common.protocol import wire

PROTOCOL_VERSION = 1
MAX_EVENTS_PER_BATCH = 65_536
MAX_LOOKUP_KEYS = 16_384
CHUNK_INT_MASK = (1 << 60) - 1


class ErrorCode(IntEnum):
    """Why a request failed. Values travel on the wire: append, never renumber."""

    BAD_MESSAGE = 1
    UNKNOWN_MESSAGE = 2
    VERSION_MISMATCH = 3
    NO_HELLO = 4
    NOT_REGISTERED = 5
    BAD_REQUEST = 6
    UNSUPPORTED = 7
    DEADLINE_EXCEEDED = 8
    INTERNAL = 9
    SHUTTING_DOWN = 10
    NOT_SUBSCRIBED = 11


# Codes a client may retry after doing something about them (hello / register /
# subscribe again).
RETRYABLE = frozenset(
    {
        ErrorCode.NO_HELLO,
        ErrorCode.NOT_REGISTERED,
        ErrorCode.SHUTTING_DOWN,
        ErrorCode.NOT_SUBSCRIBED,
    }
)


class EventKind(IntEnum):
    ADMIT = 1
    EVICT = 2


# -- worker → controller -------------------------------------------------------------


class Hello(wire.Message, tag="hello"):
    rid: int
    version: int
    client: str = ""


class Register(wire.Message, tag="register"):
    rid: int
    instance_id: str
    rank: int
    world_size: int
    namespaces: list[str]
    # Where the engine serves its L1 to peers; "" when it serves none.
    p2p_endpoint: str = ""
    heartbeat_s: float = 1.0
    # Where the engine answers the lookup protocol (common/protocol/lookup.py); "" none.
    lookup_endpoint: str = ""


class Deregister(wire.Message, tag="deregister"):
    rid: int
    worker_id: str


class Heartbeat(wire.Message, tag="heartbeat"):
    rid: int
    worker_id: str
    last_seq: int  # the seq of the last event this worker sent


class KVEventBatch(wire.Message, tag="events"):
    """Events first_seq, first_seq+1, ...: (EventKind, chunk key string, tier name)."""

    rid: int
    worker_id: str
    first_seq: int
    events: list[tuple[int, str, str]]


class FullState(wire.Message, tag="full_state"):
    """Everything the worker holds, per tier, as of event `seq` (later events follow)."""

    rid: int
    worker_id: str
    seq: int
    tiers: dict[str, list[str]]


class CommandReply(wire.Message, tag="command_r"):
    rid: int
    worker_id: str
    ok: bool
    count: int = 0
    error: str = ""
    detail: dict[str, int] = {}
    # op "keys": the chunks the worker holds in L1; op "fetch": the chunks it now holds.
    keys: list[str] = []


# -- anyone → controller: lookups and admin ----------------------------------------------


class P2PLookup(wire.Message, tag="p2p_lookup"):
    rid: int
    keys: list[str]
    exclude_instance: str = ""


class ListWorkers(wire.Message, tag="list_workers"):
    rid: int


class PrefixCounts(wire.Message, tag="prefix_counts"):
    """How many leading chunks of a prompt each instance holds, from the registry.

    `hashes` are the prompt's 16-byte chained chunk hashes (namespace-free: the
    controller pairs them with each worker's registered namespaces). An instance
    counts a chunk when every one of its ranks holds it in some tier."""

    rid: int
    hashes: list[bytes]
    instance_id: str = ""  # "" = every instance


class Clear(wire.Message, tag="clear"):
    rid: int
    event_id: str
    instance_id: str = ""  # "" = every instance
    tier: str = ""  # "" = every tier


class Pin(wire.Message, tag="pin"):
    rid: int
    event_id: str
    keys: list[str]
    instance_id: str = ""
    unpin: bool = False


class Health(wire.Message, tag="health"):
    rid: int
    event_id: str
    instance_id: str = ""


class Move(wire.Message, tag="move"):
    """Copy (copy=True) or move chunks from one instance to another, rank by rank;
    keys [] = every chunk the source holds in L1."""

    rid: int
    event_id: str
    keys: list[str]
    src_instance: str
    dst_instance: str
    copy: bool = False
    # Deadline of each rank's transfer; 0 = the controller's admin timeout.
    timeout_s: float = 0.0


# The codecs and tiers a Compress may name (common/codecs/ holds the codecs; a test
# keeps the two in step without the controller importing torch).
COMPRESS_METHODS = ("none", "zstd", "lz4", "cachegen")
COMPRESS_TIERS = ("disk", "remote")


class Compress(wire.Message, tag="compress"):
    """Rewrite stored chunks through a codec (method: none, zstd, lz4, cachegen) in a
    tier (disk or remote), each replaced whole; keys [] = every chunk the worker holds
    there."""

    rid: int
    event_id: str
    instance_id: str = ""
    method: str = "zstd"
    tier: str = "disk"
    keys: list[str] = []
    # Deadline of each worker's rewrite; 0 = the controller's admin timeout.
    timeout_s: float = 0.0


class CheckFinish(wire.Message, tag="check_finish"):
    rid: int
    event_id: str


class IndexSubscribe(wire.Message, tag="index_subscribe"):
    """Snapshot the registry for an index and push its changes to this connection."""

    rid: int


class IndexPing(wire.Message, tag="index_ping"):
    """Keep the subscription; answered by IndexTick behind every earlier push."""

    rid: int
    epoch: str


Request = (
    Hello
    | Register
    | Deregister
    | Heartbeat
    | KVEventBatch
    | FullState
    | CommandReply
    | P2PLookup
    | ListWorkers
    | PrefixCounts
    | Clear
    | Pin
    | Health
    | Move
    | Compress
    | CheckFinish
    | IndexSubscribe
    | IndexPing
)
AdminRequest = Clear | Pin | Health | Move | Compress

# -- controller → worker (pushed) ------------------------------------------------------


class Resync(wire.Message, tag="resync"):
    rid: int
    worker_id: str
    reason: str = ""


class Command(wire.Message, tag="command"):
    """An admin command for one worker: op is clear, pin, unpin, health, keys (list
    L1's chunks), fetch (read keys from the peer at `source` into L1), remove (keys,
    from the worker's own tiers) or compress (keys, or all, in `tier` through `method`);
    others are answered ok=False, "unsupported". Removal
    of given keys is its own op, not clear with keys: a worker that predates it then
    answers "unsupported" instead of clearing everything."""

    rid: int
    event_id: str
    op: str
    tier: str = ""
    keys: list[str] = []
    source: str = ""  # fetch: the P2P endpoint to read from
    # The worker answers within this many seconds (0: no deadline of its own).
    deadline_s: float = 0.0
    method: str = ""  # compress: the codec


# -- controller → index subscribers (pushed, rid 0; seq counts pushes in an epoch) ----


class IndexWorker(msgspec.Struct, frozen=True, array_like=True, gc=False):
    worker_id: str
    instance_id: str
    rank: int
    world_size: int
    namespaces: list[str]
    p2p_endpoint: str = ""
    lookup_endpoint: str = ""


class WorkerJoined(wire.Message, tag="ix_join"):
    rid: int
    epoch: str
    seq: int
    worker: IndexWorker


class WorkerLeft(wire.Message, tag="ix_leave"):
    rid: int
    epoch: str
    seq: int
    worker_id: str


class WorkerReplaced(wire.Message, tag="ix_state"):
    rid: int
    epoch: str
    seq: int
    worker_id: str
    tiers: dict[str, bytes]  # tier → uint64 chunk ints


class IndexEvents(wire.Message, tag="ix_events"):
    """One KV event batch: runs of (EventKind, tier, uint64 chunk ints), in order."""

    rid: int
    epoch: str
    seq: int
    worker_id: str
    runs: list[tuple[int, str, bytes]]


IndexPush = WorkerJoined | WorkerLeft | WorkerReplaced | IndexEvents

# -- replies -------------------------------------------------------------------------


class HelloReply(wire.Message, tag="hello_r"):
    rid: int
    version: int
    server: str


class RegisterReply(wire.Message, tag="register_r"):
    rid: int
    worker_id: str


class DeregisterReply(wire.Message, tag="deregister_r"):
    rid: int
    dropped_chunks: int


class HeartbeatReply(wire.Message, tag="heartbeat_r"):
    rid: int
    resync: bool = False  # the controller also pushed a Resync


class FullStateReply(wire.Message, tag="full_state_r"):
    rid: int
    chunks: int


class P2PLookupReply(wire.Message, tag="p2p_lookup_r"):
    rid: int
    instance_id: str = ""
    rank: int = -1
    endpoint: str = ""
    count: int = 0  # 0: no peer holds the first key


class WorkerInfo(msgspec.Struct, frozen=True, array_like=True, gc=False):
    worker_id: str
    instance_id: str
    rank: int
    world_size: int
    p2p_endpoint: str
    chunks: dict[str, int]  # tier → chunk count
    last_seq: int
    seen_s_ago: float
    restored: bool  # known from the snapshot, not re-registered yet
    lookup_endpoint: str = ""


class ListWorkersReply(wire.Message, tag="list_workers_r"):
    rid: int
    workers: list[WorkerInfo]


class InstancePrefix(msgspec.Struct, frozen=True, array_like=True, gc=False):
    instance_id: str
    world_size: int
    ranks: int  # ranks registered; fewer than world_size: chunks is 0
    chunks: int  # leading chunks every rank holds, in any tier
    l1_chunks: int  # of those, leading chunks every rank holds in L1


class PrefixCountsReply(wire.Message, tag="prefix_counts_r"):
    rid: int
    instances: list[InstancePrefix]  # most chunks first


class WorkerResult(msgspec.Struct, frozen=True, array_like=True, gc=False):
    worker_id: str
    ok: bool
    count: int = 0
    error: str = ""
    detail: dict[str, int] = {}


class AdminReply(wire.Message, tag="admin_r"):
    rid: int
    event_id: str
    done: bool  # every worker answered (or timed out); False: still running
    results: list[WorkerResult]


class IndexWorkerState(msgspec.Struct, frozen=True, array_like=True, gc=False):
    worker: IndexWorker
    tiers: dict[str, bytes]  # tier → uint64 chunk ints


class IndexSnapshotReply(wire.Message, tag="index_snapshot_r"):
    rid: int
    epoch: str
    seq: int  # the snapshot holds every push up to this one; seq + 1 comes next
    workers: list[IndexWorkerState]


class IndexTick(wire.Message, tag="index_tick"):
    rid: int
    epoch: str
    seq: int  # the last push sent to this subscriber before this tick


class ErrorReply(wire.Message, tag="error"):
    rid: int
    code: int
    message: str
    retryable: bool = False


Reply = (
    HelloReply
    | RegisterReply
    | DeregisterReply
    | HeartbeatReply
    | FullStateReply
    | P2PLookupReply
    | ListWorkersReply
    | PrefixCountsReply
    | AdminReply
    | IndexSnapshotReply
    | IndexTick
    | ErrorReply
)
# What a client's socket receives: replies and the controller's pushes.
WorkerInbound = Reply | Resync | Command | IndexPush

# A client's socket receives the controller's pushes too, so replies decode as
# WorkerInbound.
codec: wire.Codec[Request, WorkerInbound, ErrorReply] = wire.Codec(
    Request, WorkerInbound, ErrorReply, ErrorCode, RETRYABLE
)
MalformedMessage = wire.MalformedMessage
REQUEST_TAGS = codec.request_tags
encode = codec.encode
error_reply = codec.error_reply
decode_request = codec.decode_request
decode_reply = codec.decode_reply

"""TransferChannel: how chunk bytes move from a peer's L1 into local buffers.

A channel reads the chunks a peer holds for some keys into buffers the caller
allocates, and reports each chunk's metadata (checksum included). It moves bytes and
checks the framing; checking the bytes against the checksum is the caller's job (the
P2P tier), so a channel never decides what is valid KV.

- `ZmqChannel` (channel_zmq.py): the peer sends the bytes as ZMQ frames over TCP.
- `NixlChannel` (channel_nixl.py): the peer pins the chunks and tells their addresses;
  the reader pulls them with NIXL READs (UCX; DRAM to DRAM here).

Disaggregated prefill goes the other way: a prefiller `write`s chunk layers into
buffers a decoder allocated for it (a NIXL WRITE, or PushChunks frames over ZMQ).

`make_channel("auto")` is NIXL when the `nixl_cu13` package imports, else ZMQ.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

from kvmesh.common.memory import MemoryObj
from kvmesh.common.protocol.p2p import MAX_HEADER_BYTES, ChunkMeta, HelloReply, Reply, Request
from kvmesh.common.transport.peer_conn import (
    DEFAULT_IDLE_S,
    PeerConnections,
    PeerError,
    StuckTransfer,
)

if TYPE_CHECKING:
    from kvmesh.common.transport.curve import CurveKeys

# Allocate a local buffer for a chunk the peer described; None when there is no room.
AllocFn = Callable[[ChunkMeta], MemoryObj | None]
Landed = tuple[ChunkMeta, MemoryObj]
# Called off the event loop with (chunk, offset, length) for each byte range of a chunk
# once it has landed, while later ranges may still be in flight: the caller's hashing
# overlaps the copy. A chunk's ranges come in order, one after the other, from offset 0
# to its end, never two of one chunk at once.
LandedFn = Callable[[ChunkMeta, MemoryObj, int, int], None]
# A chunk to write to a PD receiver: (its index in the allocation, the local chunk,
# the address of its receive buffer at the peer).
Piece = tuple[int, MemoryObj, int]

__all__ = [
    "AllocFn",
    "Landed",
    "LandedFn",
    "PeerError",
    "Piece",
    "StuckTransfer",
    "TransferChannel",
    "make_channel",
    "nixl_available",
]


class TransferChannel(Protocol):
    name: str

    async def read(
        self,
        endpoint: str,
        keys: Sequence[str],
        alloc: AllocFn,
        timeout_s: float,
        on_landed: LandedFn | None = None,
    ) -> list[Landed]:
        """The chunks of keys the peer at endpoint holds, landed in buffers from alloc
        (one reference each for the caller), in the order of keys; keys it lacks are
        left out. Raises PeerError (having freed its buffers) when the peer is dead,
        slow past timeout_s, or answers garbage. Runs on the owner's event loop.

        on_landed, if given, may be called (off the loop) with the byte ranges of some
        or all of the landed chunks before read returns, each range once; an exception
        it raises is logged and ignored. A channel that cannot overlap it with the
        transfer does not call it."""
        ...

    async def call(self, endpoint: str, make: Callable[[int], Request], timeout_s: float) -> Reply:
        """One request (built by make from a fresh rid) to the peer, and its reply.
        Raises PeerError as read does."""
        ...

    async def write(
        self,
        endpoint: str,
        alloc_id: int,
        layer: int,
        pieces: Sequence[Piece],
        timeout_s: float,
        *,
        agent: str | None = None,
    ) -> None:
        """Write layer (-1: all) of each piece's chunk into the receive buffers of a
        PD allocation at the peer. agent: the NIXL agent the allocation's reply named
        (the buffers are in its memory; "": the reply named none; None: no reply to go
        by). Raises PeerError when it did not complete."""
        ...

    async def write_groups(
        self,
        endpoint: str,
        alloc_id: int,
        layer: int,
        groups: Sequence[Sequence[Piece]],
        timeout_s: float,
        on_written: Callable[[int], None],
        *,
        agent: str | None = None,
    ) -> None:
        """write each group in order, back to back, calling on_written(i) on the event
        loop as soon as group i is complete (so its commit overlaps the next group's
        write). Raises PeerError at the first group that did not complete; the groups
        before it were reported."""
        ...

    def hello_fields(self) -> tuple[str, bytes]:
        """(agent name, agent metadata) a peer server hands its readers; empty for ZMQ."""
        ...

    async def aclose(self) -> None: ...


def nixl_available() -> bool:
    try:
        import nixl_cu13._api  # noqa: F401
    except Exception:  # ImportError, or a broken native library
        return False
    return True


def make_channel(
    kind: str,
    name: str,
    regions: Sequence[tuple[int, int]] = (),
    *,
    curve: CurveKeys | None = None,
    idle_s: float = DEFAULT_IDLE_S,
) -> TransferChannel:
    """A channel by config value (auto|nixl|zmq). regions: (address, length) of the
    memory NIXL registers, the engine's L1 pool, served to peers and read into. curve:
    the CurveKeys its connections to peers use (None: plain). idle_s: a peer's
    connection (and NIXL agent) unused this long is let go."""
    from kvmesh.common.transport.channel_zmq import ZmqChannel

    if kind == "zmq" or (kind == "auto" and not nixl_available()):
        return ZmqChannel(PeerConnections(curve, peer_frame_bound(regions), idle_s))
    if kind not in ("auto", "nixl"):
        raise ValueError(f"unknown p2p channel {kind!r} (auto, nixl or zmq)")
    from kvmesh.common.transport.channel_nixl import NixlChannel

    return NixlChannel(name, regions, curve=curve, idle_s=idle_s)


def peer_frame_bound(regions: Sequence[tuple[int, int]]) -> int:
    """The largest frame a peer may send: no valid one is larger than the pool it lands
    in, plus a header; -1 (any) without a pool."""
    return sum(n for _, n in regions) + MAX_HEADER_BYTES if regions else -1


def check_hello(reply: object) -> HelloReply:
    if not isinstance(reply, HelloReply):
        raise PeerError(f"unexpected reply to hello: {type(reply).__name__}")
    return reply

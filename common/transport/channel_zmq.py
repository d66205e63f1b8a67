"""The ZMQ/TCP TransferChannel: the peer sends each chunk as one payload frame.

Works between any two hosts that can open a TCP connection; costs a copy on each side
(the peer's send, our landing copy into the L1 buffer), which NIXL avoids.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np

from kvmesh.common import offload
from kvmesh.common.memory import MemoryObj
from kvmesh.common.protocol import p2p as proto
from kvmesh.common.transport.channel import AllocFn, Landed, LandedFn, Piece
from kvmesh.common.transport.chunk_regions import layer_regions
from kvmesh.common.transport.peer_conn import PeerConnections, PeerError


def _copy_frames(landed: list[Landed], frames: list[memoryview]) -> None:
    for (_, obj), buf in zip(landed, frames, strict=True):
        obj.raw.numpy()[:] = np.frombuffer(buf, dtype=np.uint8)


def _release(landed: list[Landed]) -> None:
    for _, obj in landed:
        obj.ref_down()


class ZmqChannel:
    name = "zmq"

    def __init__(self, conns: PeerConnections | None = None) -> None:
        self._conns = conns if conns is not None else PeerConnections()

    def hello_fields(self) -> tuple[str, bytes]:
        return "", b""

    async def read(
        self,
        endpoint: str,
        keys: Sequence[str],
        alloc: AllocFn,
        timeout_s: float,
        on_landed: LandedFn | None = None,
    ) -> list[Landed]:
        # on_landed is not called: the bytes are all here before the first copy, so
        # there is no transfer for a check to overlap with.
        conn = self._conns.get(endpoint)
        msg = proto.ReadChunks(
            conn.next_rid(), proto.PROTOCOL_VERSION, list(keys), time.time() + timeout_s
        )
        reply, payloads = await conn.request(msg, timeout_s)
        if not isinstance(reply, proto.ReadChunksReply):
            self._conns.drop(endpoint)
            raise PeerError(f"unexpected reply to read: {type(reply).__name__}")
        landed: list[Landed] = []
        frames: list[memoryview] = []
        try:
            for meta, frame in zip(reply.chunks, payloads, strict=True):
                buf = frame.buffer
                if len(buf) != meta.nbytes:
                    raise PeerError(
                        f"chunk {meta.key}: {len(buf)} bytes sent, {meta.nbytes} announced"
                    )
                obj = alloc(meta)
                if obj is None:
                    break  # no room: what landed so far is still good
                landed.append((meta, obj))
                frames.append(buf)
                if obj.nbytes != meta.nbytes:  # a shape or dtype of another size
                    raise PeerError(
                        f"chunk {meta.key}: buffer of {obj.nbytes} bytes for {meta.nbytes}"
                    )
        except Exception:
            _release(landed)
            raise
        try:
            if sum(meta.nbytes for meta, _ in landed) < offload.OFFLOAD_FROM:
                _copy_frames(landed, frames)
                return landed
            # Abandoned by a cancel, the thread may still be writing into the buffers:
            # they are freed after it.
            await offload.offload(
                _copy_frames, landed, frames, abandoned=lambda _: _release(landed)
            )
        except Exception:
            _release(landed)
            raise
        return landed

    async def call(
        self, endpoint: str, make: Callable[[int], proto.Request], timeout_s: float
    ) -> proto.Reply:
        conn = self._conns.get(endpoint)
        return (await conn.request(make(conn.next_rid()), timeout_s))[0]

    async def write(
        self,
        endpoint: str,
        alloc_id: int,
        layer: int,
        pieces: Sequence[Piece],
        timeout_s: float,
        *,
        agent: str | None = None,  # NIXL's; a restarted decoder refuses the unknown alloc_id
    ) -> None:
        spans = [(obj, layer_regions(obj, layer)) for _, obj, _ in pieces]
        gathered = sum(n for _, regions in spans if len(regions) > 1 for _, n in regions)
        if gathered < offload.OFFLOAD_FROM:
            frames = _frames(spans)
        else:  # megabytes of K and V regions put side by side: on a thread
            frames = await offload.offload(_frames, spans)
        conn = self._conns.get(endpoint)
        msg = proto.PushChunks(
            conn.next_rid(), proto.PROTOCOL_VERSION, alloc_id, layer, [i for i, _, _ in pieces]
        )
        reply, _ = await conn.request(msg, timeout_s, frames)
        if not isinstance(reply, proto.PushChunksReply):
            self._conns.drop(endpoint)
            raise PeerError(f"unexpected reply to push: {type(reply).__name__}")

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
        deadline = time.monotonic() + timeout_s
        for i, group in enumerate(groups):
            left = deadline - time.monotonic()
            if left <= 0:
                raise PeerError(f"PD write of group {i} past its deadline")
            await self.write(endpoint, alloc_id, layer, group, left)
            on_written(i)

    async def aclose(self) -> None:
        self._conns.close()


def _frames(spans: Sequence[tuple[MemoryObj, list[tuple[int, int]]]]) -> list[np.ndarray]:
    """Each chunk's regions as one buffer (a view when it is one region)."""
    out = []
    for obj, regions in spans:
        raw = obj.raw.numpy()
        if len(regions) == 1:
            off, n = regions[0]
            out.append(raw[off : off + n])
        else:
            out.append(np.concatenate([raw[off : off + n] for off, n in regions]))
    return out

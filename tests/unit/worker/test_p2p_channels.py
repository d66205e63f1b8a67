"""The P2P tier's channels against a fake peer (a ROUTER in the test) and, for NIXL, two
real agents in this process: what a read frees and releases when it fails or is
cancelled, and how one connection's failure reaches the other requests on it."""

from __future__ import annotations

import asyncio
import gc
import socket
import threading
import time
from collections.abc import Awaitable, Callable

import pytest
import torch
import zmq
import zmq.asyncio

from kvmesh.common.chunk_codec import chunk_bytes, payload_checksum
from kvmesh.common.keys import ChunkKey
from kvmesh.common.memory import HostMemoryPool, MemoryFormat, MemoryObj
from kvmesh.common.protocol import p2p as proto
from kvmesh.common.transport.channel import nixl_available
from kvmesh.common.transport.channel_zmq import ZmqChannel
from kvmesh.common.transport.peer_conn import PeerConnections, PeerError

CHUNK = 64 << 10
PAGES = 8
KEY_A = ChunkKey("0123456789abcdef", b"\x0a" * 16).to_str()
KEY_B = ChunkKey("0123456789abcdef", b"\x0b" * 16).to_str()
needs_nixl = pytest.mark.skipif(not nixl_available(), reason="nixl_cu13 is not installed")

# The fake peer: answers a decoded request with a reply and payload frames, or None.
Answer = Callable[[proto.Request], Awaitable[tuple[proto.Reply, list[bytes]] | None]]


async def _serve(sock: zmq.asyncio.Socket, answer: Answer) -> None:
    async def one(ident: bytes, msg: proto.Request) -> None:
        out = await answer(msg)
        if out is not None:
            await sock.send_multipart([ident, proto.encode(out[0]), *out[1]])

    tasks = set()
    while True:
        ident, raw = await sock.recv_multipart()
        task = asyncio.create_task(one(ident, proto.codec.decode_request(raw)))
        tasks.add(task)
        task.add_done_callback(tasks.discard)


async def _with_peer(answer: Answer, body: Callable[[str], Awaitable[None]]) -> None:
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.linger = 0
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    peer = asyncio.create_task(_serve(sock, answer))
    try:
        await body(f"tcp://127.0.0.1:{port}")
    finally:
        peer.cancel()
        sock.close(0)
        ctx.term()


async def _until(cond: Callable[[], bool]) -> None:
    """Polls cond (set from another thread) for up to 3 s."""
    deadline = time.monotonic() + 3.0
    while not cond() and time.monotonic() < deadline:  # noqa: ASYNC110
        await asyncio.sleep(0.01)


@pytest.fixture
def pools():
    made = [HostMemoryPool(PAGES * CHUNK, page_size=CHUNK, reserve_bytes=0) for _ in range(2)]
    yield made
    for pool in made:
        pool.close()


def _alloc(pool: HostMemoryPool) -> Callable[[proto.ChunkMeta], MemoryObj | None]:
    return lambda meta: pool.allocate(tuple(meta.shape), torch.uint8, MemoryFormat(meta.fmt))


# -- peer connections -------------------------------------------------------------------


def test_closing_a_connection_fails_its_pending_requests_with_peer_error() -> None:
    async def silent(msg: proto.Request) -> None:
        return None

    async def body(endpoint: str) -> None:
        conns = PeerConnections()
        conn = conns.get(endpoint)
        pending = [
            asyncio.create_task(conn.request(proto.Hello(conn.next_rid(), 1), 5.0))
            for _ in range(2)
        ]
        await asyncio.sleep(0.1)
        conns.drop(endpoint)  # what a channel does after another request's failure
        for task in pending:
            # Their tasks were not cancelled: a miss (PeerError), not a CancelledError.
            with pytest.raises(PeerError, match="closed"):
                await task
        conns.close()

    asyncio.run(_with_peer(silent, body))


def test_dropping_a_failed_connection_leaves_a_newer_one() -> None:
    """Requests failed with one connection each drop "their" connection: one that
    another request has opened since to the same peer stays."""

    async def silent(msg: proto.Request) -> None:
        return None

    async def body(endpoint: str) -> None:
        conns = PeerConnections()
        old = conns.get(endpoint)
        pending = asyncio.create_task(old.request(proto.Hello(old.next_rid(), 1), 5.0))
        await asyncio.sleep(0.1)
        assert conns.drop(endpoint, old)  # the first failure drops it
        with pytest.raises(PeerError) as failed:
            await pending
        assert failed.value.conn is old
        new = conns.get(endpoint)  # another read opens a fresh one
        assert new is not old
        assert not conns.drop(endpoint, failed.value.conn)  # the late failure: no effect
        assert conns.get(endpoint) is new and not new.broken
        conns.close()

    asyncio.run(_with_peer(silent, body))


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def test_idle_connections_are_closed_and_busy_ones_kept() -> None:
    """A peer that went away for good (its address never asked for again) must not keep
    a socket redialling it for the life of the process: a connection unused for idle_s
    is closed, and its owner told, at the next get(); one awaiting a reply, and the one
    asked for, stay."""
    closed: list[str] = []

    async def silent(msg: proto.Request) -> None:
        return None

    async def body(endpoint: str) -> None:
        gone, other = (f"tcp://127.0.0.1:{port}" for port in _free_ports(2))  # no one there
        conns = PeerConnections(idle_s=0.4, on_idle=closed.append)
        dead = conns.get(gone)
        busy = conns.get(endpoint)
        pending = asyncio.create_task(busy.request(proto.Hello(busy.next_rid(), 1), 5.0))
        await asyncio.sleep(0.6)
        assert conns.get(gone) is dead  # the endpoint asked for is never the one closed
        assert closed == []
        await asyncio.sleep(0.6)
        conns.get(other)  # any other endpoint: get() is when idle ones are closed
        assert closed == [gone] and dead.broken
        assert conns.get(endpoint) is busy and not busy.broken  # a reply is awaited
        fresh = conns.get(gone)  # asked again: a new connection
        assert fresh is not dead and not fresh.broken
        pending.cancel()
        conns.close()

    asyncio.run(_with_peer(silent, body))


def test_requests_failed_by_a_timeout_leave_no_unread_error() -> None:
    """A timeout fails every pending reply future, its own and those of requests still
    sending (with no peer to take them, IMMEDIATE, sends wait). Each request ends with
    a PeerError; the failures set on their futures must have been read, not logged at
    collection as "Future exception was never retrieved" (one per timeout in the
    engine's log)."""
    unread: list[str] = []

    async def body() -> None:
        asyncio.get_running_loop().set_exception_handler(
            lambda loop, ctx: unread.append(str(ctx.get("message")))
        )
        with socket.socket() as s:  # a port where nothing listens
            s.bind(("127.0.0.1", 0))
            endpoint = f"tcp://127.0.0.1:{s.getsockname()[1]}"
        conns = PeerConnections()
        conn = conns.get(endpoint)
        first = asyncio.create_task(conn.request(proto.Hello(conn.next_rid(), 1), 0.1))
        second = asyncio.create_task(conn.request(proto.Hello(conn.next_rid(), 1), 0.4))
        for task in (first, second):
            with pytest.raises(PeerError, match="did not answer"):
                await task
        conns.close()

    asyncio.run(body())
    gc.collect()  # the loop's frames are gone: an unread failure is reported now
    assert unread == []


# -- the ZMQ channel ------------------------------------------------------------------------


def test_zmq_reply_whose_shape_disagrees_with_its_size_is_a_peer_error_and_frees_its_buffer(
    pools,
) -> None:
    pool = pools[0]
    payload = b"\x01" * 2048

    async def liar(msg: proto.Request) -> tuple[proto.Reply, list[bytes]]:
        assert isinstance(msg, proto.ReadChunks)
        # 2048 bytes announced and sent, but a shape of 1024 uint8.
        meta = proto.ChunkMeta(KEY_A, 2048, payload_checksum(payload), [1024], "uint8", 1)
        return proto.ReadChunksReply(msg.rid, [meta]), [payload]

    async def body(endpoint: str) -> None:
        channel = ZmqChannel()
        for _ in range(3):
            with pytest.raises(PeerError, match="buffer of 1024 bytes for 2048"):
                await channel.read(endpoint, [KEY_A], _alloc(pool), 2.0)
            assert pool.used_bytes == 0
        await channel.aclose()

    asyncio.run(_with_peer(liar, body))


# -- the NIXL channel -----------------------------------------------------------------------


def _nixl(name: str, pool: HostMemoryPool):
    from kvmesh.common.transport.channel_nixl import NixlChannel

    base = pool.allocate((CHUNK,), torch.uint8, MemoryFormat.KV_2LTD)
    region = (base.data_ptr, PAGES * CHUNK)
    base.ref_down()
    return NixlChannel(name, [region])


def _shut(*channels) -> None:
    for channel in channels:
        channel._conns.close()
        channel._pool.shutdown()
        channel._checker.shutdown()
        channel.agent = None


@needs_nixl
def test_a_cancelled_nixl_read_lets_go_only_once_its_read_has_ended(pools, monkeypatch) -> None:
    from kvmesh.common.transport.channel_nixl import NixlChannel

    reading, go = threading.Event(), threading.Event()
    transfer = NixlChannel._transfer

    def held(self, *args, **kw) -> None:  # a big or remote READ: it takes a while
        reading.set()
        assert go.wait(5)
        transfer(self, *args, **kw)

    monkeypatch.setattr(NixlChannel, "_transfer", held)
    src_pool, dst_pool = pools
    server, reader = _nixl("server", src_pool), _nixl("reader", dst_pool)
    src = src_pool.allocate((CHUNK,), torch.uint8, MemoryFormat.KV_2LTD)
    src.raw.fill_(0x55)
    released: list[int] = []
    landed: list[MemoryObj] = []

    async def peer(msg: proto.Request) -> tuple[proto.Reply, list[bytes]] | None:
        if isinstance(msg, proto.Hello):
            return proto.HelloReply(msg.rid, 1, "peer", 0, *server.hello_fields()), []
        if isinstance(msg, proto.PinChunks):
            checksum = payload_checksum(chunk_bytes(src))
            meta = proto.ChunkMeta(KEY_A, CHUNK, checksum, [CHUNK], "uint8", 1, src.data_ptr)
            return proto.PinChunksReply(msg.rid, 7, [meta]), []
        assert isinstance(msg, proto.ReleaseChunks)
        released.append(msg.lease)
        return None

    def alloc(meta: proto.ChunkMeta) -> MemoryObj | None:
        obj = _alloc(dst_pool)(meta)
        landed.append(obj)
        return obj

    async def body(endpoint: str) -> None:
        read = asyncio.create_task(reader.read(endpoint, [KEY_A], alloc, 5.0))
        await _until(reading.is_set)
        read.cancel()
        with pytest.raises(asyncio.CancelledError):
            await read
        await asyncio.sleep(0.2)
        # The READ still runs into the landing buffer, from the peer's page: neither
        # is let go, so no other chunk can take either page meanwhile.
        assert not landed[0].is_freed and released == []
        go.set()
        await _until(lambda: landed[0].is_freed and bool(released))
        assert landed[0].is_freed and released == [7]
        assert dst_pool.used_bytes == 0

    try:
        asyncio.run(_with_peer(peer, body))
    finally:
        go.set()
        src.ref_down()
        _shut(server, reader)


@needs_nixl
def test_a_peer_refusing_one_nixl_read_leaves_the_others_on_its_connection(pools) -> None:
    src_pool, dst_pool = pools
    server, reader = _nixl("server", src_pool), _nixl("reader", dst_pool)

    async def peer(msg: proto.Request) -> tuple[proto.Reply, list[bytes]] | None:
        if isinstance(msg, proto.Hello):
            return proto.HelloReply(msg.rid, 1, "peer", 0, *server.hello_fields()), []
        if isinstance(msg, proto.PinChunks) and msg.keys == [KEY_A]:
            return proto.error_reply(msg.rid, proto.ErrorCode.DEADLINE_EXCEEDED, "late"), []
        if isinstance(msg, proto.PinChunks):
            await asyncio.sleep(0.2)
            return proto.PinChunksReply(msg.rid, 1, []), []
        return None

    async def body(endpoint: str) -> None:
        await reader.read(endpoint, [], _alloc(dst_pool), 2.0)  # hello: connected
        conn = reader._conns.get(endpoint)
        # A reply can never be larger than this L1 and a header: nor can a frame.
        assert conn._sock.getsockopt(zmq.MAXMSGSIZE) == PAGES * CHUNK + proto.MAX_HEADER_BYTES
        b = asyncio.create_task(reader.read(endpoint, [KEY_B], _alloc(dst_pool), 2.0))
        await asyncio.sleep(0.05)
        with pytest.raises(PeerError, match="code 5"):
            await reader.read(endpoint, [KEY_A], _alloc(dst_pool), 2.0)
        assert await b == []  # answered on the same, kept, connection
        assert reader._conns.get(endpoint) is conn

    try:
        asyncio.run(_with_peer(peer, body))
    finally:
        _shut(server, reader)

"""The P2P server of an engine in this process, spoken to by hand over a DEALER: what
happens to the chunks behind replies a reader never takes, and its lease ids."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch
import zmq
from kvtest.waiting import wait_for

from kvmesh.common.config import EngineConfig, L1Config, P2PConfig
from kvmesh.common.memory import MemoryObj
from kvmesh.common.protocol import p2p as proto
from kvmesh.common.transport.channel import nixl_available
from kvmesh.services.worker import p2p_server
from kvmesh.services.worker.engine import KVEngine

LAYERS, HEADS, HEAD_DIM, CHUNK_TOKENS, N = 4, 8, 64, 256, 4  # 2 MiB chunks, 8 MiB a read


def engine(channel: str) -> KVEngine:
    kv = [torch.zeros(2, HEADS, 16, 2 * HEAD_DIM, dtype=torch.float16) for _ in range(LAYERS)]
    chunk = LAYERS * CHUNK_TOKENS * HEADS * 2 * HEAD_DIM * 2
    cfg = EngineConfig(
        chunk_size=CHUNK_TOKENS,
        model_name="p2p-server",
        l1=L1Config(max_size=(N + 1) * chunk + (1 << 20), reserve=0),
        p2p=P2PConfig(enabled=True, channel=channel, timeout_s=5.0),
        close_flush_s=0,
    )
    return KVEngine(f"server-{channel}", 0, cfg, kv)


def store(e: KVEngine) -> tuple[list[str], list[MemoryObj]]:
    """N chunks put in e's L1: their keys, and the objects (L1 holds the one reference)."""
    keys, objs = [], []
    for i in range(N):
        obj = e.storage.l1.allocate(
            e.layout.chunk_shape(CHUNK_TOKENS), e.layout.dtype, e.chunk_format
        )
        obj.raw.fill_(i)
        key = e.namespace.key(i.to_bytes(16, "little"))
        obj.key = key
        e.storage.put(key, obj)
        keys.append(key.to_str())
        objs.append(obj)
    return keys, objs


@pytest.fixture
def sock() -> Iterator[zmq.Socket]:
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.linger = 0
    s.rcvtimeo = 5000
    yield s
    ctx.destroy(linger=0)


def test_replies_a_reader_never_takes_let_go_of_their_chunks_once_zmq_drops_them(
    sock, monkeypatch
) -> None:
    monkeypatch.setattr(p2p_server, "SEND_WAIT_S", 0.2)
    e = engine("zmq")
    try:
        keys, objs = store(e)
        # A reader that asks, then stalls (host hung, network cut): it takes at most
        # one reply into its queue, so most of 8 replies of 8 MiB stay with the server.
        sock.setsockopt(zmq.RCVHWM, 1)
        sock.setsockopt(zmq.RCVBUF, 1 << 16)
        sock.connect(e.p2p_endpoint)
        for rid in range(8):
            sock.send(proto.encode(proto.ReadChunks(rid, proto.PROTOCOL_VERSION, keys)))
        # Served (on the engine's loop, when it gets to it): the queued replies hold
        # the pages, and still do past SEND_WAIT_S.
        wait_for(lambda: all(obj.ref_count > 1 for obj in objs), 10, "the replies queued")
        time.sleep(p2p_server.SEND_WAIT_S + 0.3)
        assert all(obj.ref_count > 1 for obj in objs)  # replies queued, pages held
        sock.close(0)  # its connection ends: ZMQ drops what it queued for it
        deadline = time.monotonic() + 5.0
        while any(obj.ref_count > 1 for obj in objs) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [obj.ref_count for obj in objs] == [1] * N  # only L1's: evictable again
    finally:
        e.close()


@pytest.mark.skipif(not nixl_available(), reason="nixl_cu13 is not installed")
def test_lease_ids_are_random_not_counted(sock) -> None:
    """A ReleaseChunks meant for a lease of this server's previous run must not name a
    lease another reader holds now: ids are not 1, 2, 3 in every run."""
    e = engine("nixl")
    try:
        keys, _ = store(e)
        sock.connect(e.p2p_endpoint)
        leases = []
        for rid in range(2):
            sock.send(proto.encode(proto.PinChunks(rid, proto.PROTOCOL_VERSION, keys[:1])))
            reply = proto.decode_reply(sock.recv_multipart())
            assert isinstance(reply, proto.PinChunksReply) and len(reply.chunks) == 1
            leases.append(reply.lease)
        assert leases[0] != leases[1] and min(leases) >= 1 << 32
        for rid, lease in enumerate(leases, 2):
            sock.send(proto.encode(proto.ReleaseChunks(rid, proto.PROTOCOL_VERSION, lease)))
            assert proto.decode_reply(sock.recv_multipart()) == proto.ReleaseChunksReply(rid, True)
    finally:
        e.close()


def test_a_message_of_more_frames_than_any_request_has_is_refused(sock) -> None:
    """ZMQ bounds a frame's size, not a message's frame count: past a push's one frame a
    chunk, the frames are read only to be dropped, and the request is refused by rid."""
    e = engine("zmq")
    try:
        keys, _ = store(e)
        sock.connect(e.p2p_endpoint)
        head = proto.encode(proto.ReadChunks(7, proto.PROTOCOL_VERSION, keys[:1]))
        sock.send_multipart([head, *([b""] * 50_000)])
        reply = proto.decode_reply(sock.recv_multipart())
        assert isinstance(reply, proto.ErrorReply), reply
        assert (reply.rid, reply.code) == (7, proto.ErrorCode.BAD_MESSAGE)
        assert "50000 frames" in reply.message
        sock.send(proto.encode(proto.ReadChunks(8, proto.PROTOCOL_VERSION, keys[:1])))
        frames = sock.recv_multipart()
        reply = proto.decode_reply(frames)
        assert isinstance(reply, proto.ReadChunksReply) and len(frames) == 2
        # Counted by the code's name, as every service's errors_total is.
        assert e.stats.metrics.value("p2p_server_errors_total", {"code": "bad_message"}) == 1
    finally:
        e.close()

"""NixlChannel's overlapped read between two real NIXL agents in this process (UCX over
shared memory): every chunk lands intact and each of its byte ranges reaches on_landed
once, in order; and which UCX transport lists let the channel run without a progress thread."""

from __future__ import annotations

import threading
import time

import pytest
import torch
import xxhash

from kvmesh.common.chunk_codec import chunk_bytes, payload_checksum
from kvmesh.common.memory import HostMemoryPool, MemoryFormat, MemoryObj
from kvmesh.common.protocol.p2p import ChunkMeta
from kvmesh.common.transport import channel_nixl
from kvmesh.common.transport.channel import nixl_available
from kvmesh.common.transport.channel_nixl import NixlChannel, local_only

CHUNK = 64 << 10  # bytes
PAGES = 8


def test_progress_thread_is_left_out_only_for_shared_memory_transports() -> None:
    assert local_only("shm")
    assert local_only("sm,self") and local_only(" cma , posix ")
    assert not local_only("")  # UCX's own choice may be a network
    assert not local_only("tcp") and not local_only("shm,tcp") and not local_only("rc")
    assert not local_only("^tcp")  # everything but tcp: still networks


def test_chunks_cut_into_ranges_then_groups_by_bytes_in_order() -> None:
    metas = [ChunkMeta(f"k{i}", n, 0, [n], "uint8", 1) for i, n in enumerate([3, 7, 1])]
    landed = [(m, object()) for m in metas]
    ranges = channel_nixl._ranges(landed, 3)  # type: ignore[arg-type]
    assert [(m.key, off, n) for m, _, off, n in ranges] == [
        ("k0", 0, 3), ("k1", 0, 3), ("k1", 3, 3), ("k1", 6, 1), ("k2", 0, 1),
    ]  # fmt: skip
    groups = channel_nixl._groups(ranges, 4)
    assert [[(m.key, off) for m, _, off, _ in g] for g in groups] == [
        [("k0", 0), ("k1", 0)], [("k1", 3), ("k1", 6)], [("k2", 0)],
    ]  # fmt: skip
    assert channel_nixl._groups([], 4) == []


@pytest.fixture
def pools():
    a = HostMemoryPool(PAGES * CHUNK, page_size=CHUNK, reserve_bytes=0)
    b = HostMemoryPool(PAGES * CHUNK, page_size=CHUNK, reserve_bytes=0)
    yield a, b
    a.close()
    b.close()


def _channel(name: str, pool: HostMemoryPool) -> NixlChannel:
    base = pool.allocate((CHUNK,), torch.uint8, MemoryFormat.KV_2LTD)
    region = (base.data_ptr, PAGES * CHUNK)
    base.ref_down()
    return NixlChannel(name, [region])


@pytest.mark.skipif(not nixl_available(), reason="nixl_cu13 is not installed")
def test_overlapped_read_lands_every_chunk_and_checks_each_once(pools, monkeypatch) -> None:
    # Ranges of 3/4 chunk: every chunk is cut in two, and groups straddle chunks.
    monkeypatch.setattr(channel_nixl, "PIPELINE_BYTES", 3 * CHUNK // 4)
    src_pool, dst_pool = pools
    server, reader = _channel("server", src_pool), _channel("reader", dst_pool)
    try:
        peer = reader.agent.add_remote_agent(server.agent.get_agent_metadata())
        peer = peer.decode() if isinstance(peer, bytes) else str(peer)
        n = 5
        src = [src_pool.allocate((CHUNK,), torch.uint8, MemoryFormat.KV_2LTD) for _ in range(n)]
        dst = [dst_pool.allocate((CHUNK,), torch.uint8, MemoryFormat.KV_2LTD) for _ in range(n)]
        for obj in src:
            obj.raw.copy_(torch.randint(0, 256, (CHUNK,), dtype=torch.uint8))
        landed = [
            (ChunkMeta(f"k{i}", CHUNK, payload_checksum(chunk_bytes(s)), [CHUNK], "uint8", 1,
                       s.data_ptr), d)
            for i, (s, d) in enumerate(zip(src, dst, strict=True))
        ]  # fmt: skip
        seen: list[tuple[str, int, int, str]] = []
        hashers: dict[str, xxhash.xxh3_64] = {}

        def on_landed(meta: ChunkMeta, obj: MemoryObj, off: int, n: int) -> None:
            seen.append((meta.key, off, n, threading.current_thread().name))
            hashers.setdefault(meta.key, xxhash.xxh3_64()).update(chunk_bytes(obj)[off : off + n])
            if meta.key == "k2":
                raise RuntimeError("a caller's bug")  # logged; the read goes on

        reader._read_overlapped(peer, landed, on_landed, time.monotonic() + 10)
        cut = 3 * CHUNK // 4
        halves = ((0, cut), (cut, CHUNK - cut))
        want = [(f"k{i}", off, size) for i in range(n) for off, size in halves]
        assert [(k, off, size) for k, off, size, _ in seen] == want
        assert all(name.startswith("kvmesh-nixl-check") for *_, name in seen)
        # Hashed range by range, as they landed: each chunk's own checksum.
        assert [hashers[m.key].intdigest() for m, _ in landed] == [m.checksum for m, _ in landed]
        assert all(torch.equal(s.raw, d.raw) for s, d in zip(src, dst, strict=True))
        for obj in (*src, *dst):
            obj.ref_down()
    finally:
        reader._pool.shutdown()
        reader._checker.shutdown()
        server._pool.shutdown()
        server._checker.shutdown()
        reader.agent = server.agent = None


@pytest.mark.skipif(not nixl_available(), reason="nixl_cu13 is not installed")
def test_an_idle_agent_over_shared_memory_leaves_the_cpu_alone(pools, monkeypatch) -> None:
    # NIXL's own progress thread polls without pause: ~80 % of a core per process, idle.
    monkeypatch.setenv("UCX_TLS", "shm")
    channel = _channel("idle", pools[0])
    try:
        t0 = time.process_time()
        time.sleep(0.5)
        assert time.process_time() - t0 < 0.1
    finally:
        channel._pool.shutdown()
        channel._checker.shutdown()
        channel.agent = None


@pytest.mark.parametrize("stuck", [False, True])
def test_a_cancelled_write_ends_with_its_group_in_flight_and_reports_none(
    pools, monkeypatch, stuck: bool
) -> None:
    """Cancelled while one group's WRITE runs: no later group starts, no group is
    reported written (its commit would go out for a cancelled push), and the cancel
    comes only once the WRITE has ended, carrying a StuckTransfer as its cause when NIXL
    would not release it (the caller must then not free the peer's buffers)."""
    import asyncio

    a, _ = pools
    ch = _channel("w-cancel", a)
    started, go = threading.Event(), threading.Event()
    ops: list[str] = []

    def transfer(self, peer, local, remote, deadline, op="READ") -> None:
        ops.append(op)
        started.set()
        assert go.wait(5)
        if stuck:
            raise channel_nixl.StuckTransfer("NIXL WRITE stuck")

    async def peer_agent(self, endpoint, timeout_s, want="") -> str:
        return "peer"

    monkeypatch.setattr(NixlChannel, "_transfer", transfer)
    monkeypatch.setattr(NixlChannel, "_peer_agent", peer_agent)
    obj = a.allocate((CHUNK,), torch.uint8, MemoryFormat.KV_2LTD)
    written: list[int] = []

    async def main() -> BaseException:
        groups = [[(0, obj, 0)], [(1, obj, 0)], [(2, obj, 0)]]
        task = asyncio.ensure_future(
            ch.write_groups("tcp://x:1", 1, -1, groups, 5.0, written.append)
        )
        await asyncio.to_thread(started.wait, 5)
        task.cancel()
        await asyncio.sleep(0.1)
        assert not task.done()  # the WRITE in flight has not ended
        go.set()
        try:
            await asyncio.wait_for(task, 5)
        except asyncio.CancelledError as exc:
            return exc
        raise AssertionError("not cancelled")

    try:
        exc = asyncio.run(main())
        assert ops == ["WRITE"] and written == []
        assert isinstance(exc.__cause__, channel_nixl.StuckTransfer) == stuck
    finally:
        obj.ref_down()
        ch._pool.shutdown(wait=True)


# -- a peer restarted behind its endpoint ----------------------------------------------


class _Endpoint:
    """A ROUTER answering Hello as whichever process `serving` is (a NixlChannel, or
    None for a process that serves ZMQ only): the endpoint a restarted peer took over."""

    def __init__(self) -> None:
        import zmq
        import zmq.asyncio

        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.linger = 0
        self.url = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"
        self.serving: NixlChannel | None = None
        self.hellos = 0

    async def serve(self) -> None:
        from kvmesh.common.protocol import p2p as proto

        while True:
            ident, frame = await self.sock.recv_multipart()
            msg = proto.decode_request([frame])
            assert isinstance(msg, proto.Hello), msg  # nothing else reaches the peer here
            self.hellos += 1
            agent, md = self.serving.hello_fields() if self.serving else ("", b"")
            reply = proto.HelloReply(msg.rid, proto.PROTOCOL_VERSION, "i", 0, agent, md)
            await self.sock.send_multipart([ident, proto.encode(reply)])

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


def _run_against_restarts(pools, body) -> None:
    """body(reader, (X, Y), endpoint, loaded) with two real peer agents X and Y."""
    import asyncio

    a, b = pools
    reader = _channel("rd", a)
    peers = [_channel(n, b) for n in ("x", "y")]  # both over b: only hello'd, never read

    async def main() -> None:
        ep = _Endpoint()
        server = asyncio.create_task(ep.serve())

        def loaded(peer: NixlChannel) -> bool:
            check = reader.agent.check_remote_metadata
            return reader._pool.submit(check, peer.agent_name).result(5)

        try:
            await body(reader, peers, ep, loaded)
        finally:
            server.cancel()
            ep.close()
            for ch in (reader, *peers):
                await ch.aclose()

    asyncio.run(main())


@pytest.mark.skipif(not nixl_available(), reason="nixl_cu13 is not installed")
def test_a_reply_naming_another_agent_is_hello_d_again_and_a_third_is_refused(pools) -> None:
    """The peer's reply names Y where X was hello'd: Hello again (once for every request
    that finds out together), unload X. An allocation
    X made, written once Y answers the endpoint: refused (AgentChanged) before any byte
    moves, and the sound connection is kept."""

    import asyncio

    async def body(reader, peers, ep, loaded) -> None:
        x, y = peers
        ep.serving = x
        assert await reader._peer_agent(ep.url, 2.0) == x.agent_name
        assert await reader._peer_agent(ep.url, 2.0, x.agent_name) == x.agent_name
        assert ep.hellos == 1  # known and named: no Hello
        ep.serving = y  # restarted: every request in flight finds out at once
        asked = [reader._peer_agent(ep.url, 2.0, y.agent_name) for _ in range(8)]
        assert await asyncio.gather(*asked) == [y.agent_name] * 8
        assert ep.hellos == 2 and reader.retired == 1  # one Hello shared by the eight
        assert not loaded(x) and loaded(y)
        conn = reader._conns.get(ep.url)
        obj = pools[0].allocate((CHUNK,), torch.uint8, MemoryFormat.KV_2LTD)
        try:
            with pytest.raises(channel_nixl.AgentChanged, match="served by agent"):
                await reader.write(ep.url, 1, -1, [(0, obj, 0)], 2.0, agent=x.agent_name)
        finally:
            obj.ref_down()
        assert reader._conns.get(ep.url) is conn and ep.url not in reader._doubted
        assert reader._agents[ep.url] == y.agent_name

    _run_against_restarts(pools, body)


@pytest.mark.skipif(not nixl_available(), reason="nixl_cu13 is not installed")
def test_an_allocation_naming_no_agent_is_trusted_only_if_the_endpoint_s_agent_is_unchanged(
    pools,
) -> None:
    """A decoder older than the field (or one serving ZMQ only) names no agent. Where an
    agent is known, a Hello checks first: the same agent, or none (write over ZMQ), is
    trusted; another is refused, since which process allocated cannot be told."""

    async def body(reader, peers, ep, loaded) -> None:
        x, y = peers
        ep.serving = x
        assert await reader._peer_agent(ep.url, 2.0, "") == x.agent_name  # first contact
        assert await reader._peer_agent(ep.url, 2.0, "") == x.agent_name
        assert ep.hellos == 2  # checked, not assumed
        ep.serving = y
        with pytest.raises(channel_nixl.AgentChanged):
            await reader._peer_agent(ep.url, 2.0, "")
        assert reader._agents[ep.url] == y.agent_name and not loaded(x)
        ep.serving = None  # back as a ZMQ-only decoder
        assert await reader._peer_agent(ep.url, 2.0, "") == ""
        assert not loaded(y) and reader.retired == 2

    _run_against_restarts(pools, body)

"""The P2P tier and a peer that stopped answering (audit H20): a real ZMQ channel
aimed at an address nothing listens on, located there by a fixed table, as the
controller goes on naming a dead worker until it misses its heartbeats."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator

import pytest
import zmq
from kvtest.p2p import FixedLocator
from kvtest.service_process import free_port

from kvmesh.common.config import P2PConfig
from kvmesh.common.keys import ChunkKey
from kvmesh.common.memory import HostMemoryPool
from kvmesh.common.protocol import p2p as proto
from kvmesh.common.transport.channel_zmq import ZmqChannel
from kvmesh.services.worker.loop_thread import LoopThread
from kvmesh.services.worker.tiers import p2p
from kvmesh.services.worker.tiers.host import HostTier
from kvmesh.services.worker.tiers.p2p import P2PTier

KEYS = [ChunkKey("0123456789abcdef", bytes([i]) * 16) for i in range(4)]
TIMEOUT_S = 0.3


@pytest.fixture
def loop():
    lt = LoopThread("p2p-churn-test")
    yield lt
    lt.stop()


def count(t: P2PTier, name: str, **labels: str) -> float:
    return t.stats.metrics.value(name, labels)


def tier_at(endpoint: str, loop: LoopThread) -> tuple[P2PTier, HostMemoryPool, HostTier]:
    """A P2P tier whose locator names endpoint for every key, and an L1 to read into."""
    cfg = P2PConfig(enabled=True, timeout_s=TIMEOUT_S)
    t = P2PTier(ZmqChannel(), loop, cfg, lambda: FixedLocator(dict.fromkeys(KEYS, endpoint)), str)
    pool = HostMemoryPool(4 * 4096, page_size=4096, reserve_bytes=0)
    return t, pool, HostTier(pool, alloc_timeout_s=0.1)


def test_a_peer_that_did_not_answer_is_left_alone_for_a_while_then_asked_again(
    loop, monkeypatch
) -> None:
    monkeypatch.setattr(p2p, "PEER_DOWN_S", 1.0)
    dead = f"tcp://127.0.0.1:{free_port()}"
    t, pool, l1 = tier_at(dead, loop)
    try:
        # Two requests looked up before either is retrieved (a scheduler step).
        assert t.batched_contains(KEYS[:2]) == 2 and t.batched_contains(KEYS[2:]) == 2
        t0 = time.monotonic()
        assert loop.run(t.aget(KEYS[0], l1), 5) is None
        assert time.monotonic() - t0 >= TIMEOUT_S * 0.9  # it waited its deadline
        assert count(t, "p2p_gets_total", result="error") == 1
        # One silent read is not enough (a slow peer): the next read asks it again, and
        # its second silence in a row leaves it alone.
        t0 = time.monotonic()
        assert loop.run(t.aget(KEYS[1], l1), 5) is None
        assert time.monotonic() - t0 >= TIMEOUT_S * 0.9
        assert count(t, "p2p_gets_total", result="error") == 2
        # The other request's chunk, located there too: a miss at once, not a wait.
        t0 = time.monotonic()
        assert loop.run(t.aget(KEYS[2], l1), 5) is None
        assert time.monotonic() - t0 < TIMEOUT_S / 3
        assert count(t, "p2p_gets_total", result="down") == 1
        assert count(t, "chunk_misses_total", tier="p2p", reason="remote_down") == 1
        # Lookups naming it count nothing while it is left alone...
        assert t.batched_contains(KEYS) == 0
        assert count(t, "p2p_lookups_total", result="down") == 1
        # ...and name it again after that.
        time.sleep(1.1)
        assert t.batched_contains(KEYS) == 4
        assert count(t, "p2p_lookups_total", result="found") == 3
    finally:
        t.close()
        pool.close()


class SlowPeer(threading.Thread):
    """A ZMQ peer that answers every read with no chunks: the first after `first_s`,
    the others after `each_s`."""

    def __init__(self, port: int, first_s: float, each_s: float = 0.0) -> None:
        super().__init__(daemon=True)
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.bind(f"tcp://127.0.0.1:{port}")
        self.delays = [first_s]
        self.each_s = each_s
        self.stop = False

    def run(self) -> None:
        while not self.stop:
            if not self.sock.poll(50):
                continue
            frames = self.sock.recv_multipart()
            msg = proto.decode_request(frames[1:])
            time.sleep(self.delays.pop() if self.delays else self.each_s)
            self.sock.send_multipart([frames[0], proto.encode(proto.ReadChunksReply(msg.rid, []))])
        self.ctx.destroy(linger=0)


@contextlib.contextmanager
def tier_reading_from(
    loop: LoopThread, first_s: float, each_s: float = 0.0
) -> Iterator[tuple[P2PTier, HostTier, str]]:
    """A SlowPeer, and a tier (with its L1) that every key locates there."""
    port = free_port()
    peer = SlowPeer(port, first_s, each_s)
    peer.start()
    ep = f"tcp://127.0.0.1:{port}"
    t, pool, l1 = tier_at(ep, loop)
    try:
        yield t, l1, ep
    finally:
        peer.stop = True
        t.close()
        pool.close()


def test_a_slow_peer_that_answers_the_next_read_is_never_left_alone(loop) -> None:
    """One read past the deadline (a large prefix, a busy peer) paused a live peer for
    PEER_DOWN_S, every hit of it lost though it answered the next read at once."""
    with tier_reading_from(loop, first_s=0.6) as (t, l1, _):
        assert t.batched_contains(KEYS[:2]) == 2
        assert loop.run(t.aget(KEYS[0], l1), 5) is None  # past its deadline
        time.sleep(0.4)  # the peer is quick from now on
        assert t.batched_contains(KEYS[1:2]) == 1
        assert loop.run(t.aget(KEYS[1], l1), 5) is None  # answered: it holds none
        assert count(t, "p2p_gets_total", result="miss") == 1
        for _ in range(3):
            assert t.batched_contains(KEYS) == 4
        assert count(t, "p2p_lookups_total", result="down") == 0


def test_reads_failing_together_at_one_deadline_are_one_silence(loop) -> None:
    """Two reads pending on one connection fail together when the first one's
    deadline passes: one stall of a live peer counted twice paused it for
    PEER_DOWN_S."""

    async def two_requests(t: P2PTier, l1: HostTier) -> list:
        first = asyncio.ensure_future(t.aget(KEYS[0], l1))
        await asyncio.sleep(0.05)  # another request's prefix, a later loop turn
        second = asyncio.ensure_future(t.aget(KEYS[1], l1))
        return await asyncio.gather(first, second)

    with tier_reading_from(loop, first_s=0.6) as (t, l1, _):
        assert t.batched_contains(KEYS) == 4
        assert loop.run(two_requests(t, l1), 5) == [None, None]
        assert count(t, "p2p_gets_total", result="error") == 2
        time.sleep(0.4)  # the peer is quick from now on
        assert t.batched_contains(KEYS) == 4
        assert count(t, "p2p_lookups_total", result="down") == 0


def test_a_connection_closed_under_a_read_is_no_silence(loop) -> None:
    """A connection dropped for another request's failure (a NIXL transfer late after
    its pin reply, a PD push past its deadline) fails the reads pending on it: that is
    not the peer's silence, and twice of it paused a live peer."""

    async def read_cut_short(t: P2PTier, l1: HostTier, ep: str, key: ChunkKey) -> object:
        got = asyncio.ensure_future(t.aget(key, l1))
        await asyncio.sleep(0.05)
        t.channel._conns.drop(ep)  # as NixlChannel._forget does after such a failure
        return await got

    with tier_reading_from(loop, first_s=0.15, each_s=0.15) as (t, l1, ep):
        for key in KEYS[:2]:
            assert t.batched_contains([key]) == 1
            assert loop.run(read_cut_short(t, l1, ep, key), 5) is None
        assert t.batched_contains(KEYS) == 4
        assert count(t, "p2p_lookups_total", result="down") == 0

"""The P2P tier without sockets: lookups through a PeerLocator (none, self, a peer,
a slow one), checks on landed chunks, and the peer protocol's decoding."""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest
import torch
from kvtest.p2p import FixedLocator

from kvmesh.common.chunk_codec import chunk_bytes, payload_checksum
from kvmesh.common.config import P2PConfig
from kvmesh.common.keys import ChunkKey
from kvmesh.common.memory import HostMemoryPool, MemoryFormat
from kvmesh.common.protocol import p2p as proto
from kvmesh.common.transport.channel_zmq import ZmqChannel
from kvmesh.services.worker.loop_thread import LoopThread
from kvmesh.services.worker.tiers.p2p import P2PTier

KEYS = [ChunkKey("0123456789abcdef", bytes([i]) * 16) for i in range(4)]
ME, PEER = "tcp://127.0.0.1:1", "tcp://127.0.0.1:2"


@pytest.fixture
def loop():
    lt = LoopThread("p2p-test")
    yield lt
    lt.stop()


def tier(loop, locator, **cfg) -> P2PTier:
    return P2PTier(ZmqChannel(), loop, P2PConfig(enabled=True, **cfg), lambda: locator, lambda: ME)


def lookups(t: P2PTier, result: str) -> float:
    return t.stats.metrics.value("p2p_lookups_total", {"result": result})


def test_no_locator_means_no_peer_hits(loop) -> None:
    t = tier(loop, None)
    assert t.batched_contains(KEYS) == 0 and not t.contains(KEYS[0])
    assert lookups(t, "no_locator") == 2


def test_locator_answer_bounds_the_count_and_is_remembered(loop) -> None:
    loc = FixedLocator({k: PEER for k in KEYS[:3]})
    t = tier(loop, loc)
    assert t.batched_contains(KEYS) == 3
    assert t.batched_contains(KEYS[1:]) == 2
    assert t._where[KEYS[0]] == PEER and KEYS[3] not in t._where
    assert lookups(t, "found") == 2
    # Our own endpoint is never a peer.
    loc.set(KEYS, ME)
    assert t.batched_contains(KEYS) == 0 and lookups(t, "self") == 1


def test_slow_locator_is_bounded_by_lookup_timeout(loop) -> None:
    t = tier(loop, FixedLocator({k: PEER for k in KEYS}, delay=5.0), lookup_timeout_s=0.05)
    t0 = time.monotonic()
    assert t.batched_contains(KEYS) == 0
    assert time.monotonic() - t0 < 0.5


def test_tier_stores_nothing(loop) -> None:
    t = tier(loop, None)
    t.submit_put(KEYS[0], None)  # type: ignore[arg-type]
    assert not t.pin(KEYS[0]) and not t.remove(KEYS[0]) and t.clear() == 0 and t.flush(0)


def test_landed_chunks_are_checked_key_and_checksum(loop) -> None:
    t = tier(loop, None)
    pool = HostMemoryPool(1 << 20, page_size=4096, reserve_bytes=0)
    try:
        objs = [pool.allocate((1024,), torch.float32, MemoryFormat.KV_2LTD) for _ in range(4)]
        landed = []
        for i, obj in enumerate(objs):
            obj.tensor.fill_(i + 1)
            good = payload_checksum(chunk_bytes(obj))
            key = KEYS[i].to_str()
            if i == 1:
                good ^= 1  # a flipped bit somewhere: must not verify
            if i == 2:
                key = ChunkKey("0123456789abcdef", b"\xee" * 16).to_str()  # not asked
            landed.append((proto.ChunkMeta(key, obj.nbytes, good, [1024], "float32", 1), obj))
        good = asyncio.run(t._verify(landed, set(KEYS)))
        assert set(good) == {KEYS[0], KEYS[3]}
        assert good[KEYS[3]].key == KEYS[3]
        assert t.stats.metrics.value("p2p_gets_total", {"result": "corrupt"}) == 2
        assert t.stats.metrics.value("p2p_received_bytes_total") == 2 * 4096
        assert objs[1].is_freed and objs[2].is_freed  # dropped, pages back
        for obj in good.values():
            obj.ref_down()
        assert pool.used_bytes == 0
    finally:
        pool.close()


def test_aget_without_a_peer_is_a_miss(loop) -> None:
    t = tier(loop, FixedLocator())
    assert loop.run(t.aget(KEYS[0], None), 5) is None  # type: ignore[arg-type]
    assert t.stats.metrics.value("p2p_gets_total", {"result": "no_peer"}) == 1


def test_a_full_l1_is_a_miss_at_once_not_a_wait_on_the_loop(loop) -> None:
    # Channels allocate landing buffers on the engine's event loop: with every L1 page
    # in use elsewhere the allocation answers None at once (counted), instead of holding
    # the loop for the L1's alloc_timeout_s.
    from kvmesh.services.worker.tiers.host import HostTier

    t = tier(loop, None)
    pool = HostMemoryPool(2 * 4096, page_size=4096, reserve_bytes=0)
    l1 = HostTier(pool, alloc_timeout_s=3.0)
    held = [pool.allocate((1024,), torch.float32, MemoryFormat.KV_2LTD) for _ in range(2)]
    try:
        alloc = t._alloc_fn(l1)
        meta = proto.ChunkMeta(KEYS[0].to_str(), 4096, 0, [1024], "float32", 1)
        t0 = time.monotonic()
        assert alloc(meta) is None
        assert time.monotonic() - t0 < 0.5
        assert t.stats.metrics.value("p2p_gets_total", {"result": "no_memory"}) == 1
        held.pop().ref_down()
        obj = alloc(meta)
        assert obj is not None and obj.nbytes == 4096
        obj.ref_down()
    finally:
        for obj in held:
            obj.ref_down()
        pool.close()


# -- the protocol ---------------------------------------------------------------------------


def test_requests_and_replies_round_trip() -> None:
    meta = proto.ChunkMeta(KEYS[0].to_str(), 8, 123, [2, 2], "float16", 1, 4096)
    for msg in (
        proto.Hello(1, 1, "x"),
        proto.ReadChunks(2, 1, [KEYS[0].to_str()], 1.5),
        proto.PinChunks(3, 1, [KEYS[1].to_str()]),
        proto.ReleaseChunks(4, 1, 9),
    ):
        assert proto.decode_request([proto.encode(msg)]) == msg
    pin = proto.PinChunksReply(3, 9, [meta])
    assert proto.decode_reply([proto.encode(pin)]) == pin
    read = proto.ReadChunksReply(2, [meta])
    assert proto.decode_reply([proto.encode(read), b"12345678"]) == read


@pytest.mark.parametrize(
    ("frames", "code"),
    [
        ([], proto.ErrorCode.BAD_MESSAGE),
        ([b"\xc1"], proto.ErrorCode.BAD_MESSAGE),
        ([msgspec.msgpack.encode(["nope", 1, 1])], proto.ErrorCode.UNKNOWN_MESSAGE),
        ([proto.encode(proto.Hello(3, 2))], proto.ErrorCode.VERSION_MISMATCH),
        ([proto.encode(proto.ReadChunks(4, 1, ["k"] * (proto.MAX_KEYS + 1)))], 1),
        ([proto.encode(proto.PinChunks(5, 1, ["k" * 65]))], proto.ErrorCode.BAD_KEY),
        ([proto.encode(proto.CommitChunks(6, 1, 1, [0] * (proto.MAX_KEYS + 1)))], 1),
    ],
)
def test_bad_requests_raise_malformed_with_a_reply(frames, code) -> None:
    with pytest.raises(proto.MalformedMessage) as info:
        proto.decode_request(frames)
    assert info.value.reply.code == code


def test_read_reply_with_missing_payload_is_malformed() -> None:
    meta = proto.ChunkMeta(KEYS[0].to_str(), 8, 1, [8], "uint8", 1)
    with pytest.raises(proto.MalformedMessage):
        proto.decode_reply([proto.encode(proto.ReadChunksReply(1, [meta]))])
    with pytest.raises(proto.MalformedMessage):
        proto.decode_reply([proto.encode(proto.HelloReply(1, 1, "i", 0)), b"extra"])

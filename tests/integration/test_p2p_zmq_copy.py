"""P2P reads over the ZMQ channel of chunks large enough that their landing copies run
on a thread (common/transport/channel_zmq.py; the threshold is common/offload.py's
OFFLOAD_FROM): two engines in this process, each with its own loop and P2P server on
loopback."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from kvmesh.common import offload
from kvmesh.common.config import EngineConfig, L1Config, P2PConfig
from kvmesh.services.worker.engine import KVEngine
from kvmesh.services.worker.peer_locator import PeerLocation

LAYERS, HEADS, HEAD_DIM, CHUNK_TOKENS, N = 4, 8, 64, 256, 4  # 2 MiB chunks, 8 MiB a read


class AllAt:
    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint

    def locate(self, keys, timeout: float) -> PeerLocation:
        return PeerLocation("peer", 0, self.endpoint, len(keys))


def engine(name: str) -> KVEngine:
    kv = [torch.zeros(2, HEADS, 16, 2 * HEAD_DIM, dtype=torch.float16) for _ in range(LAYERS)]
    chunk = LAYERS * CHUNK_TOKENS * HEADS * 2 * HEAD_DIM * 2
    cfg = EngineConfig(
        chunk_size=CHUNK_TOKENS,
        model_name="zmq-copy",
        l1=L1Config(max_size=(N + 1) * chunk + (1 << 20), reserve=0),
        p2p=P2PConfig(enabled=True, channel="zmq", timeout_s=5.0),
        close_flush_s=0,
    )
    return KVEngine(name, 0, cfg, kv)


@pytest.fixture
def pair() -> Iterator[tuple[KVEngine, KVEngine]]:
    peer, reader = engine("peer"), engine("reader")
    yield peer, reader
    reader.close()
    peer.close()


def test_large_chunks_land_bit_exact_through_the_thread_copy(pair) -> None:
    peer, reader = pair
    gen = torch.Generator().manual_seed(11)
    keys, sent = [], []
    for i in range(N):
        obj = peer.storage.l1.allocate(
            peer.layout.chunk_shape(CHUNK_TOKENS), peer.layout.dtype, peer.chunk_format
        )
        obj.raw.copy_(torch.randint(0, 256, (obj.nbytes,), dtype=torch.uint8, generator=gen))
        key = peer.namespace.key(i.to_bytes(16, "little"))
        obj.key = key
        sent.append(obj.raw.clone())
        peer.storage.put(key, obj)
        keys.append(key)
    assert N * sent[0].numel() >= offload.OFFLOAD_FROM  # the thread path
    reader.peer_locator = AllAt(peer.p2p_endpoint)
    free_before = reader.pool.free_pages
    objs, sources = reader.storage.get_prefix(keys)
    assert sources == ["p2p"] * N
    assert all(torch.equal(o.raw, s) for o, s in zip(objs, sent, strict=True))
    for o in objs:
        o.ref_down()
    assert reader.storage.tier("p2p").stats.metrics.value("p2p_gets_total", {"result": "hit"}) == N
    # The landed chunks went to L1 (promoted); clearing it gives every page back.
    reader.storage.l1.clear()
    assert reader.pool.free_pages == free_before

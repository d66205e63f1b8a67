"""Codecs end to end through a real engine: chunks stored through a disk tier and a real
cache-server process with a lossless codec come back bit for bit once L1 (and then the
disk) no longer has them; with cachegen they come back within its error, smaller on
the wire and on disk."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from kvtest.paged import bits, make_cache, slot_tokens
from kvtest.remote import CacheServerProcess

from kvmesh.common import chunk_codec
from kvmesh.common.config import DiskConfig, EngineConfig, L1Config, RemoteConfig
from kvmesh.services.worker.engine import KVEngine
from kvmesh.services.worker.tiers.disk_format import CHUNK_SUFFIX

BLOCKS, BLOCK = 64, 4
SLOTS = BLOCKS * BLOCK
TOKENS = 192  # 3 chunks of 64


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with CacheServerProcess(tmp_path_factory.mktemp("cacheserver")) as srv:
        yield srv


def engine(url: str, disk: Path, view, compression: str, instance: str) -> KVEngine:
    cfg = EngineConfig(
        chunk_size=64,
        model_name=f"codec-test-{compression}",
        l1=L1Config(max_size=8 << 20, reserve=0, alloc_timeout_s=0.2),
        disk=DiskConfig(enabled=True, path=str(disk), max_size=64 << 20, compression=compression),
        remote=RemoteConfig(
            enabled=True,
            url=url,
            health_interval_s=0.1,
            compression=compression,
            compression_min_saving=0.0,
        ),
    )
    eng = KVEngine(instance, 0, cfg, view)
    if not eng.storage.tier("remote").wait_ready(10):
        eng.close()
        raise TimeoutError(f"remote {url} not ready")
    return eng


def fill_compressible(layers: list[torch.Tensor]) -> None:
    """KV-like values on a coarse grid that drift along the blocks' tokens: zstd, lz4
    and cachegen all find something to save (random bits would be stored raw)."""
    g = torch.Generator().manual_seed(7)
    for t in layers:
        drift = torch.cumsum(torch.randint(-1, 2, t.shape, generator=g), dim=2).float()
        t.copy_(torch.randint(-4, 4, t.shape[:1] + (1,) * (t.dim() - 1), generator=g) + drift / 4)


def source(first_token: int):
    """A filled paged cache, a prompt of TOKENS ids from first_token, the slots it sits
    in, and the KV those slots hold: (view, layers, kind, prompt, slots, want)."""
    view, layers, kind = make_cache(
        "cpu", torch.bfloat16, False, blocks=BLOCKS, layers=3, heads=2, head_dim=32
    )
    fill_compressible(layers)
    prompt = list(range(first_token, first_token + TOKENS))
    slots = torch.randperm(SLOTS)[:TOKENS]
    return view, layers, kind, prompt, slots, slot_tokens(layers, kind)[:, slots]


def hits(eng: KVEngine, tier: str) -> float:
    return eng.stats.metrics.value("tokens_hit_total", {"tier": tier}) or 0.0


@pytest.mark.parametrize("compression", ["zstd", "lz4", "cachegen"])
def test_store_evict_l1_retrieve_through_disk_then_remote(
    server, tmp_path: Path, compression: str
) -> None:
    src_view, src_layers, kind, prompt, src_slots, want = source(1000)
    eng = engine(server.url, tmp_path / "disk", src_view, compression, "writer")
    try:
        assert eng.store(prompt, src_slots) == TOKENS
        disk, remote = eng.storage.tier("disk"), eng.storage.tier("remote")
        assert disk.flush(10) and remote.flush(10)
        raw = want.numel() * want.element_size()
        # Smaller on disk and on the wire: the codec really ran.
        assert (
            sum(f.stat().st_size for f in (tmp_path / "disk").rglob("*" + CHUNK_SUFFIX))
            < raw + 3 * 4096
        )
        m = eng.stats.metrics
        assert m.value("remote_sent_bytes_total", {}) < m.value("remote_raw_sent_bytes_total", {})

        # Back into the engine's KV from each tier in turn, the tiers above it emptied
        # and the KV wiped first.
        for tier, cleared in (("disk", ["l1"]), ("remote", ["l1", "disk"])):
            for name in cleared:
                eng.clear(tier=name)
            for t in src_layers:
                t.zero_()
            before = hits(eng, tier)
            assert bool(eng.retrieve(prompt, src_slots).all())
            assert hits(eng, tier) - before == TOKENS, tier
            got = slot_tokens(src_layers, kind)[:, src_slots]
            if compression == "cachegen":
                # At least 4 bits per value (the last layer's band): within half a
                # step of the widest span, plus bf16's rounding of the result.
                w = want.float()
                bound = (w.max() - w.min()).item() / 15 / 2 + w.abs().max().item() / 128
                err = (got.float() - w).abs().max().item()
                assert 0 < err <= bound, (tier, err, bound)
            else:
                assert torch.equal(bits(got), bits(want)), tier
    finally:
        eng.close()


def test_a_chunk_stored_to_disk_and_remote_is_hashed_once(
    server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Both tiers need the chunk's xxh3 and take the chunk on their own threads at the
    # same moment: one hashes, the other waits for that hash. A slowed hash makes the
    # two overlap every time.
    chunk_sized: list[int] = []
    real = chunk_codec.payload_checksum

    def slow(data) -> int:
        chunk_sized.append(len(data))
        time.sleep(0.05)
        return real(data)

    monkeypatch.setattr(chunk_codec, "payload_checksum", slow)
    view, layers, kind, prompt, slots, want = source(3000)
    eng = engine(server.url, tmp_path / "disk", view, "none", "hash-once")
    try:
        assert eng.store(prompt, slots) == TOKENS
        assert eng.storage.tier("disk").flush(10) and eng.storage.tier("remote").flush(10)
        chunk = want.numel() * want.element_size() // (TOKENS // 64)
        assert chunk_sized.count(chunk) == TOKENS // 64
        # Both copies carry that checksum: each reads back whole, the one above emptied.
        for tier, cleared in (("disk", ["l1"]), ("remote", ["l1", "disk"])):
            for name in cleared:
                eng.clear(tier=name)
            for t in layers:
                t.zero_()
            assert bool(eng.retrieve(prompt, slots).all()), tier
            assert torch.equal(bits(slot_tokens(layers, kind)[:, slots]), bits(want)), tier
    finally:
        eng.close()

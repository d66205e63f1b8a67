"""Compressing chunks already stored (engine.compress / decompress, the controller's
`compress` command, `kvmesh admin compress`): chunks on a real disk tier and a real
cache-server are rewritten through a codec, come back bit for bit (lossless) or within
cachegen's error, and a reader running beside the rewrite never gets a chunk half old,
half new: every load is whole and exact, or a miss."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest
import torch
from kvtest.controller import ControllerProcess
from kvtest.paged import bits, make_cache, slot_tokens
from kvtest.remote import CacheServerProcess
from test_codec_tiers import fill_compressible

from kvmesh.common.chunk_codec import FILE_LAYOUT, Codec
from kvmesh.common.config import (
    DiskConfig,
    EngineConfig,
    EngineControllerConfig,
    L1Config,
    RemoteConfig,
)
from kvmesh.services.worker.engine import KVEngine
from kvmesh.services.worker.tiers.disk_format import CHUNK_SUFFIX

BLOCKS, BLOCK = 64, 4
SLOTS = BLOCKS * BLOCK
TOKENS = 192  # 3 chunks of 64
PROMPT = list(range(3000, 3000 + TOKENS))


def config(disk: Path, *, remote_url: str = "", controller_url: str = "") -> EngineConfig:
    return EngineConfig(
        chunk_size=64,
        model_name="compress-test",
        l1=L1Config(max_size=8 << 20, reserve=0, alloc_timeout_s=0.2),
        disk=DiskConfig(enabled=True, path=str(disk), max_size=64 << 20),
        remote=RemoteConfig(
            enabled=bool(remote_url), url=remote_url, health_interval_s=0.1, timeout_s=2.0
        ),
        controller=EngineControllerConfig(
            enabled=bool(controller_url), url=controller_url, heartbeat_s=0.2, timeout_s=1.0
        ),
    )


def make_engine(tmp: Path, **kw) -> tuple[KVEngine, list[torch.Tensor], object, torch.Tensor]:
    view, layers, kind = make_cache(
        "cpu", torch.bfloat16, False, blocks=BLOCKS, layers=3, heads=2, head_dim=32
    )
    fill_compressible(layers)
    eng = KVEngine(f"c-{uuid.uuid4().hex[:6]}", 0, config(tmp / "disk", **kw), view)
    if kw.get("remote_url"):
        assert eng.storage.tier("remote").wait_ready(10)
    slots = torch.randperm(SLOTS)[:TOKENS]
    assert eng.store(PROMPT, slots) == TOKENS
    for t in ("disk", "remote") if kw.get("remote_url") else ("disk",):
        assert eng.storage.tier(t).flush(10)
    return eng, layers, kind, slots


def file_codecs(disk: Path) -> list[Codec]:
    out = []
    for f in sorted(disk.rglob("*" + CHUNK_SUFFIX)):
        out.append(FILE_LAYOUT.parse(memoryview(f.read_bytes()[: FILE_LAYOUT.size])).codec)
    return out


def disk_bytes(disk: Path) -> int:
    return sum(f.stat().st_size for f in disk.rglob("*" + CHUNK_SUFFIX))


def post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def reload(eng: KVEngine, layers, kind, slots, *, drop=("l1",)) -> torch.Tensor:
    for name in drop:
        eng.clear(tier=name)
    for t in layers:
        t.zero_()
    assert bool(eng.retrieve(PROMPT, slots).all())
    return slot_tokens(layers, kind)[:, slots]


def test_compress_then_decompress_on_disk(tmp_path: Path) -> None:
    eng, layers, kind, slots = make_engine(tmp_path)
    disk = tmp_path / "disk"
    try:
        want = slot_tokens(layers, kind)[:, slots].clone()
        raw_size = disk_bytes(disk)
        assert file_codecs(disk) == [Codec.NONE] * 3

        done = eng.compress(method="zstd", tier="disk")
        assert (done.asked, done.rewritten, done.failed) == (3, 3, 0), done
        assert file_codecs(disk) == [Codec.ZSTD] * 3
        assert disk_bytes(disk) < raw_size
        assert eng.storage.tier("disk").used_bytes == disk_bytes(disk)  # the index follows
        assert torch.equal(bits(reload(eng, layers, kind, slots)), bits(want))

        # Again: nothing to do. Only the named chunks: only those.
        again = eng.compress(method="zstd", tier="disk")
        assert (again.rewritten, again.unchanged) == (0, 3)
        one = eng.compress(PROMPT[:64], method="lz4", tier="disk")
        assert (one.asked, one.rewritten) == (1, 1)
        assert sorted(file_codecs(disk)) == sorted([Codec.LZ4, Codec.ZSTD, Codec.ZSTD])

        back = eng.decompress(tier="disk")
        assert back.rewritten == 3 and file_codecs(disk) == [Codec.NONE] * 3
        assert disk_bytes(disk) == raw_size
        assert torch.equal(bits(reload(eng, layers, kind, slots)), bits(want))

        lossy = eng.compress(method="cachegen", tier="disk")
        assert lossy.rewritten == 3 and disk_bytes(disk) < raw_size / 2
        got = reload(eng, layers, kind, slots).float()
        w = want.float()
        bound = (w.max() - w.min()).item() / 15 / 2 + w.abs().max().item() / 128
        assert 0 < (got - w).abs().max().item() <= bound
    finally:
        eng.close()


def test_bad_requests_are_clear_errors(tmp_path: Path) -> None:
    eng, *_ = make_engine(tmp_path)
    try:
        with pytest.raises(ValueError, match="unknown codec 'brotli'"):
            eng.compress(method="brotli")
        with pytest.raises(ValueError, match="tier must be one of disk, remote"):
            eng.compress(tier="l1")
        with pytest.raises(ValueError, match="no remote tier"):
            eng.compress(tier="remote")
        assert file_codecs(tmp_path / "disk") == [Codec.NONE] * 3  # nothing touched
    finally:
        eng.close()


def test_a_corrupt_chunk_is_dropped_not_rewritten(tmp_path: Path) -> None:
    eng, *_ = make_engine(tmp_path)
    try:
        victim = sorted((tmp_path / "disk").rglob("*" + CHUNK_SUFFIX))[1]
        data = bytearray(victim.read_bytes())
        data[FILE_LAYOUT.size + 10] ^= 0xFF
        victim.write_bytes(bytes(data))
        done = eng.compress(method="zstd", tier="disk")
        assert (done.rewritten, done.failed) == (2, 1)
        assert not victim.exists() and len(eng.storage.tier("disk")) == 2
        assert eng.stats.metrics.value("chunk_misses_total", {"tier": "disk", "reason": "checksum"})
    finally:
        eng.close()


def test_readers_beside_rewrites_get_whole_chunks(tmp_path: Path) -> None:
    """Loads from disk run while the chunks are rewritten back and forth through two
    lossless codecs and raw: every load is all three chunks bit for bit, or stops at a
    miss; none is wrong and no chunk is lost."""
    eng, layers, kind, slots = make_engine(tmp_path)
    want = slot_tokens(layers, kind)[:, slots].clone()
    stop = threading.Event()
    wrong: list[str] = []
    loads = {"whole": 0, "partial": 0}

    rewrites = [0]

    def rewriter() -> None:
        while not stop.is_set():
            for method in ("zstd", "none", "lz4"):
                rewrites[0] += eng.compress(method=method, tier="disk").rewritten

    worker = threading.Thread(target=rewriter)
    worker.start()
    try:
        for _ in range(40):
            eng.clear(tier="l1")
            for t in layers:
                t.zero_()
            loaded = eng.retrieve(PROMPT, slots)
            n = int(loaded.sum())
            got = slot_tokens(layers, kind)[:, slots]
            if not torch.equal(bits(got[:, :n]), bits(want[:, :n])):
                wrong.append(f"{n} tokens loaded, not equal")
            loads["whole" if n == TOKENS else "partial"] += 1
    finally:
        stop.set()
        worker.join(60)
    try:
        assert not wrong, wrong[:5]
        assert rewrites[0] >= 3 * 6, rewrites  # the chunks really changed under the loads
        assert loads["whole"] >= 30, loads  # a miss beside a rename is rare
        assert len(eng.storage.tier("disk")) == 3
        assert torch.equal(bits(reload(eng, layers, kind, slots)), bits(want))
    finally:
        eng.close()


def test_compress_on_the_cacheserver(tmp_path: Path) -> None:
    with CacheServerProcess(tmp_path) as server:
        eng, layers, kind, slots = make_engine(tmp_path, remote_url=server.url)
        try:
            want = slot_tokens(layers, kind)[:, slots].clone()
            m = eng.stats.metrics
            done = eng.compress(method="zstd", tier="remote")
            assert (done.asked, done.rewritten, done.failed) == (3, 3, 0), done
            # The stored values are the compressed ones: a fresh read receives fewer bytes.
            before = m.value("remote_received_bytes_total", {}) or 0.0
            got = reload(eng, layers, kind, slots, drop=("l1", "disk"))
            assert torch.equal(bits(got), bits(want))
            received = m.value("remote_received_bytes_total", {}) - before
            assert 0 < received < want.numel() * want.element_size()
            assert eng.compress(method="zstd", tier="remote").unchanged == 3
            assert eng.decompress(tier="remote").rewritten == 3
            got = reload(eng, layers, kind, slots, drop=("l1", "disk"))
            assert torch.equal(bits(got), bits(want))
        finally:
            eng.close()


def test_the_admin_command_fans_out_to_workers(tmp_path: Path) -> None:
    srv = ControllerProcess(tmp_path, snapshot=False).start()
    eng = None
    try:
        eng, layers, kind, slots = make_engine(tmp_path, controller_url=srv.url)
        want = slot_tokens(layers, kind)[:, slots].clone()
        cli = [sys.executable, "-m", "kvmesh.services.cli.main", "admin", "--url", srv.url]
        cli += ["--json"]

        def run(*args: str) -> tuple[int, dict]:
            out = subprocess.run([*cli, *args], capture_output=True, text=True, timeout=60)
            return out.returncode, json.loads(out.stdout or "{}")

        from kvtest.waiting import wait_for

        wait_for(lambda: eng.controller_client.registered, 10, "registered")
        rc, reply = run("compress", "--method", "lz4", "--tier", "disk")
        assert rc == 0, reply
        [result] = reply["results"]
        assert result["worker_id"] == f"{eng.instance_id}/0" and result["ok"]
        assert result["count"] == 3 and result["detail"]["rewritten"] == 3
        assert file_codecs(tmp_path / "disk") == [Codec.LZ4] * 3
        assert torch.equal(bits(reload(eng, layers, kind, slots)), bits(want))
        # One named key, back to raw.
        key = eng.chunks(PROMPT)[0][2].to_str()
        rc, reply = run("decompress", key, "--instance", eng.instance_id)
        assert rc == 0 and reply["results"][0]["detail"]["rewritten"] == 1
        # The HTTP admin API: the same command, and a 400 for a bad one.
        status, body = post(srv.http + "/compress", {"method": "zstd", "tier": "disk"})
        assert status == 200 and body["results"][0]["detail"]["rewritten"] == 3, body
        assert file_codecs(tmp_path / "disk") == [Codec.ZSTD] * 3
        status, body = post(srv.http + "/compress", {"method": "x"})
        assert status == 400 and "method 'x'" in body["error"]
        # A worker without that tier answers a clear failure; the CLI exits non-zero.
        rc, reply = run("compress", "--tier", "remote")
        assert rc != 0 and "no remote tier" in reply["results"][0]["error"]
        out = subprocess.run(
            [*cli, "compress", "--method", "brotli"], capture_output=True, text=True, timeout=60
        )
        assert out.returncode == 2 and "brotli" in out.stderr  # refused by the CLI itself
    finally:
        if eng is not None:
            eng.close()
        assert srv.stop() == 0

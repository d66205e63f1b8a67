"""A real cache-server process against clients that misbehave: one that stalls mid-way
through a large put, one that sends a batch of large values at once; a spill
directory whose leftovers cannot be deleted; and the remote tier's puts of chunks over
the server's value limit (each a dropped put, never a remote marked down)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import struct
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from kvtest.remote import CacheServerProcess, RedisProcess

from kvmesh.common.config import RemoteConfig
from kvmesh.common.keys import ChunkKey
from kvmesh.common.memory import HostMemoryPool, MemoryFormat
from kvmesh.common.protocol import cacheserver as proto
from kvmesh.common.transport.cacheserver_client import CacheServerClient
from kvmesh.services.worker.loop_thread import LoopThread
from kvmesh.services.worker.tiers import disk_format
from kvmesh.services.worker.tiers.remote import RemoteTier
from kvmesh.services.worker.tiers.remote_connector import make_connector
from kvmesh.services.worker.tiers.remote_fs import FsConnector

MiB = 1 << 20
NS = "00112233445566ff"


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def peak_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


async def connected(srv: CacheServerProcess) -> CacheServerClient:
    client = CacheServerClient(srv.endpoint, timeout_s=5.0)
    await client.connect()
    return client


# -- a client stalled mid-way through a put --------------------------------------------


def _zmtp_peer(port: int) -> socket.socket:
    """A ZMTP 3.0 DEALER spoken by hand (NULL mechanism), to send part of a frame."""
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(b"\xff" + bytes(8) + b"\x7f\x03\x00" + b"NULL".ljust(20, b"\0") + bytes(32))
    got = b""
    while len(got) < 64:
        more = s.recv(64 - len(got))
        assert more, "the server closed during the greeting"
        got += more
    body = b"\x05READY\x0bSocket-Type" + struct.pack(">I", 6) + b"DEALER"
    s.sendall(b"\x04" + bytes([len(body)]) + body)
    return s


def _frame(data: bytes, more: bool) -> bytes:
    return bytes([1 if more else 0, len(data)]) + data


def test_a_put_stalled_mid_value_is_dropped_and_its_memory_freed(tmp_path: Path) -> None:
    """libzmq allocates a frame whole when its size is announced: clients that sent
    50 of 60 MiB and stalled held 400 MiB of the server for ever. Heartbeats drop them
    within about stall_timeout_s; an idle client with a live libzmq stays."""
    srv = CacheServerProcess(tmp_path, **{"max-memory": "256MiB", "max-value-size": "64MiB"})
    srv.env["KVMESH_CACHESERVER__STALL_TIMEOUT_S"] = "3.0"
    srv.start()
    assert srv.proc is not None
    pid = srv.proc.pid
    peers: list[socket.socket] = []

    async def main() -> None:
        idle = await connected(srv)
        try:
            base = rss(pid)
            part = os.urandom(50 * MiB)
            for i in range(8):
                s = _zmtp_peer(srv.port)
                peers.append(s)
                hello = proto.encode(proto.Hello(1, proto.PROTOCOL_VERSION))
                s.sendall(_frame(hello, False))
                s.sendall(_frame(proto.encode(proto.PutValue(2, f"partial{i}")), True))
                s.sendall(b"\x02" + struct.pack(">Q", 60 * MiB))  # a 60 MiB frame
                s.sendall(part)  # of which 50 MiB come
            await asyncio.sleep(0.3)
            # The peak: on a loaded box the first peers may be dropped before the last
            # has sent.
            held = peak_rss(pid) - base
            assert held > 300 * MiB, f"only {held / MiB:.0f} MiB held: the test sends too little"
            deadline = time.monotonic() + 15
            while rss(pid) - base > 50 * MiB:
                assert time.monotonic() < deadline, (
                    f"still {(rss(pid) - base) / MiB:.0f} MiB held by stalled puts"
                )
                await asyncio.sleep(0.2)
            assert not any(await idle.exists_many([f"partial{i}" for i in range(8)]))
            # Idle all along: its libzmq answered every heartbeat.
            assert await idle.put("after", b"x") > 0
            assert idle.disconnects == 0
        finally:
            await idle.close()

    try:
        asyncio.run(main())
    finally:
        for s in peers:
            s.close()
        assert srv.stop() == 0


# -- a spill directory whose leftovers cannot be deleted ---------------------------------


@pytest.fixture
def read_only_dir(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """(dir, a leftover spill file in it) with the dir read-only: by its mode, or for
    root (whom modes do not stop) a tmpfs remounted read-only; skipped where neither
    can be had."""
    if os.geteuid() != 0:
        spill = tmp_path / "spill"
        spill.mkdir()
        leftover = spill / "0123-1.val"
        leftover.write_bytes(b"left from the last run")
        spill.chmod(0o555)
        yield spill, leftover
        spill.chmod(0o755)
        return
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)]).returncode:
        pytest.skip("cannot mount a tmpfs to make a read-only directory")
    try:
        spill = mnt / "spill"
        spill.mkdir()
        leftover = spill / "0123-1.val"
        leftover.write_bytes(b"left from the last run")
        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
        yield spill, leftover
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_a_spill_leftover_that_cannot_be_deleted_does_not_stop_the_start(
    tmp_path: Path, read_only_dir: tuple[Path, Path]
) -> None:
    spill, leftover = read_only_dir
    srv = CacheServerProcess(
        tmp_path,
        **{
            "max-memory": "2MiB",
            "max-value-size": "512KiB",
            "spill-path": str(spill),
            "spill-max-size": "16MiB",
        },
    )
    srv.start()  # died on a traceback from deleting the leftover

    async def main() -> None:
        c = await connected(srv)
        try:
            values = {f"v{i}": os.urandom(256 * 1024) for i in range(16)}  # 4 MiB > 2 MiB
            for k, v in values.items():
                await c.put(k, v)
            for k, v in values.items():  # a miss where spilling failed, never wrong bytes
                got = await c.get(k)
                assert got is None or got.tobytes() == v
            assert (await c.get("v15")) is not None
        finally:
            await c.close()

    try:
        asyncio.run(main())
        assert leftover.exists()
        assert "leftover files not deleted" in srv.log.read_text()
    finally:
        assert srv.stop() == 0


def test_a_spill_directory_removed_while_serving_pauses_spilling(tmp_path: Path) -> None:
    """Every eviction's write failed on its own, with a warning each (1,937 for 2,000
    puts); now the first failure pauses spilling, as a full disk does."""
    spill = tmp_path / "spill"
    srv = CacheServerProcess(
        tmp_path,
        **{
            "max-memory": "4MiB",
            "max-value-size": "256KiB",
            "spill-path": str(spill),
            "spill-max-size": "64MiB",
        },
    )
    srv.start()

    async def main() -> None:
        c = await connected(srv)
        try:
            shutil.rmtree(spill)
            value = os.urandom(64 * 1024)
            for i in range(1000):  # 62 MiB through a 4 MiB memory
                await c.put(f"k{i}", value)
            got = await c.get("k999")
            assert got is not None and got.tobytes() == value
            assert await c.get("k0") is None
        finally:
            await c.close()

    try:
        asyncio.run(main())
        assert not spill.exists(), "the spill made its directory again"
        failed = srv.log.read_text().count("spill write failed")
        assert 1 <= failed <= 2, f"{failed} warnings"
    finally:
        assert srv.stop() == 0


# -- the remote tier's puts of chunks over the server's limit ----------------------------


def _key(i: int) -> ChunkKey:
    return ChunkKey(NS, i.to_bytes(16, "little"))


class _Tier:
    """A remote tier on its own loop over connector, with a host pool for its chunks;
    chunk(tokens, fill) allocates one (freed with the rest at the end)."""

    def __init__(self, connector, url: str, pool_bytes: int, page_bytes: int) -> None:
        self.loop = LoopThread("audit-remote")
        self.pool = HostMemoryPool(pool_bytes, page_bytes, pin_memory=False)
        config = RemoteConfig(
            enabled=True, url=url, timeout_s=3.0, health_interval_s=0.2, failures_to_down=2
        )
        self.tier = RemoteTier(connector, self.loop, config)
        self._objs: list = []

    def chunk(self, tokens: int, fill: int):
        obj = self.pool.allocate(
            torch.Size([2, 2, tokens, 64]), torch.float16, MemoryFormat.KV_2LTD
        )
        obj.raw.fill_(fill)
        self._objs.append(obj)
        return obj

    def close(self) -> None:
        self.tier.close()
        self.loop.stop()
        for obj in self._objs:
            obj.ref_down()
        self.pool.close()


@contextlib.contextmanager
def remote_tier(connector, url: str, pool_bytes: int, page_bytes: int) -> Iterator[_Tier]:
    t = _Tier(connector, url, pool_bytes, page_bytes)
    try:
        assert t.tier.wait_ready(5)
        yield t
    finally:
        t.close()


def test_chunks_over_the_servers_value_limit_are_dropped_and_the_tier_stays_up(
    tmp_path: Path,
) -> None:
    """Each refused put used to count as a failure of the remote: three in a row marked
    it down (every get then a miss), and a chunk past the server's frame limit
    (max_value_size + 8 MiB) dropped the connection at once, with every request on it."""
    srv = CacheServerProcess(tmp_path, **{"max-memory": "16MiB", "max-value-size": "64KiB"})
    srv.start()
    connector = make_connector(srv.url, timeout_s=3.0)
    try:
        with remote_tier(connector, srv.url, 64 * MiB, 16 * MiB) as t:
            tier = t.tier
            small = t.chunk(16, 1)  # 8 KiB
            tier.submit_put(_key(0), small)
            assert tier.flush(5)
            over = t.chunk(512, 2)  # 256 KiB: the server answers VALUE_TOO_LARGE
            past_frame = t.chunk(32768, 3)  # 16 MiB: past the server's frame limit
            for i in range(1, 4):
                tier.submit_put(_key(i), over)
                tier.submit_put(_key(10 + i), past_frame)
            assert tier.flush(10)
            # A client that has not learnt the limit (it changed since the hello): the
            # server's refusal is a dropped put too.
            assert connector.client is not None
            connector.client.max_value_size = 0
            tier.submit_put(_key(4), over)
            assert tier.flush(5)
            m = tier.stats.metrics
            assert tier.up and m.value("remote_state_changes_total", {"to": "down"}) == 0
            assert connector.client.disconnects == 0
            assert m.value("remote_puts_total", {"result": "too_large"}) == 7
            assert m.value("remote_puts_total", {"result": "error"}) == 0
            assert tier.presence.get(_key(0)) is True  # what it knew of the store holds
            got = tier.get(_key(0), t.pool)
            assert got is not None and torch.equal(got.raw, small.raw)
            got.ref_down()
    finally:
        assert srv.stop() == 0


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full")
def test_a_full_fs_store_drops_puts_and_keeps_serving_gets(tmp_path: Path) -> None:
    """ENOSPC on every put counted as a failure of the store: three in a row marked the
    tier down, and the chunks already there, which still read, all missed."""
    url = f"fs://{tmp_path}"
    connector = make_connector(url)
    assert isinstance(connector, FsConnector)
    with remote_tier(connector, url, 8 * MiB, 64 * 1024) as t:
        tier = t.tier
        stored = t.chunk(16, 1)
        tier.submit_put(_key(0), stored)
        assert tier.flush(5)
        # The next writes' temporary files lead to /dev/full: ENOSPC, as on a full disk.
        # Their names carry a process-wide write number, taken here in put order.
        first = next(disk_format._writes) + 1
        for n, i in enumerate(range(1, 5)):
            name = f".{_key(i).to_str()}.{first + n}.{connector._run}{disk_format.TEMP_SUFFIX}"
            (tmp_path / NS / name).symlink_to("/dev/full")
        for i in range(1, 5):
            tier.submit_put(_key(i), t.chunk(16, 1 + i))
            assert tier.flush(5)
        m = tier.stats.metrics
        assert tier.up and m.value("remote_state_changes_total", {"to": "down"}) == 0
        got = tier.get(_key(0), t.pool)
        assert got is not None and torch.equal(got.raw, stored.raw)
        got.ref_down()
        assert tier.get(_key(1), t.pool) is None
        assert m.value("remote_puts_total", {"result": "store_full"}) == 4
        assert m.value("remote_puts_total", {"result": "error"}) == 0


def test_a_redis_at_maxmemory_drops_puts_and_keeps_serving_gets(tmp_path: Path) -> None:
    """With noeviction, a full Redis refuses every SET (OOM) and serves every GET; each
    refusal counted as a failure of the store, so the tier went down, back up at the
    next ping, and down again, every get a miss while down."""
    redis = RedisProcess(tmp_path)
    redis.cmd += ["--maxmemory", "3mb", "--maxmemory-policy", "noeviction"]
    redis.start()
    try:
        connector = make_connector(redis.url, timeout_s=3.0)
        with remote_tier(connector, redis.url, 8 * MiB, 256 * 1024) as t:
            tier = t.tier
            objs = [t.chunk(512, i) for i in range(16)]  # 256 KiB each: 4 MiB > 3 MiB
            for i, obj in enumerate(objs):
                tier.submit_put(_key(i), obj)
                assert tier.flush(5)
            m = tier.stats.metrics
            assert tier.up and m.value("remote_state_changes_total", {"to": "down"}) == 0
            got = tier.get(_key(0), t.pool)
            assert got is not None and torch.equal(got.raw, objs[0].raw)
            got.ref_down()
            assert m.value("remote_puts_total", {"result": "store_full"}) > 0
            assert m.value("remote_puts_total", {"result": "error"}) == 0
    finally:
        redis.stop()


# -- a batch of large values -----------------------------------------------------------


def test_a_batch_of_large_values_is_sent_in_parts_the_server_can_hold(tmp_path: Path) -> None:
    """ZMQ hands the server a message only once it is whole: one put_many of 48 values
    of 4 MiB into a 32 MiB server held all 192 MiB at once. The client now sends at
    most max_value_size bytes a message, and a value over it not at all (past the
    frame limit it would have cost the connection and every request on it)."""
    srv = CacheServerProcess(tmp_path, **{"max-memory": "32MiB", "max-value-size": "4MiB"})
    srv.start()

    async def scenario() -> tuple[list[int], int]:
        client = await connected(srv)
        try:
            values = [bytes([i]) * (4 * MiB) for i in range(48)]
            items = [(f"big:{i}", v, b"") for i, v in enumerate(values)]
            items.insert(5, ("huge", b"\x07" * (13 * MiB), b""))  # past 4 + 8 MiB
            codes = await client.put_many(items, timeout_s=60.0)
            last = await client.get("big:47")
            assert last is not None
            data = last.data if isinstance(last.data, list) else [last.data]
            assert b"".join(data) == values[47]
            return codes, client.disconnects
        finally:
            await client.close()

    try:
        before = rss(srv.proc.pid)
        codes, disconnects = asyncio.run(scenario())
        assert codes[5] == proto.ErrorCode.VALUE_TOO_LARGE
        assert codes[:5] + codes[6:] == [0] * 48 and disconnects == 0
        grown = peak_rss(srv.proc.pid) - before
        assert grown < 120 * MiB, f"the server's peak grew by {grown // MiB} MiB"
    finally:
        assert srv.stop() == 0

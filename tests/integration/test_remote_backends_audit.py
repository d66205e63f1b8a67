"""The remote tier's Redis and filesystem backends against what another writer, the
admin or the machine can do to them: values of another Redis type under kvmesh's key
names, a Redis that refuses the login or the db, a directory under a chunk's file name,
a shared directory remounted read-only, temporary files a killed writer left behind.
Each case is one bad value or one refusing store, never a store marked down for it and
never wrong KV; a store that cannot be reached says why in the log."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import struct
import subprocess
import threading
import time

import pytest
import torch
from kvtest.remote import RedisProcess
from structlog.testing import capture_logs

from kvmesh.common.config import RemoteConfig
from kvmesh.common.keys import ChunkKey
from kvmesh.common.memory import HostMemoryPool, MemoryFormat
from kvmesh.services.worker.loop_thread import LoopThread
from kvmesh.services.worker.tiers import remote_fs
from kvmesh.services.worker.tiers.disk_format import chunk_file_name, temp_file_name
from kvmesh.services.worker.tiers.remote import RemoteTier
from kvmesh.services.worker.tiers.remote_connector import make_connector

NS = "0011223344556677"
BIG = torch.Size([2, 8, 128, 512])  # 2 MiB of fp16


def key(i: int) -> ChunkKey:
    return ChunkKey(NS, i.to_bytes(16, "little"))


@pytest.fixture
def pool():
    p = HostMemoryPool(8 << 20, 64 * 1024, pin_memory=False)
    yield p
    p.close()


@pytest.fixture
def tiers():
    """make(url, **config) -> a RemoteTier on its own loop; all closed at the end."""
    made: list[tuple[RemoteTier, LoopThread]] = []

    def make(url: str, **kw) -> RemoteTier:
        options = {
            "enabled": True,
            "url": url,
            "timeout_s": 2.0,
            "health_interval_s": 0.05,
            "failures_to_down": 3,
            **kw,
        }
        cfg = RemoteConfig(**options)
        loop = LoopThread("audit-remote")
        tier = RemoteTier(make_connector(url, timeout_s=cfg.timeout_s), loop, cfg)
        made.append((tier, loop))
        return tier

    yield make
    for tier, loop in made:
        tier.close()
        loop.stop()


@pytest.fixture
def redis(tmp_path):
    node = RedisProcess(tmp_path).start()
    yield node
    node.kill()


def cli(port: int, *args: str) -> str:
    done = subprocess.run(
        ["redis-cli", "-p", str(port), *args], capture_output=True, text=True, timeout=10
    )
    return done.stdout.strip()


def chunk(pool: HostMemoryPool, seed: int):
    obj = pool.allocate(torch.Size([2, 2, 16, 64]), torch.float16, MemoryFormat.KV_2LTD)
    g = torch.Generator().manual_seed(seed)
    obj.raw.copy_(torch.randint(0, 256, (obj.nbytes,), dtype=torch.uint8, generator=g))
    return obj


def counted(tier: RemoteTier, family: str, result: str) -> float:
    return tier.stats.metrics.value(family, {"result": result})


def wait_for(cond, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)
    return True


# -- Redis ----------------------------------------------------------------------------------


def test_a_redis_value_of_another_type_is_a_corrupt_miss_not_a_down_store(
    redis, tiers, pool
) -> None:
    tier = tiers(redis.url, absence_ttl_s=0)
    assert tier.wait_ready(5)
    good = chunk(pool, 1)
    tier.submit_put(key(0), good)
    assert tier.flush(5)
    names = {i: "kvmesh:" + key(i).to_str() for i in range(1, 7)}
    for i, name in names.items():  # another writer's list, hash, set under our names
        kind = ("rpush", "hset", "sadd")[i % 3]
        cli(redis.port, kind, name, *(("f", "v") if kind == "hset" else ("a", "b")))
    for i in names:
        assert tier.get(key(i), pool) is None
        assert tier.up, tier.health.reason  # was down after three: every get a miss
    # Each was one bad value: counted, and deleted so the next put can take the name.
    assert counted(tier, "remote_gets_total", "corrupt") == 6
    assert counted(tier, "remote_gets_total", "error") == 0
    assert wait_for(lambda: all(cli(redis.port, "type", n) == "none" for n in names.values()))
    back = tier.get(key(0), pool)  # the store went on serving
    assert back is not None and torch.equal(back.raw, good.raw)
    back.ref_down()
    good.ref_down()


class ResettingProxy:
    """A TCP proxy in front of Redis that can reset (RST, not close) every client
    connection: what an idle-timeout load balancer or NAT does."""

    def __init__(self, port: int) -> None:
        self._target, self._writers = port, []
        self._loop = asyncio.new_event_loop()
        self._server = self._loop.run_until_complete(
            asyncio.start_server(self._handle, "127.0.0.1", 0)
        )
        self.port = self._server.sockets[0].getsockname()[1]
        threading.Thread(target=self._loop.run_forever, daemon=True).start()

    async def _handle(self, reader, writer) -> None:
        self._writers.append(writer)
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self._target)

        async def pipe(src, dst) -> None:
            with contextlib.suppress(Exception):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    def reset_all(self) -> None:
        def reset() -> None:
            for w in self._writers:
                sock = w.get_extra_info("socket")
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                w.transport.abort()
            self._writers.clear()

        self._loop.call_soon_threadsafe(reset)
        time.sleep(0.5)

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._server.close)
        self._loop.call_soon_threadsafe(self._loop.stop)


@pytest.mark.parametrize("how", ["closed", "reset"])
def test_connections_redis_closed_while_idle_cost_no_miss(redis, tiers, pool, how) -> None:
    # Redis's `timeout` (or a proxy's idle limit) closes idle clients; redis-py finds
    # out only when it sends on the closed connection. Reset rather than closed, under
    # uvloop (the engine's loop when installed) it is a RuntimeError, not a
    # ConnectionError ("the handler is closed").
    proxy = ResettingProxy(redis.port) if how == "reset" else None
    if proxy is None:
        cli(redis.port, "config", "set", "timeout", "1")
    url = redis.url if proxy is None else f"redis://127.0.0.1:{proxy.port}"
    tier = tiers(url, health_interval_s=30.0)
    assert tier.wait_ready(5)
    objs = [chunk(pool, 30 + i) for i in range(8)]
    for i, obj in enumerate(objs):
        tier.submit_put(key(i), obj)
    assert tier.flush(5)

    async def burst() -> list:
        return list(await asyncio.gather(*(tier.aget(key(i), pool) for i in range(8))))

    loop = tier._loop
    try:
        for _ in range(2):
            got = loop.run(burst(), 10)  # eight connections in the pool
            hits = [g is not None and torch.equal(g.raw, objs[i].raw) for i, g in enumerate(got)]
            for g in got:
                if g is not None:
                    g.ref_down()
            # Was: after the idle spell 7 of 8 missed ("Connection closed by server")
            # and three of those in a row marked the store down.
            assert all(hits), hits
            assert tier.up, tier.health.reason
            if proxy is None:
                time.sleep(2.5)  # the server closes them all
            else:
                proxy.reset_all()
    finally:
        if proxy is not None:
            proxy.close()
    assert counted(tier, "remote_gets_total", "error") == 0
    # A restart looks the same to the client: counted, so the tier forgets its keys.
    assert tier.connector.disconnects >= 1
    for obj in objs:
        obj.ref_down()


def put_big(tier: RemoteTier, big_pool: HostMemoryPool, k: ChunkKey, fill: int) -> None:
    """Store one 2 MiB chunk and wait for the put to end (written or refused)."""
    obj = big_pool.allocate(BIG, torch.float16, MemoryFormat.KV_2LTD)
    obj.raw.fill_(fill)
    tier.submit_put(k, obj)
    obj.ref_down()
    assert tier.flush(5)


def test_a_value_over_redis_bulk_limit_is_refused_not_a_down_store(redis, tiers) -> None:
    cli(redis.port, "config", "set", "proto-max-bulk-len", "1mb")
    big_pool = HostMemoryPool(32 << 20, 4 << 20, pin_memory=False)
    try:
        tier = tiers(redis.url)
        assert tier.wait_ready(5)
        for i in range(5):  # 2 MiB chunks: Redis would answer a protocol error
            put_big(tier, big_pool, key(100 + i), i)
            assert tier.up, tier.health.reason  # was down after three, up, down...
        assert counted(tier, "remote_puts_total", "too_large") == 5
        assert counted(tier, "remote_puts_total", "error") == 0
        small = chunk(big_pool, 5)
        tier.submit_put(key(0), small)
        small.ref_down()
        assert tier.flush(5)
        assert counted(tier, "remote_puts_total", "written") == 1
    finally:
        big_pool.close()


@pytest.mark.parametrize("limit", ["unsaid", "query-buffer"])
def test_a_limit_redis_does_not_tell_is_learned_not_a_down_store(redis, tiers, limit) -> None:
    """A server whose CONFIG the worker may not read (an ACL, a managed Redis) and whose
    bulk limit is 1 MiB, or one whose query buffer is: the first 2 MiB chunk is cut off
    and not sent again, the limit is learned, the rest stay local; the store stays up
    and its presence cache is not thrown away as after a restart."""
    if limit == "unsaid":
        cli(redis.port, "config", "set", "proto-max-bulk-len", "1mb")
        cli(redis.port, "acl", "setuser", "worker", "on", ">pw", "~*", "&*", "+@all", "-config")
        url = redis.url.replace("redis://", "redis://worker:pw@")
    else:
        cli(redis.port, "config", "set", "client-query-buffer-limit", "1mb")
        url = redis.url
    big_pool = HostMemoryPool(32 << 20, 4 << 20, pin_memory=False)
    try:
        tier = tiers(url)
        assert tier.wait_ready(5)
        connects = int(
            cli(redis.port, "info", "stats").split("total_connections_received:")[1].split()[0]
        )
        for i in range(4):
            put_big(tier, big_pool, key(200 + i), i)
            assert tier.up, tier.health.reason
        assert counted(tier, "remote_puts_total", "too_large") == 4
        assert counted(tier, "remote_puts_total", "error") == 0
        after = int(
            cli(redis.port, "info", "stats").split("total_connections_received:")[1].split()[0]
        )
        # One value cut off twice (again once a ping showed Redis up); the rest unsent.
        assert after - connects <= 3
        small = chunk(big_pool, 6)
        tier.submit_put(key(1), small)
        small.ref_down()
        assert tier.flush(5)
        assert counted(tier, "remote_puts_total", "written") == 1
    finally:
        big_pool.close()


def test_a_large_put_on_a_connection_closed_while_idle_is_stored(redis, tiers) -> None:
    """A 2 MiB put meeting a pooled connection Redis closed while idle is cut off like
    one over an untold limit: it must be sent again once Redis answers, and teach no
    limit (one idle spell left every later chunk refused as too_large)."""
    cli(redis.port, "config", "set", "timeout", "1")
    big_pool = HostMemoryPool(32 << 20, 4 << 20, pin_memory=False)
    try:
        tier = tiers(redis.url, health_interval_s=30.0)
        assert tier.wait_ready(5)
        for i in range(4):
            put_big(tier, big_pool, key(300 + i), i)
            time.sleep(2.5 if i < 2 else 0)  # Redis closes the idle connections
        assert counted(tier, "remote_puts_total", "written") == 4
        assert counted(tier, "remote_puts_total", "too_large") == 0
        assert tier.up, tier.health.reason
    finally:
        big_pool.close()


def test_a_frozen_redis_costs_at_most_the_deadline_and_comes_back(redis, tiers, pool) -> None:
    # Behaviour that held already (a guard): the existing freeze test is the cache-server's.
    tier = tiers(redis.url, timeout_s=0.3)
    assert tier.wait_ready(5)
    objs = [chunk(pool, 20 + i) for i in range(4)]
    for i, obj in enumerate(objs):
        tier.submit_put(key(i), obj)
    assert tier.flush(5)
    signal_freeze = threading.Thread(target=redis.freeze, args=(4.0,))
    signal_freeze.start()
    try:
        time.sleep(0.1)
        worst = 0.0
        for i in range(8):
            t0 = time.monotonic()
            got = tier.get(key(i % 4), pool)
            worst = max(worst, time.monotonic() - t0)
            assert got is None
        late = chunk(pool, 99)
        tier.submit_put(key(9), late)
        late.ref_down()
        assert tier.flush(2)
        assert worst < 0.3 + 0.7, worst  # a hang would be the whole freeze
        assert not tier.up
    finally:
        signal_freeze.join()
    assert wait_for(lambda: tier.up, 5), tier.health.reason
    for i, obj in enumerate(objs):  # what Redis held comes back whole
        back = tier.get(key(i), pool)
        assert back is not None and torch.equal(back.raw, obj.raw)
        back.ref_down()
        obj.ref_down()
    dropped = counted(tier, "remote_puts_total", "down") + counted(
        tier, "remote_puts_total", "error"
    )
    assert dropped == 1


@pytest.mark.parametrize(
    ("setup", "path", "words"),
    [
        (("requirepass", "right"), ":wrong@", ("AuthenticationError", "password")),
        ((), "/99", ("ResponseError", "DB index is out of range")),
    ],
    ids=["wrong-password", "db-out-of-range"],
)
def test_a_redis_that_refuses_the_connection_says_why_in_the_log(
    redis, tiers, setup, path, words
) -> None:
    if setup:
        cli(redis.port, "config", "set", *setup)
    host = f"127.0.0.1:{redis.port}"
    url = f"redis://{path}{host}" if path.endswith("@") else f"redis://{host}{path}"
    with capture_logs() as logs:
        tier = tiers(url)
        assert not tier.wait_ready(1.0)
    # Without a line, such a worker ran with its remote tier down and nothing said why
    # (and the reason held redis-py's bare "auth:AuthenticationError").
    said = [e for e in logs if e["event"] == "remote store cannot be reached"]
    assert said, logs
    assert len(said) == 1  # the same reason is not repeated every health interval
    for word in words:
        assert word in said[0]["reason"], said[0]
        assert word in tier.health.reason
    assert "wrong" not in said[0]["remote"]  # the password stays out of the log


# -- fs:// ----------------------------------------------------------------------------------


def test_a_directory_under_a_chunk_name_is_a_corrupt_miss_not_a_down_store(
    tmp_path, tiers, pool
) -> None:
    tier = tiers(f"fs://{tmp_path}", absence_ttl_s=0)
    assert tier.wait_ready(5)
    good = chunk(pool, 2)
    tier.submit_put(key(0), good)
    assert tier.flush(5)
    for i in range(1, 5):
        (tmp_path / NS / chunk_file_name(key(i))).mkdir()
    for i in range(1, 5):
        assert tier.get(key(i), pool) is None
        assert tier.up, tier.health.reason
    assert counted(tier, "remote_gets_total", "corrupt") == 4
    assert counted(tier, "remote_gets_total", "error") == 0
    # Puts of those chunks (a lookup finds no file there) are refused, not failures.
    for i in range(1, 5):
        obj = chunk(pool, 10 + i)
        tier.submit_put(key(i), obj)
        obj.ref_down()
        assert tier.flush(5)
        assert tier.up, tier.health.reason
    assert counted(tier, "remote_puts_total", "error") == 0
    back = tier.get(key(0), pool)
    assert back is not None and torch.equal(back.raw, good.raw)
    back.ref_down()
    good.ref_down()


def test_a_file_under_a_namespace_directorys_name_refuses_puts_only(tmp_path, tiers, pool) -> None:
    (tmp_path / NS).write_bytes(b"someone else's")  # where the namespace directory goes
    tier = tiers(f"fs://{tmp_path}", absence_ttl_s=0)
    assert tier.wait_ready(5)
    for i in range(4):
        obj = chunk(pool, 40 + i)
        tier.submit_put(key(i), obj)
        obj.ref_down()
        assert tier.flush(5)
        assert tier.up, tier.health.reason  # was down after three (FileExistsError)
    assert counted(tier, "remote_puts_total", "error") == 0
    assert counted(tier, "remote_puts_total", "too_large") == 4
    for i in range(4):  # and gets there are misses (were NotADirectoryError failures)
        assert tier.get(key(i), pool) is None
        assert tier.up, tier.health.reason
    assert counted(tier, "remote_gets_total", "error") == 0


def test_a_fifo_under_a_chunk_name_holds_no_io_thread(tmp_path, tiers, pool) -> None:
    tier = tiers(f"fs://{tmp_path}", timeout_s=0.5, absence_ttl_s=0)
    assert tier.wait_ready(5)
    good = chunk(pool, 3)
    tier.submit_put(key(0), good)
    assert tier.flush(5)
    fifos = [tmp_path / NS / chunk_file_name(key(i)) for i in range(1, 6)]
    for fifo in fifos:
        os.mkfifo(fifo)
    try:
        for i in range(1, 6):
            t0 = time.monotonic()
            assert tier.get(key(i), pool) is None
            assert time.monotonic() - t0 < 0.4
        # Was: each get's open() blocked a pool thread for good; with all four held
        # the pings timed out, the tier stayed down for ever and the process could not
        # exit (the pool's threads are joined at exit).
        time.sleep(0.3)
        assert tier.up, tier.health.reason
        assert counted(tier, "remote_gets_total", "corrupt") == 5
        back = tier.get(key(0), pool)
        assert back is not None and torch.equal(back.raw, good.raw)
        back.ref_down()
    finally:
        for fifo in fifos:  # a writer's open lets a blocked reader's open return
            with contextlib.suppress(OSError):
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        good.ref_down()


def test_stale_temporary_files_of_a_killed_writer_are_removed_live_ones_kept(
    tmp_path, tiers
) -> None:
    ns_dir = tmp_path / NS
    ns_dir.mkdir()
    dead = [ns_dir / temp_file_name(key(i), "deadwriter01") for i in range(3)]
    live = ns_dir / temp_file_name(key(9), "livewriter01")
    other = ns_dir / "notes.txt"
    old = time.time() - remote_fs.STALE_TEMP_S - 60
    for path in (*dead, live, other):
        path.write_bytes(b"x" * 4096)
    for path in (*dead, other):
        os.utime(path, (old, old))
    tier = tiers(f"fs://{tmp_path}")
    assert tier.wait_ready(5)
    # Nothing removed them before: with a quota they would fill it, chunk by chunk.
    assert wait_for(lambda: tier.connector.stale_temps_removed is not None)
    assert tier.connector.stale_temps_removed == 3
    assert not any(p.exists() for p in dead)
    assert live.exists() and other.exists()


def test_the_sweep_keeps_live_writes_when_this_hosts_clock_runs_ahead(
    tmp_path, tiers, monkeypatch
) -> None:
    """On NFS the files' mtimes come from the server's clock: a worker whose own clock
    is two hours fast must still see another worker's fresh temporary file as fresh."""
    ns_dir = tmp_path / NS
    ns_dir.mkdir()
    live = ns_dir / temp_file_name(key(9), "livewriter01")
    live.write_bytes(b"x" * 4096)
    ahead = time.time() + 2 * remote_fs.STALE_TEMP_S
    monkeypatch.setattr(remote_fs.time, "time", lambda: ahead)
    tier = tiers(f"fs://{tmp_path}")
    assert tier.wait_ready(5)
    assert wait_for(lambda: tier.connector.stale_temps_removed is not None)
    assert tier.connector.stale_temps_removed == 0 and live.exists()


@pytest.fixture
def tmpfs(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)]).returncode:
        pytest.skip("cannot mount a tmpfs")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_a_shared_dir_remounted_read_only_still_serves_its_chunks(tmpfs, tiers, pool) -> None:
    tier = tiers(f"fs://{tmpfs}")
    assert tier.wait_ready(5)
    objs = [chunk(pool, 10 + i) for i in range(4)]
    for i, obj in enumerate(objs):
        tier.submit_put(key(i), obj)
    assert tier.flush(5)
    subprocess.run(["mount", "-o", "remount,ro", str(tmpfs)], check=True)
    try:
        for i in range(4, 10):
            obj = chunk(pool, 10 + i)
            tier.submit_put(key(i), obj)
            obj.ref_down()
            assert tier.flush(5)
        time.sleep(0.3)  # a few health checks
        # Was: three failed puts and every ping marked it down, and gets missed on
        # files that still read.
        assert tier.up, tier.health.reason
        assert counted(tier, "remote_puts_total", "store_full") == 6
        for i, obj in enumerate(objs):
            back = tier.get(key(i), pool)
            assert back is not None and torch.equal(back.raw, obj.raw)
            back.ref_down()
    finally:
        subprocess.run(["mount", "-o", "remount,rw", str(tmpfs)], check=False)
        for obj in objs:
            obj.ref_down()


def test_a_full_shared_dir_refuses_puts_and_leaves_no_temporary_files(tmpfs, tiers, pool) -> None:
    tier = tiers(f"fs://{tmpfs}")
    assert tier.wait_ready(5)
    for i in range(600):  # 12 KiB files on 4 MiB
        obj = chunk(pool, i)
        tier.submit_put(key(i), obj)
        obj.ref_down()
        if i % 32 == 31:
            assert tier.flush(5)
    assert tier.flush(5)
    assert tier.up, tier.health.reason
    assert counted(tier, "remote_puts_total", "store_full") > 0
    assert counted(tier, "remote_puts_total", "error") == 0
    assert not [p for p in (tmpfs / NS).iterdir() if p.name.endswith(".tmp")]
    back = tier.get(key(0), pool)
    assert back is not None
    back.ref_down()

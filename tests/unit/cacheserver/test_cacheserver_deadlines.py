"""The cache-server's deadlines against stalled or slow peers, on real listeners and a
real spill in this process: an lm:// client that stalls mid-header, never reads its
replies or stays idle is dropped (and a good client gets its slot); a data-connection
request trickled a byte at a time is dropped at its one deadline; an mget of spilled
keys answers within one request deadline, the keys not read by then as misses."""

from __future__ import annotations

import asyncio
import os
import socket
import time
from pathlib import Path
from typing import Any

from kvtest.cacheserver_handlers import handlers

from kvmesh.common.config import CacheServerConfig
from kvmesh.common.observability import Metrics
from kvmesh.common.protocol import cacheserver as proto
from kvmesh.common.protocol import cacheserver_data as data
from kvmesh.common.protocol import lmcache_lm as lm
from kvmesh.services.cacheserver.data_listener import DataListener
from kvmesh.services.cacheserver.lm_listener import LmListener
from kvmesh.services.cacheserver.spill import DiskSpill
from kvmesh.services.cacheserver.stats import ServerStats
from kvmesh.services.cacheserver.store import MemoryStore, make_entry

MiB = 1 << 20
TIMEOUT_S = 0.3  # request_timeout_s here


def lm_request(command: int, key: str, payload: bytes = b"") -> bytes:
    return lm.LmRequest(command, len(payload), 1, 2, 1, (0, 0, 0, 0), key).pack() + payload


async def lm_listener(**config: Any) -> LmListener:
    cfg = CacheServerConfig(
        **{
            "request_timeout_s": TIMEOUT_S,
            "lm_enabled": True,
            "lm_port": 0,
            "max_connections": 2,
            "max_memory": 64 * MiB,
            "max_value_size": 16 * MiB,
            **config,
        }
    )
    srv = LmListener(
        MemoryStore(int(cfg.max_memory), int(cfg.max_value_size)), ServerStats(Metrics()), cfg
    )
    await srv.start()
    return srv


def connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setblocking(False)
    return sock


async def until(cond, within_s: float) -> float:
    """Seconds until cond() held; AssertionError if it did not within within_s."""
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < within_s, "not within the deadline"
        await asyncio.sleep(0.01)
    return time.monotonic() - t0


async def test_lm_peers_that_stall_mid_header_or_never_read_lose_their_slots() -> None:
    srv = await lm_listener()
    loop = asyncio.get_running_loop()
    half = connect(srv.port)  # half a header, then silence (no FIN)
    unread = connect(srv.port)  # gets a large value and never reads it
    try:
        unread.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        value = b"x" * (8 * MiB)
        await loop.sock_sendall(unread, lm_request(lm.Command.PUT, "big", value))
        await loop.sock_sendall(unread, lm_request(lm.Command.GET, "big"))
        await loop.sock_sendall(half, lm_request(lm.Command.GET, "k")[:100])
        await until(lambda: srv.connections == 2, 2.0)
        # Both dropped at request_timeout_s (they were held forever).
        assert await until(lambda: srv.connections == 0, 10 * TIMEOUT_S) < 6 * TIMEOUT_S
        good = connect(srv.port)
        try:
            await loop.sock_sendall(good, lm_request(lm.Command.HEALTH, "h"))
            async with asyncio.timeout(2):
                reply = await loop.sock_recv(good, lm.REPLY_SIZE)
            assert lm.parse_reply(reply).code == 200
        finally:
            good.close()
    finally:
        half.close()
        unread.close()
        await srv.stop()


async def test_lm_clients_cancelled_at_stop_log_no_error() -> None:
    loop = asyncio.get_running_loop()
    errors: list[dict] = []
    loop.set_exception_handler(lambda _, context: errors.append(context))
    srv = await lm_listener()
    sock = connect(srv.port)
    try:
        await until(lambda: srv.connections == 1, 2.0)
        await srv.stop()
        await asyncio.sleep(0.05)  # the stream's done-callback runs
    finally:
        sock.close()
    assert errors == []


async def test_a_data_request_trickled_in_is_dropped_at_its_one_deadline() -> None:
    cfg = CacheServerConfig(request_timeout_s=0.5, data_port=0)
    dl = DataListener(
        handlers(MemoryStore(MiB, 64 * 1024)), ServerStats(Metrics()), cfg, lambda: dl.connections
    )
    await dl.start()
    loop = asyncio.get_running_loop()
    sock = connect(dl.port)
    try:
        await loop.sock_sendall(sock, data.PREAMBLE.pack(data.MAGIC, dl.token))
        async with asyncio.timeout(2):
            assert await loop.sock_recv(sock, len(data.READY)) == data.READY
        request = data.pack_get("k" * 500)
        t0 = time.monotonic()
        with_slot: list[float] = []
        for i in range(15):  # one byte every 0.2 s: each receive is within 0.5 s
            try:
                await loop.sock_sendall(sock, request[i : i + 1])
            except OSError:
                break  # the server closed the connection
            if dl.connections:
                with_slot.append(time.monotonic() - t0)
            await asyncio.sleep(0.2)
        await until(lambda: dl.connections == 0, 1.0)
        assert max(with_slot) < 0.5 + 0.4, with_slot  # it was held 3 s and more
    finally:
        sock.close()
        await dl.stop()


async def test_an_mget_of_spilled_keys_answers_within_one_deadline(tmp_path: Path) -> None:
    spill = DiskSpill(tmp_path, 1 << 30)
    store = MemoryStore(300_000, 200_000, spill)
    h = handlers(store)
    h.request_timeout_s = TIMEOUT_S
    try:
        values = {f"k{i}": os.urandom(100_000) for i in range(12)}
        keys = list(values)
        for k, v in values.items():
            store.put(k, make_entry(v))
        await until(lambda: sum(k in spill for k in keys) >= 10, 5.0)  # written out
        spilled = [k for k in keys if store.needs_disk(k)]
        real_read = spill.read

        async def slow_read(key: str):  # a slow disk: each read takes most of a deadline
            await asyncio.sleep(0.25)
            return await real_read(key)

        spill.read = slow_read  # type: ignore[method-assign]
        t0 = time.monotonic()
        reply, frames = await h.aget_many(proto.GetValues(1, spilled), [])
        elapsed = time.monotonic() - t0
        # Read one after another, each under its own deadline, this took 2.5 s.
        assert elapsed < TIMEOUT_S + 0.2, elapsed
        # A few read side by side in the time, the rest answered as timed-out misses.
        found = sum(reply.found)
        assert 2 <= found < len(spilled) and len(frames) == found
        assert h.stats.metrics.value("cacheserver_misses_total", {"reason": "timeout"}) == (
            len(spilled) - found
        )
        read = [k for k, f in zip(spilled, reply.found, strict=True) if f]
        assert [bytes(f) for f in frames] == [values[k] for k in read]
    finally:
        spill.close()

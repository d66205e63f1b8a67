"""The lookup-server's chunk-size check at scale and under socket churn, against a real
controller: more registered workers than the worker pool holds sockets, workers that
never answer, workers the controller only knows from its snapshot, endpoints another
engine answers at, and an index in sync (no controller round trip per round). Also the
pool itself: a socket it closes to make room (under a waiting send) is a miss for the
request that waited on it, never a CancelledError that kills the request unanswered.

The pool's size is patched small (MAX_ENDPOINTS) rather than opening 1,000 sockets.
"""

from __future__ import annotations

import asyncio
import itertools
import tempfile
import time
import urllib.request
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import zmq
import zmq.asyncio
from kvtest.controller import CHUNK, ControllerProcess, build_engine
from kvtest.prom import sample_sum
from kvtest.remote import free_port
from structlog.testing import capture_logs

from kvmesh.common.config import LookupConfig
from kvmesh.common.protocol import controller as cproto
from kvmesh.common.protocol import lookup as wire
from kvmesh.common.protocol import lookup_service as proto
from kvmesh.common.transport.controller_client import ControllerConnection
from kvmesh.services.lookup import server as server_mod
from kvmesh.services.lookup import workers as workers_mod
from kvmesh.services.lookup.server import LookupService
from kvmesh.services.lookup.workers import WorkerPool
from kvmesh.services.worker.lookup_server import attach_lookup_server

NS = "0123456789abcdef"
MISMATCH = "worker chunk size differs from lookup.chunk_size"
NO_ANSWER = "worker did not answer the chunk size check"


def dead_endpoints(n: int) -> list[str]:
    """Endpoints nobody serves: a send waits there (ZMQ_IMMEDIATE) until its deadline."""
    d = tempfile.mkdtemp(prefix="kvm-cc")
    return [f"ipc://{d}/w{i}" if i % 2 else f"tcp://127.0.0.1:{free_port()}" for i in range(n)]


async def register(url: str, workers: list[tuple[str, int, int, str]], heartbeat_s: float = 60.0):
    """(instance, rank, world_size, lookup endpoint) each, over one connection that the
    caller closes."""
    conn = ControllerConnection(url, timeout_s=5.0, client="fake-workers")
    await conn.connect(hello=True)
    for instance, rank, world, endpoint in workers:
        msg = cproto.Register(
            conn.next_rid(), instance, rank, world, [NS], "", heartbeat_s, endpoint
        )
        await conn.request(msg, cproto.RegisterReply)
    return conn


class Asks:
    """Wraps a service's pool.ask: every batch, what was in flight, the pool's size."""

    def __init__(self, svc: LookupService) -> None:
        self.batches: list[list[str]] = []
        self.times: dict[str, list[float]] = {}
        self.in_flight = self.most_in_flight = self.most_sockets = 0
        self.raised: list[BaseException] = []
        self._pool = svc._pool
        self._ask = svc._pool.ask
        svc._pool.ask = self.ask  # type: ignore[method-assign]

    async def ask(self, endpoints: list[str], make: Callable, timeout_s: float) -> list[Any]:
        self.batches.append(endpoints)
        now = time.monotonic()
        for e in endpoints:
            self.times.setdefault(e, []).append(now)
        self.in_flight += len(endpoints)
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            return await self._ask(endpoints, make, timeout_s)
        except BaseException as exc:
            self.raised.append(exc)
            raise
        finally:
            self.in_flight -= len(endpoints)
            self.most_sockets = max(self.most_sockets, len(self._pool._conns))


async def until(cond: Callable[[], bool], timeout_s: float, what: str) -> None:
    end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


def run(coro: Awaitable[None]) -> None:
    asyncio.run(coro)  # type: ignore[arg-type]


@pytest.fixture
def small_pool(monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.setattr(workers_mod, "MAX_ENDPOINTS", 40)
    monkeypatch.setattr(server_mod, "CHUNK_CHECK_S", 0.05)
    return 40


def mismatches(svc: LookupService) -> float:
    return svc.metrics.value("lookup_chunk_size_mismatch_total") or 0.0


def hello(rid: int, deadline: float, i: int) -> wire.Hello:
    return wire.Hello(rid, wire.PROTOCOL_VERSION, "test")


# -- the pool -----------------------------------------------------------------------------


def test_a_socket_closed_under_a_waiting_send_is_a_miss(small_pool: int) -> None:
    """100 endpoints at once through a pool of 40 sockets: opening the 41st closes the
    first while its send waits. Before, that send raised CancelledError out of gather
    (and out of whatever request asked); now it is a miss like a timeout, at once."""

    async def main() -> None:
        pool = WorkerPool()
        try:
            t0 = time.monotonic()
            replies = await pool.ask(dead_endpoints(100), hello, 1.0)
            assert replies == [None] * 100
            assert time.monotonic() - t0 < 1.5
            assert len(pool._conns) <= small_pool

            def release(rid: int) -> wire.ReleaseLookup:
                return wire.ReleaseLookup(rid, wire.PROTOCOL_VERSION, "x")

            assert await pool.send_all(dead_endpoints(100), release) == 0
        finally:
            await pool.close()

    run(main())


def test_a_lookup_whose_sockets_are_closed_under_it_is_answered(
    tmp_path: Path, small_pool: int
) -> None:
    """An instance of 100 ranks (none answering) through a pool of 40: the Lookup gets a
    reply (every rank a miss), not silence."""
    controller = ControllerProcess(tmp_path, snapshot=False).start()

    async def main() -> None:
        ranks = [("big", r, 100, e) for r, e in enumerate(dead_endpoints(100))]
        conn = await register(controller.url, ranks)
        svc = LookupService(
            LookupConfig(port=0, controller_url=controller.url, index=False, worker_timeout_s=1.0)
        )
        await svc.start()
        client = zmq.asyncio.Context().socket(zmq.DEALER)
        client.linger = 0
        client.connect(f"tcp://127.0.0.1:{svc.port}")
        try:
            msg = proto.Lookup(7, proto.PROTOCOL_VERSION, "big", "req-1",
                               wire.encode_tokens(range(512)), [], False, "")  # fmt: skip
            await client.send(proto.encode(msg))
            async with asyncio.timeout(5):
                reply = proto.decode_reply(await client.recv())
            assert isinstance(reply, proto.LookupReply), reply
            assert reply.hit_tokens == 0 and reply.per_rank == [-1] * 100
        finally:
            client.close(0)
            await svc.stop()
            await conn.close()

    try:
        run(main())
    finally:
        controller.stop()


# -- the check ----------------------------------------------------------------------------


def test_1200_workers_are_checked_in_batches_the_pool_holds(
    tmp_path: Path, small_pool: int
) -> None:
    """1,200 registered workers that never answer and one real engine of another chunk
    size, a pool of 40 sockets: every round asks at most 40, the check goes on to the
    end of the list (before: its first round of 1,200 at once closed sockets under
    their sends, and the check died of the CancelledError), the engine is found, and
    each silent worker is logged once."""
    controller = ControllerProcess(tmp_path, snapshot=False).start()
    engine = build_engine("inst-a", controller.url)  # engine.chunk_size = CHUNK
    attach_lookup_server(engine, f"tcp://127.0.0.1:{free_port()}")

    async def main() -> None:
        fakes = [(f"fake{i}", 0, 1, e) for i, e in enumerate(dead_endpoints(1200))]
        conn = await register(controller.url, fakes)
        cfg = LookupConfig(
            port=0, controller_url=controller.url, index=False, chunk_size=2 * CHUNK,
            worker_timeout_s=0.2,
        )  # fmt: skip
        svc = LookupService(cfg)
        asks = Asks(svc)
        with capture_logs() as logs:
            await svc.start()
            try:
                everyone = {e for _, _, _, e in fakes} | {engine.lookup_endpoint}
                await until(lambda: everyone <= asks.times.keys(), 30, "every worker asked")
                await until(lambda: mismatches(svc) == 1, 5, "the mismatch")
                check = svc._tasks[1]
                assert not check.done(), check
                assert asks.raised == []
                assert max(len(b) for b in asks.batches) <= small_pool
                assert asks.most_in_flight <= small_pool
                assert asks.most_sockets <= small_pool
                await asyncio.sleep(0.5)  # more rounds: the engine is not asked again
                assert len(asks.times[engine.lookup_endpoint]) == 1
            finally:
                await svc.stop()
                await conn.close()
        mismatch = [e for e in logs if e["event"].startswith(MISMATCH)]
        assert [(e["worker"], e["engine_chunk_size"]) for e in mismatch] == [("inst-a/0", CHUNK)]
        silent = [e["worker"] for e in logs if e["event"].startswith(NO_ANSWER)]
        assert len(silent) == len(set(silent)) == 1200

    try:
        run(main())
    finally:
        engine.close()
        controller.stop()


def test_silent_workers_are_asked_less_and_less_often(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, small_pool: int
) -> None:
    """The wait before asking a silent worker again doubles (0.05 s up to 0.4 s here),
    and its socket is not kept open (reconnecting) meanwhile."""
    monkeypatch.setattr(server_mod, "CHUNK_CHECK_BACKOFF_MAX_S", 0.4)
    controller = ControllerProcess(tmp_path, snapshot=False).start()

    async def main() -> None:
        endpoints = dead_endpoints(3)
        conn = await register(controller.url, [(f"s{i}", 0, 1, e) for i, e in enumerate(endpoints)])
        cfg = LookupConfig(
            port=0, controller_url=controller.url, index=False, worker_timeout_s=0.05
        )
        svc = LookupService(cfg)
        asks = Asks(svc)
        await svc.start()
        try:
            await asyncio.sleep(3.0)
            for e in endpoints:
                times = asks.times[e]
                gaps = [round(b - a, 2) for a, b in itertools.pairwise(times)]
                # Every ~0.1 s without a backoff (30 asks); with it 0.1, 0.15, 0.25,
                # 0.45, then ~0.45 each: about 9.
                assert 4 <= len(times) <= 12, gaps
                assert gaps[2] > gaps[0] and max(gaps) >= 0.4, gaps
            # Between two asks (none in flight: the check has discarded at once).
            await until(lambda: asks.in_flight == 0, 2, "no ask in flight")
            assert not set(endpoints) & svc._pool._conns.keys()  # closed between asks
        finally:
            await svc.stop()
            await conn.close()

    try:
        run(main())
    finally:
        controller.stop()


def test_workers_restored_from_the_snapshot_are_not_asked(tmp_path: Path, small_pool: int) -> None:
    """A worker the restarted controller knows only from its snapshot (its engine may be
    gone for good) is not asked; one registered since is."""
    controller = ControllerProcess(tmp_path, snapshot=True).start()

    def snapshots() -> float:
        with urllib.request.urlopen(controller.http + "/metrics", timeout=5) as r:
            return sample_sum(r.read().decode(), "kvmesh_controller_snapshots_total")

    async def main() -> None:
        [gone, fresh] = dead_endpoints(2)
        conn = await register(controller.url, [("gone", 0, 1, gone)])
        await conn.close()
        written = snapshots()
        await until(lambda: snapshots() >= written + 2, 10, "a snapshot with the worker")
        controller.kill()
        controller.start()
        conn = await register(controller.url, [("fresh", 0, 1, fresh)])
        svc = LookupService(LookupConfig(port=0, controller_url=controller.url, index=False))
        asks = Asks(svc)
        await svc.start()
        try:
            await until(lambda: fresh in asks.times, 5, "the worker registered since asked")
            await asyncio.sleep(0.3)
            assert gone not in asks.times
        finally:
            await svc.stop()
            await conn.close()

    try:
        run(main())
    finally:
        controller.stop()


def test_an_endpoint_answered_by_another_engine_is_not_judged(
    tmp_path: Path, small_pool: int
) -> None:
    """A registration whose lookup endpoint another engine answers at (a list behind, a
    reused endpoint): the Hello's instance and rank are not the worker's, so that
    engine's chunk size is not blamed on it."""
    controller = ControllerProcess(tmp_path, snapshot=False).start()
    engine = build_engine("inst-a", controller.url)
    attach_lookup_server(engine, f"tcp://127.0.0.1:{free_port()}")

    async def main() -> None:
        conn = await register(controller.url, [("stale", 0, 1, engine.lookup_endpoint)])
        cfg = LookupConfig(port=0, controller_url=controller.url, index=False, chunk_size=2 * CHUNK)
        svc = LookupService(cfg)
        with capture_logs() as logs:
            await svc.start()
            try:
                await until(lambda: mismatches(svc) >= 1, 10, "the mismatch")
                await asyncio.sleep(0.3)
            finally:
                await svc.stop()
                await conn.close()
        blamed = [e["worker"] for e in logs if e["event"].startswith(MISMATCH)]
        assert blamed == ["inst-a/0"], blamed
        assert ("stale/0", engine.lookup_endpoint) not in svc._chunk_checked
        # Logged once, as not answering (as itself); under load its first Hello may
        # have timed out before the engine's socket was up.
        other = [(e["worker"], e["error"]) for e in logs if e["event"].startswith(NO_ANSWER)]
        assert other in ([("stale/0", "answered as inst-a/0")], [("stale/0", "no answer")]), other

    try:
        run(main())
    finally:
        engine.close()
        controller.stop()


def test_with_the_index_in_sync_the_controller_is_not_asked_each_round(
    tmp_path: Path, small_pool: int
) -> None:
    """The workers come from the lookup-server's own index copy while it is in sync: the
    engine is still checked, and no ListWorkers goes to the controller."""
    controller = ControllerProcess(tmp_path, snapshot=False).start()
    engine = build_engine("inst-a", controller.url)
    attach_lookup_server(engine, f"tcp://127.0.0.1:{free_port()}")

    async def main() -> None:
        cfg = LookupConfig(port=0, controller_url=controller.url, index=True, chunk_size=2 * CHUNK)
        svc = LookupService(cfg)
        lists = 0
        ask_once = svc._ask_controller_once

        async def counted(build: Callable[[int], Any], expect: type) -> Any:
            nonlocal lists
            lists += expect is cproto.ListWorkersReply
            return await ask_once(build, expect)

        svc._ask_controller_once = counted  # type: ignore[method-assign]
        await svc.start()
        try:
            assert svc.follower is not None
            await until(svc.follower.in_sync, 10, "the index in sync")
            await until(lambda: mismatches(svc) == 1, 10, "the mismatch")
            await asyncio.sleep(0.5)  # ~10 more rounds
            assert lists == 0
        finally:
            await svc.stop()

    try:
        run(main())
    finally:
        engine.close()
        controller.stop()

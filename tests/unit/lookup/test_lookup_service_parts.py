"""The lookup-server's parts against stand-in peers on real sockets: the worker pool
past a ZMQ context's socket limit, the index follower when a stepped replacement
fails, and the request handlers (late ranks, missing ranks, the worker-list re-read,
long prompts, a controller's refusal, the in-flight byte budget)."""

from __future__ import annotations

import asyncio
import errno
import tempfile
import threading
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import zmq
import zmq.asyncio
from kvtest.fake_controller import FakeController

from kvmesh.common.chunk_holders import WALK_STEP
from kvmesh.common.config import LookupConfig
from kvmesh.common.observability import Metrics
from kvmesh.common.protocol import controller as cproto
from kvmesh.common.protocol import lookup as wire
from kvmesh.common.protocol import lookup_service as proto
from kvmesh.services.lookup import server as server_mod
from kvmesh.services.lookup import workers as workers_mod
from kvmesh.services.lookup.follower import IndexFollower
from kvmesh.services.lookup.server import LookupService
from kvmesh.services.lookup.workers import MAX_ENDPOINTS, WorkerPool

NS = "0123456789abcdef"


class StandIn:
    """A ROUTER on a thread; answer(msg_bytes) gives the replies to send (after an
    optional delay each) and every request is kept."""

    def __init__(self, answer: Callable[[bytes], list[tuple[float, bytes]]]) -> None:
        self.answer = answer
        self.seen: list[bytes] = []
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.linger = 0
        self.port = self._sock.bind_to_random_port("tcp://127.0.0.1")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    def _serve(self) -> None:
        later: list[tuple[float, bytes, bytes]] = []
        while not self._stop.is_set():
            if self._sock.poll(5):
                peer, raw = self._sock.recv_multipart()
                self.seen.append(raw)
                now = time.monotonic()
                later += [(now + delay, peer, reply) for delay, reply in self.answer(raw)]
            now = time.monotonic()
            for item in [i for i in later if i[0] <= now]:
                later.remove(item)
                self._sock.send_multipart([item[1], item[2]])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sock.close(0)
        self._ctx.term()


def controller_answers(
    list_workers: list[cproto.WorkerInfo] | None = None,
    prefix_counts: Callable[[cproto.PrefixCounts], cproto.Reply] | None = None,
    delay: float = 0.0,
) -> Callable[[bytes], list[tuple[float, bytes]]]:
    def answer(raw: bytes) -> list[tuple[float, bytes]]:
        msg = cproto.decode_request(raw)
        if isinstance(msg, cproto.Hello):
            reply: Any = cproto.HelloReply(msg.rid, cproto.PROTOCOL_VERSION, "c")
        elif isinstance(msg, cproto.ListWorkers):
            reply = cproto.ListWorkersReply(msg.rid, list_workers or [])
        else:
            assert prefix_counts is not None
            reply = prefix_counts(msg)
        return [(delay, cproto.encode(reply))]

    return answer


def worker(rank: int, world: int, endpoint: str) -> cproto.WorkerInfo:
    return cproto.WorkerInfo(f"i/{rank}", "i", rank, world, "", {}, 0, 0.0, False, endpoint)


def service(controller_url: str = "tcp://127.0.0.1:1", **kw: Any) -> LookupService:
    return LookupService(LookupConfig(index=False, controller_url=controller_url, **kw))


def fixed_workers(svc: LookupService, workers: list[cproto.WorkerInfo]) -> None:
    async def instance_workers(instance_id: str, op: str) -> list[cproto.WorkerInfo]:
        return workers

    svc._instance_workers = instance_workers  # type: ignore[method-assign]


# -- the worker pool ----------------------------------------------------------------------


async def test_the_pool_asks_any_number_of_endpoints_over_time() -> None:
    """More endpoints than a ZMQ context holds sockets: the least recently asked are
    closed, and a new one is still asked (not INTERNAL, not a silent release loss)."""
    pool = WorkerPool()
    d = tempfile.mkdtemp(prefix="kvm-pool")

    def make(rid: int, deadline: float, rank: int) -> wire.LookupPrefix:
        return wire.LookupPrefix(rid, 1, "x", b"", False, "", deadline)

    try:
        for i in range(0, 1100, 100):
            replies = await pool.ask([f"ipc://{d}/w{j}" for j in range(i, i + 100)], make, 0.01)
            assert replies == [None] * 100
        assert len(pool._conns) <= MAX_ENDPOINTS
        worker_ep = StandIn(lambda raw: [(0.0, wire.encode(wire.LookupPrefixReply(
            wire.decode_request([raw]).rid, 64)))])  # fmt: skip
        try:
            [reply] = await pool.ask([worker_ep.url], make, 2.0)
            assert isinstance(reply, wire.LookupPrefixReply) and reply.hit_tokens == 64
        finally:
            worker_ep.close()
    finally:
        await pool.close()


async def test_a_socket_that_cannot_be_made_is_a_miss(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_socket(*args: Any) -> None:
        raise zmq.ZMQError(errno.EMFILE)

    monkeypatch.setattr(workers_mod, "_Conn", no_socket)
    pool = WorkerPool()
    try:
        make = lambda rid, dl, rank: wire.LookupPrefix(rid, 1, "x", b"", False, "", dl)  # noqa: E731
        assert await pool.ask(["tcp://127.0.0.1:9"], make, 0.5) == [None]
    finally:
        await pool.close()


# -- the index follower -------------------------------------------------------------------


async def wait_until(cond: Callable[[], bool], timeout_s: float, what: str) -> None:
    end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < end, what
        await asyncio.sleep(0.02)


async def test_a_stepped_replacement_that_fails_starts_a_resync() -> None:
    w = cproto.IndexWorker("a/0", "a", 0, 1, [NS])
    with FakeController({"a/0": cproto.IndexWorkerState(w, {"l1": b""})}) as fake:
        f = IndexFollower(
            fake.url, Metrics({}), ping_s=0.05, max_staleness_s=0.5,
            request_timeout_s=1.0, snapshot_timeout_s=5.0,
        )  # fmt: skip
        await f.start()
        try:
            await wait_until(f.in_sync, 10, "first sync")
            bad = b"\0" * (8 * (WALK_STEP + 1) + 3)  # stepped, and not whole ints
            fake.push(lambda e, s: cproto.WorkerReplaced(0, e, s, "a/0", {"l1": bad}))
            for i in range(200):
                run = [(1, "l1", (i + 1).to_bytes(8, "little"))]
                fake.push(lambda e, s, run=run: cproto.IndexEvents(0, e, s, "a/0", run))
            await wait_until(lambda: fake.subscribes >= 2, 10, "a resync")
            await wait_until(lambda: f.in_sync() and f.seq == 201, 10, "back in sync")
            assert f._held is None and f._replacing is None
        finally:
            await f.stop()


# -- the handlers -------------------------------------------------------------------------


async def test_a_rank_that_answers_late_is_released() -> None:
    """A rank whose reply misses the deadline may have pinned: a 0 answer releases it."""

    def answer(raw: bytes) -> list[tuple[float, bytes]]:
        msg = wire.decode_request([raw])
        if isinstance(msg, wire.LookupPrefix):
            return [(0.3, wire.encode(wire.LookupPrefixReply(msg.rid, 256)))]
        return []

    worker_ep = StandIn(answer)
    svc = service(worker_timeout_s=0.1)
    fixed_workers(svc, [worker(0, 1, worker_ep.url)])
    try:
        msg = proto.Lookup(7, 1, "i", "req-1", wire.encode_tokens(range(512)), [], True, "")
        reply = await svc._lookup_in(msg, "req-1")
        assert (reply.hit_tokens, reply.per_rank) == (0, [-1])
        await wait_until(lambda: len(worker_ep.seen) >= 2, 2, "a release")
        kinds = [type(wire.decode_request([raw])).__name__ for raw in worker_ep.seen]
        assert kinds == ["LookupPrefix", "ReleaseLookup"]
    finally:
        await svc._pool.close()
        worker_ep.close()


async def test_a_down_rank_does_not_hold_up_the_answer() -> None:
    """Rank 1 is down (nothing listens): rank 0's pins are released, and the answer
    does not wait for that release to find room on the dead rank's socket."""

    def answer(raw: bytes) -> list[tuple[float, bytes]]:
        msg = wire.decode_request([raw])
        if isinstance(msg, wire.LookupPrefix):
            return [(0.0, wire.encode(wire.LookupPrefixReply(msg.rid, 256)))]
        return []

    up = StandIn(answer)
    svc = service(worker_timeout_s=0.2)
    fixed_workers(svc, [worker(0, 2, up.url), worker(1, 2, "tcp://127.0.0.1:9")])
    try:
        msg = proto.Lookup(7, 1, "i", "req-1", wire.encode_tokens(range(512)), [], True, "")
        t0 = time.monotonic()
        reply = await svc._lookup_in(msg, "req-1")
        took = time.monotonic() - t0
        assert (reply.hit_tokens, reply.per_rank) == (0, [256, -1])
        assert took < 0.2 + workers_mod.RELEASE_TIMEOUT_S / 2, took
        await wait_until(lambda: len(up.seen) >= 2, 2, "a release")
        kinds = [type(wire.decode_request([raw])).__name__ for raw in up.seen]
        assert kinds == ["LookupPrefix", "ReleaseLookup"]
    finally:
        await svc._pool.close()
        up.close()


async def test_an_instance_missing_ranks_is_0_without_asking() -> None:
    """Its registered world_size (any number) costs nothing per rank."""
    svc = service()
    asked: list[list[str]] = []

    async def ask(endpoints: list[str], make: Any, timeout_s: float) -> list[Any]:
        asked.append(endpoints)
        return [None] * len(endpoints)

    svc._pool.ask = ask  # type: ignore[method-assign]
    try:
        for world in (3, 10**12):
            fixed_workers(svc, [worker(0, world, "tcp://127.0.0.1:9")])
            msg = proto.Lookup(1, 1, "i", "q", wire.encode_tokens(range(64)), [], True, "")
            reply = await svc._lookup_in(msg, "q")
            assert isinstance(reply, proto.LookupReply)
            assert (reply.hit_tokens, reply.per_rank) == (0, [])
        assert asked == []
    finally:
        await svc._pool.close()


async def test_concurrent_re_reads_of_the_worker_list_are_one() -> None:
    ctl = StandIn(controller_answers([worker(0, 1, "tcp://127.0.0.1:9")], delay=0.1))
    svc = service(ctl.url, controller_timeout_s=2.0)
    await svc._controller.connect(hello=False)
    try:
        await svc._instance_workers("i", "lookup")
        await asyncio.sleep(0.06)  # past the 50 ms bound for unknown ids
        n = len(ctl.seen)
        found = await asyncio.gather(
            *(svc._instance_workers(f"unknown-{i}", "lookup") for i in range(100))
        )
        assert found == [[]] * 100
        assert len(ctl.seen) - n == 1  # one ListWorkers for all of them
    finally:
        await svc._controller.close()
        ctl.close()


async def test_an_instance_the_index_lacks_is_read_from_the_controller() -> None:
    """In sync, the index may still be a push behind the controller: an instance it
    does not have, or has without its lookup endpoint, is taken from the controller's
    list; one it has complete costs no controller read."""
    ctl = StandIn(controller_answers([worker(0, 1, "tcp://127.0.0.1:9")]))
    svc = service(ctl.url, controller_timeout_s=2.0)
    in_index: dict[str, list[cproto.WorkerInfo]] = {}
    index = SimpleNamespace(instance_workers=lambda iid: in_index.get(iid, []))
    svc.follower = SimpleNamespace(  # type: ignore[assignment]
        synced_index=lambda: index, last_index=lambda: (index, time.monotonic())
    )
    await svc._controller.connect(hello=False)
    try:
        for lagging in ([], [worker(0, 1, "")]):
            in_index["i"] = lagging
            got = await svc._instance_workers("i", "lookup")
            assert [w.lookup_endpoint for w in got] == ["tcp://127.0.0.1:9"]
        asked = len(ctl.seen)
        in_index["i"] = [worker(0, 1, "tcp://127.0.0.1:8")]
        got = await svc._instance_workers("i", "lookup")
        assert [w.lookup_endpoint for w in got] == ["tcp://127.0.0.1:8"]
        assert len(ctl.seen) == asked
    finally:
        await svc._controller.close()
        ctl.close()


async def test_a_silent_controller_is_probed_by_one_request_then_asked_by_all_again() -> None:
    """While the controller does not answer, one request at a time asks it (at most
    every CONTROLLER_RETRY_S) and the others get UNAVAILABLE at once; once it answers
    again, every request asks it."""
    silent = threading.Event()
    answer = controller_answers(prefix_counts=lambda m: cproto.PrefixCountsReply(m.rid, []))
    ctl = StandIn(lambda raw: [] if silent.is_set() else answer(raw))
    svc = service(ctl.url, controller_timeout_s=1.0)
    await svc._controller.connect(hello=False)

    async def count(n: int) -> tuple[int, float]:
        t0 = time.monotonic()
        results = await asyncio.gather(
            *(svc._prefix_counts([b"h" * 16], "best") for _ in range(n)),
            return_exceptions=True,
        )
        return sum(isinstance(r, server_mod.Unavailable) for r in results), time.monotonic() - t0

    try:
        assert (await count(1))[0] == 0
        silent.set()
        assert (await count(1))[0] == 1  # waits out the deadline: the controller is down
        unavailable, took = await count(20)
        assert unavailable == 20 and took < 0.5  # nobody waited out the 1 s deadline
        await asyncio.sleep(server_mod.CONTROLLER_RETRY_S)
        probes = len(ctl.seen)
        assert (await count(20))[0] == 20  # one probe among them, in vain
        assert len(ctl.seen) - probes == 1
        silent.clear()
        await asyncio.sleep(server_mod.CONTROLLER_RETRY_S)
        assert (await count(1))[0] == 0  # the probe gets an answer
        asked = len(ctl.seen)
        for _ in range(10):
            assert (await count(2))[0] == 0
        assert len(ctl.seen) - asked == 20
        assert svc._controller_failed_at is None
    finally:
        await svc._controller.close()
        ctl.close()


async def test_long_prompts_are_hashed_off_the_loop_and_cut_to_max_hashes() -> None:
    asked: list[int] = []

    def prefix_counts(msg: cproto.PrefixCounts) -> cproto.Reply:
        asked.append(len(msg.hashes))
        if len(msg.hashes) > proto.MAX_HASHES:
            return cproto.ErrorReply(msg.rid, cproto.ErrorCode.BAD_REQUEST, "too many hashes")
        return cproto.PrefixCountsReply(msg.rid, [cproto.InstancePrefix("i", 1, 1, 3, 1)])

    ctl = StandIn(controller_answers(prefix_counts=prefix_counts))
    svc = service(ctl.url, chunk_size=16, controller_timeout_s=2.0)
    await svc._controller.connect(hello=False)
    threads: list[str] = []
    hashes = svc._tokendb.chunk_hashes

    def recorded(tokens: Any) -> list[bytes]:
        threads.append(threading.current_thread().name)
        return hashes(tokens)

    svc._tokendb.chunk_hashes = recorded  # type: ignore[method-assign]
    try:
        msg = proto.BestInstances(1, 1, wire.encode_tokens(range(320_000)), [], 0)
        reply = await svc._best(msg)
        assert isinstance(reply, proto.BestInstancesReply)
        assert [h.instance_id for h in reply.instances] == ["i"]
        assert asked == [proto.MAX_HASHES]
        assert threads and threads[0] != threading.main_thread().name
    finally:
        await svc._controller.close()
        ctl.close()


async def test_a_controller_refusal_is_not_retryable() -> None:
    def prefix_counts(msg: cproto.PrefixCounts) -> cproto.Reply:
        return cproto.ErrorReply(msg.rid, cproto.ErrorCode.BAD_REQUEST, "no")

    ctl = StandIn(controller_answers(prefix_counts=prefix_counts))
    svc = service(ctl.url, controller_timeout_s=2.0)
    await svc._controller.connect(hello=False)
    sent: list[proto.Reply] = []

    async def send(peer: bytes, reply: proto.Reply, op: str) -> None:
        sent.append(reply)

    svc._send = send  # type: ignore[method-assign]
    try:
        await svc._handle(b"p", proto.BestInstances(5, 1, b"", [b"\1" * 16], 0))
        [reply] = sent
        assert isinstance(reply, proto.ErrorReply) and reply.rid == 5
        assert reply.code == proto.ErrorCode.BAD_MESSAGE and not reply.retryable
    finally:
        await svc._controller.close()
        ctl.close()


async def test_requests_past_the_in_flight_byte_budget_are_busy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(server_mod, "MAX_INFLIGHT_BYTES", 1 << 20)
    svc = service(port=0, host="127.0.0.1")
    release = asyncio.Event()

    async def slow(msg: proto.Hello) -> proto.Reply:
        await release.wait()
        return proto.HelloReply(msg.rid, proto.PROTOCOL_VERSION, "s", 256)

    await svc.start()
    svc._handlers[proto.Lookup] = slow
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(f"tcp://127.0.0.1:{svc.port}")
    try:
        tokens = wire.encode_tokens(range(100_000))  # 400 kB each: two fit in 1 MiB
        for rid in (1, 2, 3):
            await sock.send(proto.encode(proto.Lookup(rid, 1, "i", "", tokens, [], False)))
        async with asyncio.timeout(5):
            busy = proto.decode_reply(await sock.recv())
        assert isinstance(busy, proto.ErrorReply) and busy.rid == 3 and busy.retryable
        release.set()
        async with asyncio.timeout(5):
            rids = sorted([proto.decode_reply(await sock.recv()).rid for _ in range(2)])
        assert rids == [1, 2] and svc._inflight_bytes == 0
    finally:
        sock.close(0)
        ctx.term()
        await svc.stop()


async def test_a_release_waits_for_room_in_a_busy_workers_queue() -> None:
    """A worker behind on its lookups: the pool's queue to it is full. A release waits
    (briefly) for room instead of being dropped, so the worker's pins go."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.linger = 0
    sock.setsockopt(zmq.RCVHWM, 1)
    url = f"tcp://127.0.0.1:{sock.bind_to_random_port('tcp://127.0.0.1')}"
    pool = WorkerPool()
    got: list[bytes] = []
    try:
        conn = pool._conn(url)
        while not conn.sock.poll(100, zmq.POLLOUT):
            pass  # connected
        big = b"\0" * (1 << 20)
        for _ in range(1000):  # fill what TCP and both queues hold
            try:
                await conn.sock.send(big, zmq.NOBLOCK)
            except zmq.Again:
                break
        else:
            pytest.fail("the queue never filled")

        def drain() -> None:
            time.sleep(0.3)  # the worker catches up
            while sock.poll(1000):
                got.append(sock.recv_multipart()[1])

        reader = threading.Thread(target=drain)
        reader.start()
        sent = await pool.send_all(
            [url], lambda rid: wire.ReleaseLookup(rid, wire.PROTOCOL_VERSION, "req-1")
        )
        await asyncio.to_thread(reader.join, 10)
    finally:
        await pool.close()
        sock.close(0)
        ctx.term()
    assert sent == 1
    released = [wire.decode_request([raw]) for raw in got if raw != big]
    assert [(type(m).__name__, m.lookup_id) for m in released] == [("ReleaseLookup", "req-1")]

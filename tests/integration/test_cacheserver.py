"""A real cache-server process: every operation through the client, batches, listing,
stats, the HTTP health endpoint, limits, spill, and bad input on the ZMQ listener (each
answered with an error or a closed connection while other clients go on unharmed)."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import time
import urllib.request
from pathlib import Path

import msgspec
import pytest
import zmq
import zmq.asyncio
from kvtest.remote import CacheServerProcess

from kvmesh.common.protocol import cacheserver as proto
from kvmesh.common.transport.cacheserver_client import (
    BadRequestError,
    CacheServerClient,
    CacheServerUnavailable,
    ServerBusyError,
    ValueTooLargeError,
)

MiB = 1 << 20


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = CacheServerProcess(
        tmp_path_factory.mktemp("cacheserver"),
        metrics=True,
        **{"max-memory": "64MiB", "max-value-size": "4MiB"},
    ).start()
    yield srv
    assert srv.stop() == 0, srv.log.read_text()[-2000:]


async def connected(srv: CacheServerProcess, **kw) -> CacheServerClient:
    client = CacheServerClient(srv.endpoint, timeout_s=kw.pop("timeout_s", 3.0), **kw)
    await client.connect()
    return client


def test_every_operation_round_trips(server) -> None:
    async def main() -> None:
        c = await connected(server)
        try:
            value = os.urandom(3 * MiB)
            checksum = await c.put("ops:big", value, b"meta")
            got = await c.get("ops:big")
            assert got is not None and bytes(got.data) == value
            assert (got.meta, got.checksum) == (b"meta", checksum)
            assert await c.get("ops:none") is None
            assert await c.exists("ops:big") and not await c.exists("ops:none")
            assert await c.delete("ops:big") and not await c.delete("ops:big")
            stats = await c.stats()
            assert stats.max_memory == 64 * MiB and stats.connections >= 1
            health = await c.health()
            assert health.ok and health.version == proto.PROTOCOL_VERSION
        finally:
            await c.close()

    asyncio.run(main())


def test_large_values_come_in_parts_to_clients_that_ask(server) -> None:
    async def main() -> None:
        whole = await connected(server)
        # Below the server's minimum part size: raised to proto.MIN_PART_BYTES (1 MiB).
        parted = await connected(server, value_part_bytes=1000)
        try:
            big, exact, small = os.urandom(3 * MiB + 5), os.urandom(MiB), os.urandom(5000)
            sums = [await whole.put(f"parts:{n}", v) for n, v in enumerate((big, exact, small))]

            got = await parted.get("parts:0")
            assert got is not None and isinstance(got.data, list)
            assert [p.nbytes for p in got.data] == [MiB, MiB, MiB, 5]
            assert got.tobytes() == big and got.nbytes == len(big) and got.checksum == sums[0]
            exact_got = await parted.get("parts:1")
            assert isinstance(exact_got.data, memoryview) and exact_got.tobytes() == exact

            # Batched: per-value part counts, found and missing keys mixed.
            keys = ["parts:2", "parts:none", "parts:0", "parts:1", "parts:0"]
            many = await parted.get_many(keys)
            assert many[1] is None
            assert [v.tobytes() for v in many if v] == [small, big, exact, big]
            assert [v.checksum for v in many if v] == [sums[2], sums[0], sums[1], sums[0]]
            assert isinstance(many[2].data, list) and len(many[2].data) == 4

            # A client that did not ask keeps getting one frame per value.
            one = await whole.get("parts:0")
            assert isinstance(one.data, memoryview) and bytes(one.data) == big
            assert [v.tobytes() for v in await whole.get_many(keys) if v] == [
                small, big, exact, big,
            ]  # fmt: skip
        finally:
            await whole.close()
            await parted.close()

    asyncio.run(main())


def test_a_100_chunk_batch_is_one_round_trip(server) -> None:
    async def main() -> None:
        c = await connected(server)
        try:
            items = [(f"batch:{i:03d}", os.urandom(64 * 1024), b"%d" % i) for i in range(100)]
            assert await c.put_many(items) == [0] * 100
            rids = next(c._rids)
            got = await c.get_many([k for k, _, _ in items] + ["batch:none"])
            assert next(c._rids) == rids + 2, "more than one request went out"
            assert got[-1] is None
            for (_, v, m), g in zip(items, got, strict=False):
                assert g is not None and bytes(g.data) == v and g.meta == m
            assert await c.exists_many([k for k, _, _ in items]) == [True] * 100
            listed = [k async for k in c.list_keys("batch:", page=17)]
            assert sorted(listed) == sorted(k for k, _, _ in items)
            assert sum(await c.delete_many([k for k, _, _ in items])) == 100
        finally:
            await c.close()

    asyncio.run(main())


def test_http_health_and_metrics(server) -> None:
    base = f"http://127.0.0.1:{server.metrics_port}"
    with urllib.request.urlopen(f"{base}/healthz", timeout=5) as r:
        body = json.loads(r.read())
    assert r.status == 200 and body["status"] == "ok"
    with urllib.request.urlopen(f"{base}/metrics", timeout=5) as r:
        text = r.read().decode()
    assert "kvmesh_cacheserver_requests_total" in text
    assert "kvmesh_cacheserver_memory_bytes" in text


def test_values_over_the_limit_are_refused(server) -> None:
    async def main() -> None:
        c = await connected(server)
        try:
            with pytest.raises(ValueTooLargeError):
                await c.put("big", bytes(5 * MiB))
            assert await c.put("small", b"x") > 0  # the session goes on
        finally:
            await c.close()

    asyncio.run(main())


# -- bad input ---------------------------------------------------------------------------


class RawPeer:
    """A DEALER sending whatever frames a test wants."""

    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)

    async def ask(self, *frames: bytes, timeout_s: float = 3.0):
        await self.sock.send_multipart(list(frames))
        async with asyncio.timeout(timeout_s):
            reply = await self.sock.recv_multipart()
        return proto.decode_reply(reply[0])

    async def hello(self) -> None:
        reply = await self.ask(proto.encode(proto.Hello(1, proto.PROTOCOL_VERSION)))
        assert isinstance(reply, proto.HelloReply)

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


def enc(msg) -> bytes:
    return proto.encode(msg)


def test_bad_input_gets_errors_and_others_are_served(server) -> None:
    async def main() -> None:
        good = await connected(server)
        bad = RawPeer(server.endpoint)
        try:
            await good.put("keep", b"value")
            reply = await bad.ask(enc(proto.GetValue(5, "keep")))  # no hello yet
            assert (reply.code, reply.rid, reply.retryable) == (proto.ErrorCode.NO_HELLO, 5, True)
            reply = await bad.ask(enc(proto.Hello(6, proto.PROTOCOL_VERSION + 1)))
            assert reply.code == proto.ErrorCode.VERSION_MISMATCH
            await bad.hello()
            cases = [
                ([os.urandom(64)], proto.ErrorCode.BAD_MESSAGE),
                ([msgspec.msgpack.encode(["teleport", 9, "x"])], proto.ErrorCode.UNKNOWN_MESSAGE),
                ([msgspec.msgpack.encode(["get", 9])], proto.ErrorCode.BAD_MESSAGE),
                ([enc(proto.PutValue(9, "k"))], proto.ErrorCode.BAD_FRAMES),  # no value
                ([enc(proto.PutValues(9, ["a", "b"])), b"only one"], proto.ErrorCode.BAD_FRAMES),
                ([enc(proto.GetValue(9, "x" * 600))], proto.ErrorCode.BAD_KEY),
                ([b""], proto.ErrorCode.BAD_MESSAGE),
                ([b"\x93\xa3get\x07\xa2\xff\xfe"], proto.ErrorCode.BAD_MESSAGE),  # bad UTF-8
            ]
            for frames, code in cases:
                reply = await bad.ask(*frames)
                assert isinstance(reply, proto.ErrorReply) and reply.code == code, (frames, reply)
                got = await good.get("keep")  # others unaffected, in between each
                assert got is not None and bytes(got.data) == b"value"
        finally:
            bad.close()
            await good.close()

    asyncio.run(main())


def test_batch_replies_with_a_result_missing_are_refused(server) -> None:
    """A reply one result short (a server bug) is a bad reply, not results taken for
    the wrong keys (or a bare ValueError from the mget's zip)."""
    short_field = {
        proto.PutValuesReply: "errors",
        proto.GetValuesReply: "metas",
        proto.CheckValuesReply: "found",
        proto.DeleteValuesReply: "deleted",
    }

    async def main() -> None:
        c = await connected(server)
        real = c._call

        async def one_short(make, frames=(), timeout_s=None):
            reply, rest = await real(make, frames, timeout_s)
            field = short_field.get(type(reply))
            if field is not None:
                reply = msgspec.structs.replace(reply, **{field: getattr(reply, field)[:-1]})
            return reply, rest

        keys = ["short:a", "short:b", "short:c"]
        try:
            await c.put_many([(k, b"v", b"") for k in keys])
            c._call = one_short  # type: ignore[method-assign]
            with pytest.raises(BadRequestError):
                await c.put_many([(k, b"v", b"") for k in keys])
            with pytest.raises(BadRequestError):
                await c.get_many(keys)
            with pytest.raises(BadRequestError):
                await c.exists_many(keys)
            with pytest.raises(BadRequestError):
                await c.delete_many(keys)
        finally:
            await c.close()

    asyncio.run(main())


def test_non_zmtp_bytes_and_oversized_frames_only_cost_their_connection(server) -> None:
    for payload in (os.urandom(4096), b"GET / HTTP/1.1\r\n\r\n", b"\xff" * 20):
        with socket.create_connection(("127.0.0.1", server.port), 2) as s:
            s.sendall(payload)
            s.settimeout(0.5)
            try:
                while s.recv(4096):
                    pass  # ZMQ may answer its greeting before it gives up
            except (TimeoutError, ConnectionResetError):
                pass

    async def main() -> None:
        good = await connected(server)
        big = await connected(server, timeout_s=2.0)
        try:
            # Over MAXMSGSIZE (max_value_size + 8 MiB): ZMQ drops that connection.
            with pytest.raises((CacheServerUnavailable, ValueTooLargeError)):
                await big.put("huge", bytes(13 * MiB))
            assert await good.put("after", b"ok") > 0
            assert (await good.get("after")).data == b"ok"
        finally:
            await big.close()
            await good.close()

    asyncio.run(main())


def test_connection_limit_and_spill(tmp_path: Path) -> None:
    srv = CacheServerProcess(
        tmp_path,
        **{
            "max-memory": "4MiB",
            "max-value-size": "1MiB",
            "spill-path": str(tmp_path / "spill"),
            "spill-max-size": "64MiB",
        },
    )
    os.environ["KVMESH_CACHESERVER__MAX_CONNECTIONS"] = "2"
    try:
        srv.start()
    finally:
        del os.environ["KVMESH_CACHESERVER__MAX_CONNECTIONS"]

    async def main() -> None:
        a, b = await connected(srv), await connected(srv)
        third = CacheServerClient(srv.endpoint, timeout_s=3.0)
        with pytest.raises(ServerBusyError):
            await third.connect()
        await third.close()
        await b.close()
        values = {f"s{i}": os.urandom(512 * 1024) for i in range(24)}  # 12 MiB > 4 MiB
        for k, v in values.items():
            await a.put(k, v)
        stats = await a.stats()
        assert stats.spilled_keys > 0 and stats.memory_bytes <= 4 * MiB
        # A spill file is written on the server's I/O threads after the put that
        # evicted its value is answered, and renamed into place when complete.
        deadline = time.monotonic() + 10
        while not list((tmp_path / "spill").glob("*.val")):
            assert time.monotonic() < deadline, "no spill file written"
            await asyncio.sleep(0.05)
        for k, v in values.items():  # spilled ones come back from disk, verified
            got = await a.get(k)
            assert got is not None and bytes(got.data) == v, k
        with pytest.raises(BadRequestError):
            await a.list_page("", "not-a-cursor")
        await a.close()

    try:
        asyncio.run(main())
    finally:
        assert srv.stop() == 0


def test_clients_that_came_and_went_do_not_use_up_the_connection_limit(
    tmp_path: Path,
) -> None:
    """Sessions outlive their connections (ZMQ names no disconnected peer): more
    short-lived clients than max_connections must not lock out the next one for
    session_idle_s. Found by tests/fuzz."""
    srv = CacheServerProcess(tmp_path)
    os.environ["KVMESH_CACHESERVER__MAX_CONNECTIONS"] = "2"
    try:
        srv.start()
    finally:
        del os.environ["KVMESH_CACHESERVER__MAX_CONNECTIONS"]

    async def main() -> None:
        for i in range(5):
            client = await connected(srv)
            await client.put(f"came-{i}", b"v")
            await client.close()
        # The server hears of the closed connections a moment later: a refusal until
        # then is right, one for session_idle_s (600 s) is not.
        deadline = time.monotonic() + 10
        while True:
            try:
                client = await connected(srv)
                break
            except ServerBusyError:
                assert time.monotonic() < deadline, "still refused 10 s after the others left"
                await asyncio.sleep(0.1)
        assert (await client.get("came-4")) is not None
        await client.close()

    try:
        asyncio.run(main())
    finally:
        assert srv.stop() == 0


def test_sigterm_stops_it_cleanly(tmp_path: Path) -> None:
    srv = CacheServerProcess(tmp_path).start()
    t0 = time.monotonic()
    assert srv.stop() == 0
    assert time.monotonic() - t0 < 5


def test_a_request_to_a_server_just_gone_keeps_its_deadline(tmp_path: Path) -> None:
    """The server dies and the client's loop is busy before it reads the monitor's
    disconnect event (a loaded engine): the next request finds no peer while the client
    still thinks it is connected. It must fail at its deadline, not spin the loop until
    the server comes back (it did: 2.5-3.4 s retrieves after a cache-server restart)."""
    import threading

    srv = CacheServerProcess(tmp_path).start()
    outcome: list[object] = []

    async def scenario() -> None:
        client = await connected(srv, timeout_s=0.3)
        try:
            assert client.connected
            srv.kill()
            time.sleep(0.5)  # noqa: ASYNC251 - on purpose: the loop must not see the link drop
            t0 = time.monotonic()
            try:
                await client.health()
            except CacheServerUnavailable:
                outcome.append(time.monotonic() - t0)
            else:
                outcome.append("answered")
        finally:
            await client.close()

    runner = threading.Thread(target=asyncio.run, args=(scenario(),), daemon=True)
    try:
        runner.start()
        runner.join(5)
        hung = runner.is_alive()
        if hung:
            srv.start()  # what ends the spin: let the thread finish
            runner.join(10)
        assert not hung, "the request spun its loop past its deadline"
        assert len(outcome) == 1 and isinstance(outcome[0], float), outcome
        assert outcome[0] < 0.3 + 0.25, outcome
    finally:
        srv.stop()


def test_one_hello_reopens_the_session_for_every_request_in_flight(tmp_path: Path) -> None:
    """After the server restarts, the requests that find the session gone share one
    hello (each hello also replaces the data connections), not one each."""
    srv = CacheServerProcess(tmp_path).start()

    async def main() -> int:
        client = await connected(srv, timeout_s=5.0, data_connections=4)
        hellos = 0
        real = client._send

        async def counted(header, frames, timeout_s):
            nonlocal hellos
            hellos += isinstance(header, proto.Hello)
            return await real(header, frames, timeout_s)

        client._send = counted  # type: ignore[method-assign]
        try:
            await client.put("k", b"v" * 100)
            srv.kill()
            deadline = time.monotonic() + 5
            while client.connected and time.monotonic() < deadline:  # noqa: ASYNC110
                await asyncio.sleep(0.01)  # the client's own flag; no event to wait on
            assert not client.connected
            srv.start()
            got = await asyncio.gather(
                *(client.get_into(f"k{i}", lambda meta, n: None) for i in range(8)),
                *(client.get(f"g{i}") for i in range(8)),
            )
            assert got == [None] * 16  # a fresh server holds nothing
            return hellos
        finally:
            await client.close()

    try:
        assert asyncio.run(main()) == 1
    finally:
        srv.stop()


def test_a_message_of_a_million_frames_or_keys_does_not_hold_the_loop(server) -> None:
    # ZMQ bounds a frame's size, not a message's frame count: a million empty frames are
    # 2 MB on the wire. Read whole before any check, they held the server's loop for
    # seconds (its HTTP health with it); now they are read a budget a turn, dropped past
    # the batch limit, and answered. A header of millions of keys is refused at the
    # list's length, before its keys are decoded.
    base = f"http://127.0.0.1:{server.metrics_port}"

    def health_ms() -> float:
        t0 = time.perf_counter()
        with urllib.request.urlopen(f"{base}/healthz", timeout=10) as r:
            assert r.status == 200
        return (time.perf_counter() - t0) * 1e3

    async def main() -> None:
        bad = RawPeer(server.endpoint)
        good = await connected(server)
        try:
            await bad.hello()
            await bad.sock.send_multipart([enc(proto.GetValues(41, ["k"]))] + [b""] * 1_000_000)
            reply_task = asyncio.ensure_future(bad.sock.recv_multipart())
            waits: list[float] = []
            while not reply_task.done():
                waits.append(await asyncio.to_thread(health_ms))
            reply = proto.decode_reply((await reply_task)[0])
            assert isinstance(reply, proto.ErrorReply), reply
            assert (reply.rid, reply.code) == (41, proto.ErrorCode.BAD_MESSAGE)
            assert "1000000 value frames" in reply.message
            # Served meanwhile, none held for the flood's whole time.
            assert len(waits) >= 2 and max(waits) < 1000, waits

            huge = msgspec.msgpack.encode(["mget", 42, ["k"] * 4_000_000])
            t0 = time.perf_counter()
            reply = await bad.ask(huge, timeout_s=10)
            assert (time.perf_counter() - t0) < 1.0
            assert (reply.rid, reply.code) == (42, proto.ErrorCode.BAD_MESSAGE), reply
            assert "length <= 4096" in reply.message
            assert await good.put("after-flood", b"ok") > 0
            assert (await good.get("after-flood")).data == b"ok"
        finally:
            bad.close()
            await good.close()

    asyncio.run(main())

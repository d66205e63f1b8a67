"""The cache-server's data connections against a real server process: values land in
the caller's buffer, the client falls back to ZMQ when the data port is unusable and
reconnects past connections the server closed, and bad bytes on the data port only
cost their own connection."""

from __future__ import annotations

import asyncio
import os
import socket
import struct
import time
import urllib.request

import pytest
from kvtest.remote import CacheServerProcess
from kvtest.service_process import free_port

from kvmesh.common.protocol import cacheserver_data as data
from kvmesh.common.transport.cacheserver_client import CacheServerClient

MiB = 1 << 20
IDLE_S = 1.0  # the server's session_idle_s and request_timeout_s here


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("cacheserver-data")
    config = workdir / "kvmesh.yaml"
    config.write_text(f"cacheserver:\n  session_idle_s: {IDLE_S}\n  request_timeout_s: {IDLE_S}\n")
    srv = CacheServerProcess(
        workdir,
        metrics=True,
        **{"max-memory": "64MiB", "max-value-size": "8MiB", "config": str(config)},
    ).start()
    yield srv
    assert srv.stop() == 0, srv.log.read_text()[-2000:]


async def connected(srv: CacheServerProcess) -> CacheServerClient:
    client = CacheServerClient(srv.endpoint, timeout_s=3.0, data_connections=4)
    await client.connect()
    return client


def with_client(srv: CacheServerProcess, body) -> None:
    """Run body(client) with a connected client that may use data connections."""

    async def main() -> None:
        c = await connected(srv)
        try:
            await body(c)
        finally:
            await c.close()

    asyncio.run(main())


def data_gets(srv: CacheServerProcess) -> float:
    url = f"http://127.0.0.1:{srv.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as r:
        text = r.read().decode()
    line = 'kvmesh_cacheserver_requests_total{listener="data",op="get"}'
    return sum(float(x.split()[-1]) for x in text.splitlines() if x.startswith(line))


def test_values_land_in_the_buffer_the_caller_gives(server) -> None:
    async def main(c: CacheServerClient) -> None:
        assert c.data_path
        before = data_gets(server)
        for n, size in enumerate((100, MiB, 3 * MiB + 7)):
            value = os.urandom(size)
            checksum = await c.put(f"data:{n}", value, b"meta")
            mine = memoryview(bytearray(size))
            asked: list[tuple[bytes, int]] = []

            def place(meta: bytes, nbytes: int, mine=mine, asked=asked) -> memoryview:
                asked.append((meta, nbytes))
                return mine

            got = await c.get_into(f"data:{n}", place)
            assert got is not None and got.data is mine and bytes(mine) == value
            assert asked == [(b"meta", size)]
            assert (got.meta, got.checksum) == (b"meta", checksum)
            # None: the client's own buffer, with the same bytes.
            own = await c.get_into(f"data:{n}", lambda meta, nbytes: None)
            assert own is not None and bytes(own.data) == value
        calls: list[int] = []
        missing = await c.get_into("data:none", lambda m, n: calls.append(n))
        assert missing is None and calls == []
        assert data_gets(server) >= before + 7

    with_client(server, main)


def test_eight_gets_in_flight_share_four_connections(server) -> None:
    async def main(c: CacheServerClient) -> None:
        values = [os.urandom(MiB + i) for i in range(8)]
        for i, v in enumerate(values):
            await c.put(f"many:{i}", v)
        got = await asyncio.gather(*(c.get_into(f"many:{i}", lambda m, n: None) for i in range(8)))
        assert [bytes(g.data) for g in got] == values

    with_client(server, main)


def test_a_wrong_size_from_place_fails_that_get_only(server) -> None:
    async def main(c: CacheServerClient) -> None:
        await c.put("size:a", b"x" * 5000)
        with pytest.raises(ValueError, match="buffer of 10 bytes"):
            await c.get_into("size:a", lambda m, n: memoryview(bytearray(10)))
        got = await c.get_into("size:a", lambda m, n: None)
        assert got is not None and bytes(got.data) == b"x" * 5000

    with_client(server, main)


def test_an_unreachable_data_port_falls_back_to_zmq_until_the_next_hello(server) -> None:
    async def main(c: CacheServerClient) -> None:
        await c.put("fallback:a", b"abc" * 1000)
        assert c._data is not None
        c._data.port = free_port()  # as if a NAT or a Service did not forward it
        calls: list[int] = []
        got = await c.get_into("fallback:a", lambda m, n: calls.append(n))
        assert got is not None and bytes(got.data) == b"abc" * 1000
        assert calls == [] and not c.data_path  # came over ZMQ
        await c.hello()
        assert c.data_path
        got = await c.get_into("fallback:a", lambda m, n: None)
        assert got is not None and bytes(got.data) == b"abc" * 1000

    with_client(server, main)


def test_connections_the_server_closed_while_idle_are_replaced(server) -> None:
    async def main(c: CacheServerClient) -> None:
        await c.put("idle:a", b"v" * 100)
        assert (await c.get_into("idle:a", lambda m, n: None)) is not None
        await asyncio.sleep(IDLE_S * 2.5)  # the server drops the idle connection
        got = await c.get_into("idle:a", lambda m, n: None)
        assert got is not None and bytes(got.data) == b"v" * 100

    with_client(server, main)


def _token(srv: CacheServerProcess) -> tuple[int, bytes]:
    async def main() -> tuple[int, bytes]:
        c = await connected(srv)
        try:
            reply = await c.hello()
            return reply.data_port, reply.data_token
        finally:
            await c.close()

    return asyncio.run(main())


def _exchange(port: int, payload: bytes, *, wait_s: float = 5.0) -> bytes:
    """Send payload, then read until the server closes (what it answered)."""
    with socket.create_connection(("127.0.0.1", port), timeout=wait_s) as s:
        s.sendall(payload)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out


def _refusal(answer: bytes) -> str:
    status, meta_len, nbytes, _ = data.REPLY.unpack(answer[: data.REPLY.size])
    assert status == data.REFUSED and nbytes == 0
    return answer[data.REPLY.size : data.REPLY.size + meta_len].decode()


def test_bad_bytes_on_the_data_port_cost_only_their_connection(server) -> None:
    port, token = _token(server)
    hello = data.PREAMBLE.pack(data.MAGIC, token)
    good = data.READY
    assert "magic" in _refusal(_exchange(port, os.urandom(64)))
    assert "token" in _refusal(_exchange(port, data.PREAMBLE.pack(data.MAGIC, bytes(16))))
    assert "unknown op" in _refusal(_exchange(port, hello + struct.pack("<BH", 9, 3) + b"abc")[4:])
    bad_key = data.REQUEST.pack(data.OP_GET, 3) + b"a\x00b"
    answer = _exchange(port, hello + bad_key)
    assert answer.startswith(good) and "valid key" in _refusal(answer[4:])
    too_long = data.REQUEST.pack(data.OP_GET, 600) + b"k" * 600
    assert "valid key" in _refusal(_exchange(port, hello + too_long)[4:])
    # Begun and never finished: closed after request_timeout_s, not held forever.
    t0 = time.monotonic()
    answer = _exchange(port, hello + data.REQUEST.pack(data.OP_GET, 40) + b"half")
    assert "truncated" in _refusal(answer[4:])
    assert time.monotonic() - t0 < IDLE_S + 3
    t0 = time.monotonic()
    assert "preamble" in _refusal(_exchange(port, data.MAGIC))
    assert time.monotonic() - t0 < IDLE_S + 3

    # Meanwhile and after, a client is served as before.
    async def main(c: CacheServerClient) -> None:
        await c.put("bad:ok", b"fine")
        got = await c.get_into("bad:ok", lambda m, n: None)
        assert got is not None and bytes(got.data) == b"fine" and c.data_path

    with_client(server, main)
    assert server.alive()


def test_a_client_that_does_not_ask_gets_no_data_connection(server) -> None:
    async def main() -> None:
        c = CacheServerClient(server.endpoint, timeout_s=3.0)  # data_connections=0
        await c.connect()
        try:
            await c.put("zmq:only", b"z" * 10)
            calls: list[int] = []
            got = await c.get_into("zmq:only", lambda m, n: calls.append(n))
            assert got is not None and bytes(got.data) == b"z" * 10
            assert calls == [] and not c.data_path
        finally:
            await c.close()

    asyncio.run(main())


def test_a_data_port_that_never_answers_costs_one_short_wait(server) -> None:
    async def main() -> None:
        c = await connected(server)
        # Takes connections into its backlog and never answers: a black hole.
        silent = socket.create_server(("127.0.0.1", 0), backlog=4)
        try:
            await c.put("silent:a", b"s" * 100)
            assert c._data is not None
            c._data.port = silent.getsockname()[1]
            t0 = time.monotonic()
            got = await c.get_into("silent:a", lambda m, n: None)
            assert got is not None and bytes(got.data) == b"s" * 100 and not c.data_path
            assert time.monotonic() - t0 < 2.0  # the connect deadline, not the get's 3 s
        finally:
            silent.close()
            await c.close()

    asyncio.run(main())

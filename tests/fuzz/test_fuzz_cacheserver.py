"""Fuzz the cache-server: its ZMQ ROUTER (common/protocol/cacheserver.py), its LMCache
`lm://` listener (common/protocol/lmcache_lm.py), its data connections
(common/protocol/cacheserver_data.py) and its /metrics, /health endpoint, on
one real `kvmesh serve cacheserver` process. After each batch it is alive, logged no
traceback, kept its RSS bounded (its store is bounded at 16 MiB) and still stores and
returns a value correctly in time."""

from __future__ import annotations

import asyncio
import itertools
import socket
import struct
from collections.abc import Iterator

import pytest
from fuzzkit import FUZZ_SECONDS, REPLY_S, Watched, ZmqTarget, fuzz_for, fuzz_probe_http
from hypothesis import strategies as st
from kvtest.remote import CacheServerProcess

from kvmesh.common.protocol import cacheserver as proto
from kvmesh.common.protocol import cacheserver_data as data
from kvmesh.common.protocol import lmcache_lm as lm
from kvmesh.common.transport.cacheserver_client import CacheServerClient


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CacheServerProcess]:
    work = tmp_path_factory.mktemp("fuzz-cacheserver")
    limits = {"max-memory": "16MiB", "max-value-size": "4MiB"}
    with CacheServerProcess(work, lm=True, metrics=True, **limits) as proc:
        yield proc


def test_router_answers_every_fuzzed_message(server: CacheServerProcess) -> None:
    target = ZmqTarget(server.endpoint, proto, proto.Request)
    watched = Watched(server)
    rid = itertools.count(1)

    def run_batch(batch: list[list[bytes]]) -> None:
        target.send_batch(batch)
        n = next(rid)
        value = n.to_bytes(8, "little") * 64
        reply, *_ = target.call(proto.PutValue(n, f"probe-{n}", b"m"), [value])
        assert isinstance(reply, proto.PutValueReply), reply
        reply, *frames = target.call(proto.GetValue(n, f"probe-{n}"))
        assert isinstance(reply, proto.GetValueReply) and reply.found, reply
        assert frames == [value] and reply.meta == b"m"
        watched.check()

    try:
        batches = fuzz_for("cacheserver router", target.batches(), run_batch, FUZZ_SECONDS / 2)
    finally:
        target.close()
    assert batches > 0 and target.errors > 0


int32 = st.one_of(
    st.integers(-5, 5000), st.sampled_from([-(2**31), -1, 2**31 - 1, 1 << 22, 1 << 30])
)
keys = st.one_of(
    st.text(min_size=1, max_size=40).map(lambda k: k.encode()[: lm.KEY_BYTES]),
    st.binary(max_size=lm.KEY_BYTES),
    st.sampled_from([b"", b" " * 150, b"\x00key", b"\xff\xfe", "é".encode() * 75]),
)


@st.composite
def lm_request(draw: st.DrawFn) -> bytes:
    """One lm:// request: a header of any command and fields, and some of its payload."""
    command = draw(st.one_of(st.sampled_from(list(lm.Command)), int32))
    length = draw(st.one_of(st.integers(0, 4096), int32))
    fields = [draw(int32) for _ in range(7)]
    header = struct.pack("=9i150s", command, length, *fields, draw(keys).ljust(150, b" "))
    sent = draw(st.integers(0, max(0, min(length, 8192))))
    return header + draw(st.binary(min_size=sent, max_size=sent))


lm_conversations = st.lists(
    st.one_of(lm_request(), lm_request(), st.binary(max_size=400)), min_size=1, max_size=6
)


def lm_probe(port: int, n: int) -> None:
    """PUT then GET then HEALTH on a fresh connection: the value comes back whole."""
    key = f"probe-{n}"
    payload = n.to_bytes(4, "little") * 300
    put = lm.LmRequest(lm.Command.PUT, len(payload), 1, 2, 0, (1, 2, 3, 4), key)
    get = lm.LmRequest(lm.Command.GET, 0, 0, 0, 0, (0, 0, 0, 0), key)
    health = lm.LmRequest(lm.Command.HEALTH, 0, 0, 0, 0, (0, 0, 0, 0), key)
    with socket.create_connection(("127.0.0.1", port), timeout=REPLY_S) as sock:
        sock.sendall(put.pack() + payload + get.pack())
        reply = lm.parse_reply(_recv(sock, lm.REPLY_SIZE))
        assert reply.code == lm.Code.SUCCESS and reply.length == len(payload), reply
        assert reply.shape == (1, 2, 3, 4)
        assert _recv(sock, len(payload)) == payload
        sock.sendall(health.pack())
        assert lm.parse_reply(_recv(sock, lm.REPLY_SIZE)).code == lm.Code.SUCCESS


def converse(port: int, conversation: list[bytes]) -> None:
    """Send each part on one connection, read whatever comes back, then hang up (maybe
    mid-request). A listener may close the connection on bad input: the rest is not
    sent."""
    with socket.create_connection(("127.0.0.1", port), timeout=REPLY_S) as sock:
        for part in conversation:
            try:
                sock.sendall(part)
            except OSError:
                break
        sock.settimeout(0.05)
        try:
            while sock.recv(65536):
                pass
        except (TimeoutError, ConnectionResetError):
            pass


def _recv(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        assert chunk, f"closed after {len(data)} of {n} bytes"
        data += chunk
    return data


def test_lm_listener_survives_fuzzed_connections(server: CacheServerProcess) -> None:
    assert server.lm_port is not None
    watched = Watched(server)
    n = itertools.count(1)

    def run_batch(conversation: list[bytes]) -> None:
        converse(server.lm_port, conversation)
        lm_probe(server.lm_port, next(n))
        watched.check()

    fuzz_for("cacheserver lm://", lm_conversations, run_batch, FUZZ_SECONDS / 4)


def test_probe_endpoint_answers_every_fuzzed_request(server: CacheServerProcess) -> None:
    assert server.metrics_port is not None
    statuses = fuzz_probe_http(
        "cacheserver metrics", Watched(server), server.metrics_port, FUZZ_SECONDS / 4
    )
    assert statuses.get(200) and statuses.get(404), statuses


@st.composite
def data_request(draw: st.DrawFn) -> bytes:
    """One data-connection request: any op, any key length, some key bytes."""
    op = draw(st.one_of(st.just(data.OP_GET), st.integers(0, 255)))
    length = draw(st.one_of(st.integers(0, 700), st.integers(0, 65535)))
    key = draw(st.one_of(keys, st.text(min_size=1, max_size=60).map(str.encode)))
    return data.REQUEST.pack(op, length) + key[: draw(st.integers(0, length))]


def data_conversations(token: bytes) -> st.SearchStrategy[list[bytes]]:
    preamble = st.one_of(
        st.just(data.PREAMBLE.pack(data.MAGIC, token)),
        st.binary(max_size=40),
        st.binary(min_size=16, max_size=16).map(lambda t: data.PREAMBLE.pack(data.MAGIC, t)),
    )
    body = st.lists(st.one_of(data_request(), st.binary(max_size=300)), max_size=5)
    return st.tuples(preamble, body).map(lambda pb: [pb[0], *pb[1]])


def test_data_listener_survives_fuzzed_connections(server: CacheServerProcess) -> None:
    async def probe_client() -> CacheServerClient:
        client = CacheServerClient(server.endpoint, timeout_s=REPLY_S, data_connections=1)
        await client.connect()
        return client

    loop = asyncio.new_event_loop()
    client = loop.run_until_complete(probe_client())
    hello = loop.run_until_complete(client.hello())
    assert client.data_path and hello.data_port > 0
    token, port = hello.data_token, hello.data_port
    watched = Watched(server)
    n = itertools.count(1)

    async def probe(i: int) -> None:
        value = i.to_bytes(4, "little") * 500
        await client.put(f"data-probe-{i}", value, b"m")
        got = await client.get_into(f"data-probe-{i}", lambda meta, nbytes: None)
        assert got is not None and bytes(got.data) == value and got.meta == b"m"
        assert client.data_path

    def run_batch(conversation: list[bytes]) -> None:
        converse(port, conversation)
        loop.run_until_complete(probe(next(n)))
        watched.check()

    try:
        fuzz_for("cacheserver data", data_conversations(token), run_batch, FUZZ_SECONDS / 4)
    finally:
        loop.run_until_complete(client.close())
        loop.close()

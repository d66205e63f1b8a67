"""The lookup protocol over real ZMQ sockets: codec, server, client, failure modes.

Engines are real (L1 over a small CPU paged cache); sockets are real ipc files in a
per-test directory, or tcp on loopback.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path

import msgspec
import pytest
import torch
import zmq
from kvtest.paged import make_cache

from kvmesh.common.config import EngineConfig, L1Config
from kvmesh.common.protocol import lookup as proto
from kvmesh.services.worker.engine import KVEngine
from kvmesh.services.worker.lookup_client import LookupClient
from kvmesh.services.worker.lookup_server import (
    LookupServer,
    LookupServerError,
    attach_lookup_server,
)

CHUNK = 8
BLOCKS, BLOCK = 16, 4


def make_engine(rank: int = 0, world: int = 1, endpoint: str = "") -> KVEngine:
    view, _, _ = make_cache("cpu", torch.float16, True, blocks=BLOCKS, block_size=BLOCK)
    cfg = EngineConfig(
        chunk_size=CHUNK,
        model_name="test",
        lookup_endpoint=endpoint,
        l1=L1Config(max_size=4 << 20, reserve=0, alloc_timeout_s=0.2),
    )
    return KVEngine("inst", rank, cfg, view, world_size=world)


def prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, 50_000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def slots(n: int) -> torch.Tensor:
    return torch.arange(n)


@pytest.fixture
def ipc_dir(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    # pytest's tmp paths can exceed the 107-byte limit of a socket path: use a short one.
    d = Path(f"/tmp/kvm-t{os.getpid()}-{time.monotonic_ns() % 10**6}")
    d.mkdir(mode=0o700)
    monkeypatch.setenv("KVMESH_IPC_DIR", str(d))
    yield d
    for f in d.iterdir():
        f.unlink()
    d.rmdir()


@pytest.fixture
def served(ipc_dir: Path):
    """One engine with its lookup server on the default ipc endpoint, and a client."""
    eng = make_engine()
    server = attach_lookup_server(eng)
    client = LookupClient([server.endpoint], timeout_s=2.0)
    yield eng, server, client
    client.close()
    eng.close()


def raw_dealer(endpoint: str) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.linger = 0
    sock.rcvtimeo = 3000
    sock.connect(endpoint)
    return sock


# -- codec --------------------------------------------------------------------------------


def test_round_trip_of_every_message() -> None:
    msgs = [
        proto.Hello(1, proto.PROTOCOL_VERSION, "me"),
        proto.LookupPrefix(2, 1, "req-1", proto.encode_tokens([1, 2, 2**32 - 1]), True, "t", 5.0),
        proto.ReleaseLookup(3, 1, "req-1"),
    ]
    for msg in msgs:
        assert proto.decode_request([proto.encode(msg)]) == msg
    replies = [
        proto.HelloReply(1, 1, "inst", 0, 2, 256),
        proto.LookupPrefixReply(2, 512),
        proto.ReleaseLookupReply(3, True),
        proto.ErrorReply(4, 1, "no", False),
    ]
    for reply in replies:
        assert proto.decode_reply(proto.encode(reply)) == reply


def test_tokens_are_little_endian_uint32() -> None:
    data = proto.encode_tokens([1, 256, 2**32 - 1])
    assert data == b"\x01\x00\x00\x00\x00\x01\x00\x00\xff\xff\xff\xff"
    assert list(proto.decode_tokens(data)) == [1, 256, 2**32 - 1]
    with pytest.raises(ValueError):
        proto.encode_tokens([2**32])
    with pytest.raises(ValueError):
        proto.decode_tokens(b"\x00" * 5)


@pytest.mark.parametrize(
    ("frames", "code", "rid"),
    [
        ([b"\xc1"], proto.ErrorCode.BAD_MESSAGE, 0),  # not msgpack
        ([b""], proto.ErrorCode.BAD_MESSAGE, 0),
        ([msgspec.msgpack.encode(["nope", 7, 1])], proto.ErrorCode.UNKNOWN_MESSAGE, 7),
        ([msgspec.msgpack.encode(["lookup", 9, 1, "id"])], proto.ErrorCode.BAD_MESSAGE, 9),
        ([msgspec.msgpack.encode(["lookup", 9, 1, "id", "str"])], proto.ErrorCode.BAD_MESSAGE, 9),
        ([msgspec.msgpack.encode({"a": 1})], proto.ErrorCode.BAD_MESSAGE, 0),
        ([proto.encode(proto.Hello(5, 99))], proto.ErrorCode.VERSION_MISMATCH, 5),
        ([proto.encode(proto.LookupPrefix(6, 1, "x", b"\x00" * 6))], proto.ErrorCode.BAD_TOKENS, 6),
        ([proto.encode(proto.LookupPrefix(6, 1, "", b""))], proto.ErrorCode.BAD_MESSAGE, 6),
        ([proto.encode(proto.LookupPrefix(6, 1, "x" * 300, b""))], proto.ErrorCode.BAD_MESSAGE, 6),
        ([proto.encode(proto.Hello(-1, 1))], proto.ErrorCode.BAD_MESSAGE, 0),
        ([proto.encode(proto.Hello(8, 1)), b"extra"], proto.ErrorCode.BAD_MESSAGE, 8),
        ([], proto.ErrorCode.BAD_MESSAGE, 0),
        # a reply sent as a request
        ([proto.encode(proto.LookupPrefixReply(4, 1))], proto.ErrorCode.UNKNOWN_MESSAGE, 4),
    ],
)
def test_malformed_requests_become_error_replies(frames, code, rid) -> None:
    with pytest.raises(proto.MalformedMessage) as info:
        proto.decode_request(frames)
    assert info.value.reply.code == code
    assert info.value.reply.rid == rid
    assert info.value.reply.message


def test_malformed_reply_is_a_malformed_message() -> None:
    with pytest.raises(proto.MalformedMessage):
        proto.decode_reply(b"\x93\x01")
    with pytest.raises(proto.MalformedMessage):
        proto.decode_reply(proto.encode(proto.Hello(1, 1)))


def test_engine_endpoints(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVMESH_IPC_DIR", "/tmp/kvm-x")
    a0 = proto.engine_endpoint("", "instance-a", 0)
    assert a0.startswith("ipc:///tmp/kvm-x/lk-") and a0.endswith("-0.sock")
    assert proto.engine_endpoint("", "instance-a", 1) == a0[: -len("0.sock")] + "1.sock"
    assert proto.engine_endpoint("", "instance-b", 0) != a0
    assert proto.engine_endpoint("tcp://127.0.0.1:7000", "i", 3) == "tcp://127.0.0.1:7003"
    assert proto.engine_endpoint("tcp://[::1]:7000", "i", 1) == "tcp://[::1]:7001"
    assert proto.engine_endpoint("ipc:///run/k/lk", "i", 2) == "ipc:///run/k/lk-2"
    assert proto.engine_endpoint("tcp://h:{rank}", "i", 0) == "tcp://h:0"
    for bad in ("http://x", "tcp://h", "tcp://h:65535", "ipc:///" + "x" * 120):
        with pytest.raises(ValueError):
            proto.engine_endpoint(bad, "i", 1)
    monkeypatch.setenv("KVMESH_IPC_DIR", "/tmp/" + "d" * 100)
    with pytest.raises(ValueError, match="107 bytes"):
        proto.engine_endpoint("", "i", 0)


# -- server and client ---------------------------------------------------------------------


def test_lookup_counts_and_pins(served) -> None:
    eng, _server, client = served
    p = prompt(30)
    assert eng.store(p, slots(30)) == 24
    assert client.lookup(p, "req-1") == 24
    assert "req-1" in eng.pins
    client.release("req-1")
    deadline = time.monotonic() + 2
    while "req-1" in eng.pins and time.monotonic() < deadline:
        time.sleep(0.01)
    assert "req-1" not in eng.pins
    assert client.lookup(p, "req-2", pin=False) == 24
    assert "req-2" not in eng.pins
    assert client.lookup(prompt(30, seed=1), "req-3") == 0
    assert client.lookup([], "req-4") == 0
    (hello,) = client.hello()
    assert hello == proto.HelloReply(hello.rid, 1, "inst", 0, 1, CHUNK)


def test_tenants_are_isolated(served) -> None:
    eng, _server, client = served
    p = prompt(16)
    assert eng.store(p, slots(16), tenant="acme") == 16
    assert client.lookup(p, "a", tenant="acme") == 16
    assert client.lookup(p, "b", tenant="other") == 0
    assert client.lookup(p, "c") == 0
    assert eng.lookup(p, tenant="acme") == 16
    result = client.lookup_all(p, "d", tenant="bad\ntenant")
    assert result.per_rank == [None] and "error 1" in result.errors[0]


def test_a_lookup_naming_another_worker_is_refused_and_pins_nothing(served) -> None:
    """An asker on an old worker list (the lookup-server while the controller is
    down) may reach an endpoint another worker took over since: that worker must not
    count its own chunks as the named one's."""
    eng, server, _client = served
    p = prompt(8)
    eng.store(p, slots(8))
    tokens = proto.encode_tokens(p)
    sock = raw_dealer(server.endpoint)
    try:
        for rid, (instance, rank) in enumerate([("other", 0), ("inst", 1), ("other", -1)], 1):
            sock.send(
                proto.encode(
                    proto.LookupPrefix(rid, 1, f"w{rid}", tokens, True, "", 0.0, instance, rank)
                )
            )
            reply = proto.decode_reply(sock.recv())
            assert isinstance(reply, proto.ErrorReply), reply
            assert (reply.rid, reply.code) == (rid, proto.ErrorCode.WRONG_WORKER)
            assert f"w{rid}" not in eng.pins
        for rid, (instance, rank) in enumerate([("inst", 0), ("inst", -1), ("", -1)], 10):
            sock.send(
                proto.encode(
                    proto.LookupPrefix(rid, 1, f"r{rid}", tokens, False, "", 0.0, instance, rank)
                )
            )
            assert proto.decode_reply(sock.recv()) == proto.LookupPrefixReply(rid, 8)
    finally:
        sock.close(0)


def test_malformed_frames_get_error_replies_and_the_server_goes_on(served) -> None:
    eng, server, client = served
    sock = raw_dealer(server.endpoint)
    try:
        sock.send(b"garbage")
        reply = proto.decode_reply(sock.recv())
        assert isinstance(reply, proto.ErrorReply)
        assert reply.code == proto.ErrorCode.BAD_MESSAGE
        sock.send_multipart([proto.encode(proto.Hello(3, 1)), b"x"])
        reply = proto.decode_reply(sock.recv())
        assert (reply.rid, reply.code) == (3, proto.ErrorCode.BAD_MESSAGE)
        sock.send(proto.encode(proto.Hello(4, 2)))
        reply = proto.decode_reply(sock.recv())
        assert (reply.rid, reply.code) == (4, proto.ErrorCode.VERSION_MISMATCH)
        sock.send(proto.encode(proto.LookupPrefix(5, 1, "id", b"\x01\x02\x03")))
        reply = proto.decode_reply(sock.recv())
        assert (reply.rid, reply.code) == (5, proto.ErrorCode.BAD_TOKENS)
        sock.send(proto.encode(proto.LookupPrefix(6, 1, "id", b"", deadline=time.time() - 1)))
        reply = proto.decode_reply(sock.recv())
        assert (reply.rid, reply.code, reply.retryable) == (
            6,
            proto.ErrorCode.DEADLINE_EXCEEDED,
            True,
        )
        assert "id" not in eng.pins
    finally:
        sock.close(0)
    p = prompt(8)
    eng.store(p, slots(8))
    assert client.lookup(p, "after") == 8
    errors = eng.stats.metrics.value("lookup_server_errors_total", {"code": "bad_message"})
    assert errors == 2


def test_a_frame_over_the_limit_costs_only_its_connection(served) -> None:
    """A frame beyond MAX_MESSAGE_BYTES is never buffered in the engine's process: its
    connection is dropped unanswered, and the server goes on (found by tests/fuzz)."""
    eng, server, client = served
    sock = raw_dealer(server.endpoint)
    try:
        huge = b"\x00" * (proto.MAX_MESSAGE_BYTES + 4)
        sock.send(proto.encode(proto.LookupPrefix(7, 1, "id", huge)))
        with pytest.raises(zmq.Again):
            sock.recv()  # no BAD_TOKENS reply: it was never read
    finally:
        sock.close(0)
    p = prompt(8)
    eng.store(p, slots(8))
    assert client.lookup(p, "after-huge") == 8


def test_a_busy_server_reads_few_requests_ahead_and_answers_each(served) -> None:
    """While a lookup runs, a peer's next requests wait in the peer's process, not in the
    engine's (RCVHWM): its sends stop being taken; every request it sent is answered."""
    eng, server, _client = served
    go = threading.Event()
    lookup = eng.lookup

    def busy(*args, **kw):
        go.wait(10)
        return lookup(*args, **kw)

    eng.lookup = busy
    sock = raw_dealer(server.endpoint)
    sock.setsockopt(zmq.SNDHWM, 1)
    tokens = proto.encode_tokens(range(1 << 18))  # 1 MiB
    sent = 0
    try:
        while sent < 64:
            try:
                sock.send(
                    proto.encode(proto.LookupPrefix(sent + 1, 1, "id", tokens, False)), zmq.NOBLOCK
                )
            except zmq.Again:
                if not sock.poll(300, zmq.POLLOUT):
                    break
                continue
            sent += 1
        assert sent < 32
        go.set()
        rids = {proto.decode_reply(sock.recv()).rid for _ in range(sent)}
        assert rids == set(range(1, sent + 1))
    finally:
        go.set()
        sock.close(0)


def test_dead_peer_is_zero_hits_within_the_deadline(ipc_dir: Path) -> None:
    missing = f"ipc://{ipc_dir}/nobody.sock"
    with LookupClient([missing], timeout_s=0.2) as client:
        t0 = time.monotonic()
        assert client.lookup(prompt(16), "r") == 0
        assert time.monotonic() - t0 < 1.0  # 0.2 s deadline, slack for a busy machine
        result = client.lookup_all(prompt(16), "r")
        assert result.per_rank == [None] and "no reply" in result.errors[0]


def test_silent_peer_is_zero_hits_within_the_deadline(ipc_dir: Path) -> None:
    """A peer that accepts the connection but never answers (a hung engine)."""
    ctx = zmq.Context.instance()
    mute = ctx.socket(zmq.ROUTER)
    mute.linger = 0
    endpoint = f"ipc://{ipc_dir}/mute.sock"
    mute.bind(endpoint)
    try:
        with LookupClient([endpoint], timeout_s=0.3) as client:
            t0 = time.monotonic()
            assert client.lookup(prompt(16), "r") == 0
            elapsed = time.monotonic() - t0
            assert 0.25 < elapsed < 1.5
    finally:
        mute.close(0)


def test_minimum_across_two_ranks_and_one_rank_down(ipc_dir: Path) -> None:
    ranks = [make_engine(rank, world=2) for rank in range(2)]
    servers = [attach_lookup_server(e) for e in ranks]
    p = prompt(32)
    ranks[0].store(p, slots(32))  # 4 chunks
    ranks[1].store(p[:16], slots(16))  # 2 chunks
    client = LookupClient.for_instance("inst", 2, timeout_s=0.5)
    try:
        assert client.endpoints == [s.endpoint for s in servers]
        assert client.lookup_all(p, "r").per_rank == [32, 16]
        assert client.lookup(p, "r") == 16
        assert "r" in ranks[0].pins and "r" in ranks[1].pins
        ranks[1].close()  # rank 1 goes away: the instance can load nothing
        t0 = time.monotonic()
        assert client.lookup(p, "r2") == 0
        assert time.monotonic() - t0 < 1.0
        # the rank that answered had its useless pins released
        deadline = time.monotonic() + 2
        while "r2" in ranks[0].pins and time.monotonic() < deadline:
            time.sleep(0.01)
        assert "r2" not in ranks[0].pins
    finally:
        client.close()
        for e in ranks:
            e.close()


def test_late_replies_are_not_taken_for_new_ones(ipc_dir: Path) -> None:
    """A reply that comes after its deadline must not answer the next request."""
    ctx = zmq.Context.instance()
    slow = ctx.socket(zmq.ROUTER)
    slow.linger = 0
    endpoint = f"ipc://{ipc_dir}/slow.sock"
    slow.bind(endpoint)
    try:
        with LookupClient([endpoint], timeout_s=0.2) as client:
            assert client.lookup(prompt(8), "a", pin=False) == 0
            ident, frame = slow.recv_multipart()
            first = proto.decode_request([frame])
            slow.send_multipart([ident, proto.encode(proto.LookupPrefixReply(first.rid, 999))])
            time.sleep(0.05)
            # The next request sees the stale reply first and must skip it.
            assert client.lookup(prompt(8), "b", pin=False) == 0
            ident, frame = slow.recv_multipart()
            second = proto.decode_request([frame])
            assert second.rid != first.rid
    finally:
        slow.close(0)


def test_close_stops_the_server_and_removes_the_socket(ipc_dir: Path) -> None:
    eng = make_engine()
    server = attach_lookup_server(eng)
    path = Path(server.endpoint[len("ipc://") :])
    assert path.exists()
    eng.close()
    assert not path.exists()
    with LookupClient([server.endpoint], timeout_s=0.2) as client:
        assert client.lookup(prompt(8), "r") == 0


def test_second_server_on_a_live_endpoint_is_refused(served) -> None:
    _eng, server, client = served
    other = make_engine()
    try:
        with pytest.raises(LookupServerError, match="another live process"):
            LookupServer(other, server.endpoint).start()
    finally:
        other.close()
    assert client.lookup([], "still-up") == 0
    assert client.hello()[0] is not None


def test_stale_socket_file_is_replaced(ipc_dir: Path) -> None:
    """A socket file left by a crashed process does not block a new engine."""
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    endpoint = proto.engine_endpoint("", "inst", 0)
    stale.bind(endpoint[len("ipc://") :])
    stale.close()  # the file stays, nobody listens
    eng = make_engine()
    try:
        server = attach_lookup_server(eng)
        with LookupClient([server.endpoint]) as client:
            assert client.hello()[0] is not None
    finally:
        eng.close()


def test_tcp_endpoint_with_rank_offset() -> None:
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    eng = make_engine(endpoint=f"tcp://127.0.0.1:{port}")
    try:
        server = attach_lookup_server(eng)
        assert server.endpoint == f"tcp://127.0.0.1:{port}"
        p = prompt(16)
        eng.store(p, slots(16))
        with LookupClient.for_instance("inst", 1, f"tcp://127.0.0.1:{port}") as client:
            assert client.lookup(p, "r") == 16
    finally:
        eng.close()

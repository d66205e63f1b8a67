"""The P2P tier across real processes: three engines, one in its own network namespace.

A chunk stored on A is read by B from A's L1 (bitwise equal), over NIXL and over the
ZMQ channel; C then reads it from B (which promoted it to its L1). A killed peer, a
corrupted chunk and garbage sent to the peer server are misses or error replies, never
wrong KV, a hang past the deadline, or a dead server.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import zmq
from kvtest.netns import veth_namespace
from kvtest.service_process import KvtestProcess, free_port

from kvmesh.common.protocol import p2p as proto

NS_IP, HOST_IP = "10.231.{}.2", "10.231.{}.1"


class NodeProcess(KvtestProcess):
    """`python -m kvtest.p2p` (one engine), optionally inside a network namespace.
    Launched here, waited for by ready(): a test brings its nodes up together."""

    def __init__(self, tmp: Path, netns: str | None = None, **cfg) -> None:
        super().__init__(
            f"node {cfg.get('name', 'x')}",
            "p2p",
            [json.dumps(cfg)],
            log=tmp / f"node-{cfg.get('name', 'x')}.log",
            ready_line="{",
            prefix=["ip", "netns", "exec", netns] if netns is not None else [],
        )
        self.info: dict | None = None
        self.launch()

    def ready(self, timeout: float = 30.0) -> dict:
        self.info = self.wait_ready(timeout)
        assert "error" not in self.info, self.info
        return self.info

    @property
    def endpoint(self) -> str:
        assert self.info is not None
        return self.info["endpoint"]


@pytest.fixture
def netns() -> Iterator[tuple[str, str]]:
    """A network namespace joined to this one by a veth pair: (name, its address)."""
    with veth_namespace("kvp2p", HOST_IP, NS_IP, 24) as ns:
        yield ns


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[list[NodeProcess]]:
    started: list[NodeProcess] = []

    def start(*specs: dict) -> list[NodeProcess]:
        procs = [NodeProcess(tmp_path, **spec) for spec in specs]
        started.extend(procs)
        for p in procs:
            p.ready()
        return procs

    yield start  # type: ignore[misc]
    for p in started:
        p.stop()


@pytest.mark.parametrize("channel", ["nixl", "zmq"])
def test_chunk_stored_on_a_is_read_by_b_from_a_memory_then_by_c_from_b(
    nodes, netns, channel: str
) -> None:
    ns, ns_ip = netns
    a, b, c = nodes(
        {"name": "a", "seed": 1, "channel": channel, "netns": ns, "host": ns_ip},
        {"name": "b", "channel": channel},
        {"name": "c", "channel": channel},
    )
    for node in (a, b, c):
        assert node.info["channel"] == channel
        assert node.info["tiers"][:2] == ["l1", "p2p"]
    assert a.endpoint.startswith(f"tcp://{ns_ip}:")
    stored = a(op="store", seed=7, n=80)
    assert stored["stored"] == 80 and len(stored["keys"]) == 5
    b(op="locate", keys=stored["keys"], endpoint=a.endpoint)
    got = b(op="retrieve", seed=7, n=80)
    assert got["lookup"] == 80 and got["loaded"] == 80
    assert got["kv"] == stored["kv"]  # bitwise: the raw bytes of every slot
    assert got["p2p_tokens"] == 80 and got["gets"]["hit"] == 5
    # B promoted the chunks to its L1: C reads them from B, and A is not asked.
    c(op="locate", keys=stored["keys"], endpoint=b.endpoint)
    a.kill()
    got_c = c(op="retrieve", seed=7, n=80)
    assert got_c["loaded"] == 80 and got_c["kv"] == stored["kv"]
    # A second retrieve on B is served by its own L1.
    again = b(op="retrieve", seed=7, n=80)
    assert again["loaded"] == 80 and again["p2p_tokens"] == 80


@pytest.mark.parametrize("channel", ["nixl", "zmq"])
def test_killed_peer_is_a_miss_within_the_deadline(nodes, channel: str) -> None:
    a, b = nodes(
        {"name": "a", "seed": 2, "channel": channel},
        {"name": "b", "channel": channel, "timeout_s": 0.5},
    )
    first = a(op="store", seed=1, n=32)
    second = a(op="store", seed=2, n=32)
    b(op="locate", keys=first["keys"] + second["keys"], endpoint=a.endpoint)
    assert b(op="retrieve", seed=1, n=32)["loaded"] == 32  # connection and agent known
    a.kill()
    t0 = time.monotonic()
    got = b(op="retrieve", seed=2, n=32)
    assert got["loaded"] == 0 and got["gets"]["error"] >= 2
    # A killed peer does not answer: each chunk asked of it ran into the deadline.
    assert got["misses"]["timeout"] == got["gets"]["error"], got["misses"]
    # lookup (locator: instant) + one read bounded by timeout_s = 0.5, plus slack.
    assert time.monotonic() - t0 < 2.5


@pytest.mark.parametrize("channel", ["nixl", "zmq"])
def test_a_peer_restarted_behind_its_endpoint_is_read_from_at_the_first_try(
    nodes, channel: str
) -> None:
    """Killed while idle, so no read failed: the reader's connection reconnects by
    itself to the new process. Its pin reply names its NIXL agent, so the reader hellos
    it before the READ (not into the dead agent, a miss) and unloads the old one."""
    port = free_port()
    (a,) = nodes({"name": "a", "seed": 1, "channel": channel, "port": port})
    (b,) = nodes({"name": "b", "channel": channel})
    keys = a(op="store", seed=1, n=32)["keys"]
    b(op="locate", keys=keys, endpoint=a.endpoint)
    assert b(op="retrieve", seed=1, n=32)["loaded"] == 32  # hello'd, agent loaded
    if channel == "nixl":
        assert b(op="agent_loaded", agent=a.info["agent"])["loaded"] is True
    b(op="clear")
    a.kill()
    (a2,) = nodes({"name": "a2", "seed": 1, "channel": channel, "port": port})
    assert a2.endpoint == a.endpoint
    stored = a2(op="store", seed=1, n=32)
    assert stored["keys"] == keys
    got = b(op="retrieve", seed=1, n=32)
    assert got["loaded"] == 32 and got["kv"] == stored["kv"], got["misses"]
    assert got["gets"]["error"] == 0, got["misses"]
    assert got["agents_retired"] == (1 if channel == "nixl" else 0)
    if channel == "nixl":  # the dead process's agent is unloaded, the new one is not
        assert b(op="agent_loaded", agent=a.info["agent"])["loaded"] is False
        assert b(op="agent_loaded", agent=a2.info["agent"])["loaded"] is True


def read_from_a_with_c_beside(nodes):
    """Peers a and c over NIXL, each with a prompt located by reader b (peer_idle_s
    1.5 s), which has read a's: (a, c, b, what a stored)."""
    a, c = nodes(
        {"name": "a", "seed": 1, "channel": "nixl"}, {"name": "c", "seed": 2, "channel": "nixl"}
    )
    (b,) = nodes({"name": "b", "channel": "nixl", "peer_idle_s": 1.5})
    from_a = a(op="store", seed=1, n=32)
    from_c = c(op="store", seed=2, n=32)
    b(op="locate", keys=from_a["keys"], endpoint=a.endpoint)
    b(op="locate", keys=from_c["keys"], endpoint=c.endpoint)
    assert b(op="retrieve", seed=1, n=32)["loaded"] == 32
    return a, c, b, from_a


def assert_let_go_after_idle(a, c, b) -> None:
    """Past b's peer_idle_s, reading from c lets a's NIXL agent go and keeps c's."""
    time.sleep(2.0)
    got = b(op="retrieve", seed=2, n=32)  # using another peer is when idle ones go
    assert got["loaded"] == 32 and got["agents_retired"] == 1
    assert b(op="agent_loaded", agent=a.info["agent"])["loaded"] is False
    assert b(op="agent_loaded", agent=c.info["agent"])["loaded"] is True


def test_a_peer_unused_for_peer_idle_s_is_let_go_and_greeted_again_at_next_use(nodes) -> None:
    """Peers come and go under new addresses (pods replaced): the connection and NIXL
    agent of one unused for `peer_idle_s` are let go, so they do not pile up; reading
    from it again later hellos it afresh."""
    a, c, b, from_a = read_from_a_with_c_beside(nodes)
    assert b(op="agent_loaded", agent=a.info["agent"])["loaded"] is True
    assert_let_go_after_idle(a, c, b)
    b(op="clear")
    again = b(op="retrieve", seed=1, n=32)
    assert again["loaded"] == 32 and again["kv"] == from_a["kv"]
    assert again["gets"]["error"] == 0, again["misses"]
    assert b(op="agent_loaded", agent=a.info["agent"])["loaded"] is True


def test_a_peer_that_died_while_read_is_let_go_after_peer_idle_s_too(nodes) -> None:
    """A failed read drops the peer's connection, so the idle sweep, which walked only
    live connections, never saw it: the dead peer's NIXL agent stayed loaded for the
    reader's life, one per peer that died while read (pods replaced under new
    addresses)."""
    a, c, b, _ = read_from_a_with_c_beside(nodes)
    a.kill()
    b(op="clear")
    assert b(op="retrieve", seed=1, n=32)["loaded"] == 0  # its connection dropped
    assert b(op="agent_loaded", agent=a.info["agent"])["loaded"] is True
    assert_let_go_after_idle(a, c, b)


@pytest.mark.parametrize("channel", ["nixl", "zmq"])
def test_corrupted_chunk_is_a_miss(nodes, channel: str) -> None:
    a, b = nodes({"name": "a", "seed": 3, "channel": channel}, {"name": "b", "channel": channel})
    stored = a(op="store", seed=3, n=48)
    assert a(op="corrupt")["corrupted"] == 3
    b(op="locate", keys=stored["keys"], endpoint=a.endpoint)
    got = b(op="retrieve", seed=3, n=48)
    assert got["loaded"] == 0 and got["p2p_tokens"] == 0
    assert got["gets"]["corrupt"] == 3 and got["gets"]["hit"] == 0
    assert got["misses"]["checksum"] == 3 and sum(got["misses"].values()) == 3
    if channel == "nixl":  # leases were released after the read
        assert a(op="leases")["leases"] == 0


def test_bad_messages_get_error_replies_and_the_server_keeps_serving(nodes) -> None:
    a, b = nodes({"name": "a", "seed": 4, "channel": "nixl"}, {"name": "b", "channel": "nixl"})
    stored = a(op="store", seed=4, n=32)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.rcvtimeo = 3000
    sock.connect(a.endpoint)
    enc = msgspec.msgpack.encode
    cases = [
        ([b"\xc1garbage"], proto.ErrorCode.BAD_MESSAGE),
        ([proto.encode(proto.Hello(5, 1))[:-2]], proto.ErrorCode.BAD_MESSAGE),  # truncated
        ([enc(["launch", 6, 1])], proto.ErrorCode.UNKNOWN_MESSAGE),
        ([proto.encode(proto.Hello(7, 99))], proto.ErrorCode.VERSION_MISMATCH),
        ([proto.encode(proto.Hello(8, 1)), b"extra"], proto.ErrorCode.BAD_MESSAGE),
        ([enc(["read", 9, 1, ["../../etc/passwd"], 0.0])], proto.ErrorCode.BAD_KEY),
        ([enc(["read", 10, 1, "not-a-list"])], proto.ErrorCode.BAD_MESSAGE),
        ([enc(["pin", 11, 1, ["x" * 100], 0.0])], proto.ErrorCode.BAD_KEY),
    ]
    try:
        for frames, code in cases:
            sock.send_multipart(frames)
            reply = proto.decode_reply(sock.recv_multipart())
            assert isinstance(reply, proto.ErrorReply), (frames, reply)
            assert reply.code == code, (frames, reply)
        assert reply.rid == 0 or reply.rid == 11
        sock.send(proto.encode(proto.Hello(12, proto.PROTOCOL_VERSION)))
        hello = proto.decode_reply(sock.recv_multipart())
        assert isinstance(hello, proto.HelloReply) and hello.agent and hello.rid == 12
        # A read of a key A lacks is an empty answer, not an error.
        missing = stored["keys"][0][:-4] + "0000"
        sock.send(proto.encode(proto.ReadChunks(13, 1, [missing, stored["keys"][1]])))
        frames = sock.recv_multipart()
        reply = proto.decode_reply(frames)
        assert isinstance(reply, proto.ReadChunksReply)
        assert [m.key for m in reply.chunks] == [stored["keys"][1]] and len(frames) == 2
    finally:
        sock.close(0)
        ctx.term()
    b(op="locate", keys=stored["keys"], endpoint=a.endpoint)
    got = b(op="retrieve", seed=4, n=32)
    assert got["loaded"] == 32 and got["kv"] == stored["kv"]


def test_a_frame_larger_than_l1_costs_only_its_connection(nodes) -> None:
    """No valid P2P frame is larger than the engine's whole L1 (32 MiB here): a bigger
    one drops its connection unanswered instead of being buffered in the engine's
    process, and the server goes on (found while fuzzing, tests/fuzz)."""
    [a] = nodes({"name": "a", "seed": 5})
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.linger = 0
        sock.rcvtimeo = 3000
        sock.connect(a.endpoint)
        push = proto.PushChunks(1, proto.PROTOCOL_VERSION, 1, -1, [0])
        sock.send_multipart([proto.encode(push), b"\x00" * (40 << 20)])
        with pytest.raises(zmq.Again):
            sock.recv_multipart()  # no error reply: it was never read
        sock = ctx.socket(zmq.DEALER)
        sock.linger = 0
        sock.rcvtimeo = 10_000
        sock.connect(a.endpoint)
        sock.send(proto.encode(proto.Hello(2, proto.PROTOCOL_VERSION)))
        assert isinstance(proto.decode_reply(sock.recv_multipart()), proto.HelloReply)
    finally:
        ctx.destroy(linger=0)  # closes the sockets too, also after a failed assert


def test_a_chunk_the_peer_no_longer_holds_is_an_evicted_miss(nodes) -> None:
    a, b = nodes({"name": "a", "seed": 4, "channel": "zmq"}, {"name": "b", "channel": "zmq"})
    stored = a(op="store", seed=4, n=48)
    b(op="locate", keys=stored["keys"], endpoint=a.endpoint)  # the registry's stale answer
    assert a(op="clear")["cleared"] == 3
    got = b(op="retrieve", seed=4, n=48)
    assert got["loaded"] == 0
    assert got["misses"]["evicted"] == 3 and sum(got["misses"].values()) == 3

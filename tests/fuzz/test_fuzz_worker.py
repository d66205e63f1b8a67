"""Fuzz a worker engine's P2P endpoint (common/protocol/p2p.py: peer reads and pins, PD
receive: services/worker/p2p_server.py, pd_receiver.py) and its metrics port, on a real
engine in its own process (fuzz_engine.py) that holds a 4-chunk prompt and receives PD
pushes. After each batch the engine is alive, logged no traceback, kept its RSS
bounded, serves a held chunk whose bytes match their checksum, and takes a whole PD
transfer (alloc, push, commit) of a new chunk."""

from __future__ import annotations

import itertools
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import xxhash
import zmq
from fuzzkit import FUZZ_SECONDS, REPLY_S, Watched, ZmqTarget, fuzz_for, fuzz_probe_http
from kvtest.service_process import QUIET_LOGS, TESTS, ServiceProcess, free_port

from kvmesh.common.protocol import p2p as proto

V = proto.PROTOCOL_VERSION
CHUNK_TOKENS = 16  # kvtest.p2p's chunk size


def exchange(sock: zmq.Socket, msg: Any, *frames: bytes) -> Any:
    """Send one request on sock and return its reply (decoded)."""
    sock.send_multipart([proto.encode(msg), *frames])
    assert sock.poll(REPLY_S * 1000), f"no answer to {msg} in {REPLY_S}s"
    reply = proto.codec.decode_reply(sock.recv_multipart()[0])
    assert reply.rid == msg.rid, reply
    return reply


class EngineProcess(ServiceProcess):
    def __init__(self, workdir: Path) -> None:
        self.metrics_port = free_port()
        pythonpath = os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH")) if p)
        super().__init__(
            "engine",
            [
                sys.executable, str(Path(__file__).with_name("fuzz_engine.py")),
                str(self.metrics_port), f"tcp://127.0.0.1:{free_port()}",
            ],
            log=workdir / "engine.log",
            cwd=TESTS,
            env={**QUIET_LOGS, "PYTHONPATH": pythonpath},
            ready_line='{"p2p"',
            stdin=True,
            ready_timeout_s=60.0,
            stop_grace_s=20.0,
        )  # fmt: skip


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    with EngineProcess(tmp_path_factory.mktemp("fuzz-engine")) as proc:
        yield proc


def test_p2p_endpoint_answers_every_fuzzed_message(engine: EngineProcess) -> None:
    target = ZmqTarget(engine.ready_info["p2p"], proto, proto.Request)
    watched = Watched(engine)
    keys = engine.ready_info["keys"]
    namespace = keys[0].split("-")[0]
    rid = itertools.count(1)

    def read_first() -> tuple[proto.ChunkMeta, bytes]:
        reply, *frames = target.call(proto.ReadChunks(next(rid), V, keys[:1]))
        assert isinstance(reply, proto.ReadChunksReply) and len(reply.chunks) == 1, reply
        meta, data = reply.chunks[0], frames[0]
        assert meta.key == keys[0] and xxhash.xxh3_64_intdigest(data) == meta.checksum
        return meta, data

    def pd_transfer(meta: proto.ChunkMeta, data: bytes) -> None:
        n = next(rid)
        key = f"{namespace}-{n:032x}"  # a chunk the engine does not hold
        # One connection for the whole transfer: the allocation belongs to it.
        sock = target.socket()
        try:
            msg = proto.AllocChunks(
                n, V, f"probe-{n}", [key], meta.shape, meta.dtype, meta.fmt, CHUNK_TOKENS
            )
            alloc = exchange(sock, msg)
            assert isinstance(alloc, proto.AllocChunksReply), alloc
            pushed = exchange(sock, proto.PushChunks(next(rid), V, alloc.alloc_id, -1, [0]), data)
            assert isinstance(pushed, proto.PushChunksReply), pushed
            checksum = xxhash.xxh3_64_intdigest(data)
            done = exchange(sock, proto.CommitChunks(next(rid), V, alloc.alloc_id, [checksum]))
            assert isinstance(done, proto.CommitChunksReply) and done.committed == 1, done
        finally:
            sock.close(0)

    def run_batch(batch: list) -> None:
        target.send_batch(batch)
        pd_transfer(*read_first())
        watched.check()

    try:
        batches = fuzz_for("worker p2p", target.batches(), run_batch, FUZZ_SECONDS * 3 / 4)
    finally:
        target.close()
    assert batches > 0 and target.errors > 0


def test_metrics_port_answers_every_fuzzed_request(engine: EngineProcess) -> None:
    statuses = fuzz_probe_http(
        "worker metrics",
        Watched(engine),
        engine.metrics_port,
        FUZZ_SECONDS / 4,
        healthy=lambda status, body: status == 200 and b'"status"' in body,
    )
    assert statuses.get(200), statuses

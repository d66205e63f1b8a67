"""The controller's HTTP admin API against what HTTP clients really send: chunked
bodies, bodies nested too deep for json, encoded bodies, and clients that never read
their answer. An in-process controller, real sockets."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import struct
from collections.abc import AsyncIterator

import pytest
import zmq
import zmq.asyncio

from kvmesh.common.config import ControllerConfig
from kvmesh.common.protocol import controller as proto
from kvmesh.services.controller import http
from kvmesh.services.controller.http import AdminHttp
from kvmesh.services.controller.server import ControllerServer

NS = "00000000000000aa"


@pytest.fixture
async def controller() -> AsyncIterator[ControllerServer]:
    srv = ControllerServer(ControllerConfig(port=0, admin_timeout_s=1.0))
    await srv.start()
    srv.http = AdminHttp(srv, "127.0.0.1")
    await srv.http.start(0)
    try:
        yield srv
    finally:
        await srv.stop()


async def request(srv: ControllerServer, raw: bytes) -> tuple[int, bytes]:
    """One raw request (it must say `Connection: close`); the status and body."""
    assert srv.http is not None
    r, w = await asyncio.open_connection("127.0.0.1", srv.http.port)
    try:
        w.write(raw)
        data = await asyncio.wait_for(r.read(), 5)
    finally:
        w.close()
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


async def test_chunked_clear_for_one_instance_clears_only_it(
    controller: ControllerServer,
) -> None:
    ctx = zmq.asyncio.Context()
    workers = {}
    try:
        for inst in ("a", "b"):
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(f"tcp://127.0.0.1:{controller.port}")
            await s.send(proto.encode(proto.Hello(1, proto.PROTOCOL_VERSION, inst)))
            await s.recv()
            await s.send(proto.encode(proto.Register(2, inst, 0, 1, [NS], "", 10.0)))
            await s.recv()
            workers[inst] = s

        async def answer(inst: str) -> str | None:
            s = workers[inst]
            if not await s.poll(1500):
                return None
            cmd = proto.decode_reply(await s.recv())
            await s.send(proto.encode(proto.CommandReply(cmd.rid, f"{inst}/0", True, 5)))
            return cmd.op

        body = b'{"instance_id": "a"}'
        raw = (
            b"POST /clear HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
            b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
            + b"%x\r\n" % len(body)
            + body
            + b"\r\n0\r\n\r\n"
        )
        (status, out), got_a, got_b = await asyncio.gather(
            request(controller, raw), answer("a"), answer("b")
        )
        assert (got_a, got_b) == ("clear", None)
        assert status == 200
        assert [r["worker_id"] for r in json.loads(out)["results"]] == ["a/0"]
    finally:
        for s in workers.values():
            s.close()
        ctx.term()


async def test_deeply_nested_json_body_is_a_400(controller: ControllerServer) -> None:
    body = b"[" * 100_000 + b"]" * 100_000
    raw = (
        b"POST /clear HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
        b"Content-Length: %d\r\n\r\n" % len(body) + body
    )
    status, out = await request(controller, raw)
    assert status == 400
    assert "not JSON" in json.loads(out)["error"]


async def test_encoded_body_is_refused_not_read_as_empty(controller: ControllerServer) -> None:
    body = b"\x1f\x8b not really gzip"
    raw = (
        b"POST /clear HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Encoding: gzip\r\n"
        b"Content-Length: %d\r\n\r\n" % len(body) + body
    )
    status, _ = await request(controller, raw)
    assert status == 415


async def test_client_that_never_reads_a_large_answer_is_cut_off(
    controller: ControllerServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(http, "WRITE_TIMEOUT_S", 0.5)
    monkeypatch.setattr(http, "WRITE_MIN_RATE", 1 << 30)
    for i in range(500):  # /workers: ~4 MB, far over the socket buffers
        controller.registry.register(
            f"instance-{i:05d}", 0, 1, [NS], "tcp://10.0.0.1:5555/" + "x" * 8000, 1000.0, b"p%d" % i
        )
    assert controller.http is not None
    clients = []
    for _ in range(3):
        c = socket.socket()
        c.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        c.connect(("127.0.0.1", controller.http.port))
        c.sendall(b"GET /workers HTTP/1.1\r\nHost: x\r\n\r\n")
        clients.append(c)  # never read
    try:

        def handlers() -> list[asyncio.Task]:
            return [t for t in asyncio.all_tasks() if "_handle" in repr(t.get_coro())]

        await asyncio.sleep(0.3)
        for _ in range(50):
            if not handlers():
                break
            await asyncio.sleep(0.1)
        assert handlers() == []
        # The server cut the connection: reading what arrived ends early, not after ~4 MB.
        c = clients[0]
        c.setblocking(False)
        got = 0
        loop = asyncio.get_running_loop()
        with pytest.raises(ConnectionResetError):
            async with asyncio.timeout(5):
                while chunk := await loop.sock_recv(c, 1 << 16):
                    got += len(chunk)
                raise ConnectionResetError  # an orderly close counts too
        assert got < 4_000_000
    finally:
        for c in clients:
            c.close()


async def test_a_client_that_hangs_up_mid_body_is_not_logged_as_an_error(
    controller: ControllerServer, caplog: pytest.LogCaptureFixture
) -> None:
    """A client reset half-way through its body (a scraper killed, a fuzzer) leaves no
    one to answer: it is not the controller's error (aiohttp logged it with a
    traceback), and the API goes on answering."""
    assert controller.http is not None
    _, w = await asyncio.open_connection("127.0.0.1", controller.http.port)
    w.write(b"POST /clear HTTP/1.1\r\nHost: c\r\nContent-Length: 1000\r\n\r\n" + b'{"inst')
    await w.drain()
    await asyncio.sleep(0.2)  # the handler is reading the body
    w.get_extra_info("socket").setsockopt(
        socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
    )  # a reset, not a FIN
    w.close()
    await asyncio.sleep(0.3)
    assert [rec.getMessage() for rec in caplog.records if rec.levelno >= logging.ERROR] == []
    status, _ = await request(
        controller, b"GET /health HTTP/1.1\r\nHost: c\r\nConnection: close\r\n\r\n"
    )
    assert status == 200


async def test_head_answers_like_get_without_a_body(controller: ControllerServer) -> None:
    """HEAD of the read-only paths, as docs/operations.md promises of every process
    (load balancers and uptime checkers probe with it); other methods stay refused."""
    for path in ("/health", "/healthz", "/metrics", "/workers"):
        raw = f"HEAD {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode()
        status, body = await request(controller, raw)
        assert (status, body) == (200, b""), path
    status, _ = await request(
        controller, b"PUT /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    assert status == 405

"""The cache-server's lm:// listener: LMCache 0.5.6's own client (run from its separate
venv) stores and reads back chunks; our raw client checks every command, the
one-write replies (no Nagle stall) and bad input (the connection closes, other clients
go on)."""

from __future__ import annotations

import os
import socket
import struct
import time

import pytest
from kvtest.lm_conn import LmConnection
from kvtest.remote import CacheServerProcess, run_lmcache_client

from kvmesh.common.protocol import lmcache_lm as lm

MiB = 1 << 20


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = CacheServerProcess(
        tmp_path_factory.mktemp("lm"), lm=True, **{"max-value-size": "8MiB"}
    ).start()
    yield srv
    assert srv.stop() == 0, srv.log.read_text()[-2000:]


class LmClient(LmConnection):
    def send(self, command: int, key: str, payload: bytes = b"", shape=(0, 0, 0, 0)) -> None:
        req = lm.LmRequest(command, len(payload), 1, 2, 1, shape, key)
        self.sock.sendall(req.pack() + payload)

    def reply(self) -> lm.LmReply:
        return lm.parse_reply(self.recv_exact(lm.REPLY_SIZE))

    def get(self, key: str) -> tuple[lm.LmReply, bytes]:
        self.send(lm.Command.GET, key)
        head = self.reply()
        return head, self.recv_exact(head.length) if head.code == 200 else b""


def test_every_command(server) -> None:
    c = LmClient(server.lm_port)
    try:
        value = os.urandom(MiB)
        c.send(lm.Command.PUT, "m@1@0@abc@half", value, shape=(2, 2, 256, 512))
        c.send(lm.Command.EXIST, "m@1@0@abc@half")
        assert c.reply().code == 200
        c.send(lm.Command.EXIST, "m@1@0@nope@half")
        assert c.reply().code == 400
        head, body = c.get("m@1@0@abc@half")
        assert (head.code, head.length, head.shape, head.location) == (
            200,
            MiB,
            (2, 2, 256, 512),
            1,
        )
        assert body == value
        head, body = c.get("m@1@0@nope@half")
        assert (head.code, head.length, body) == (400, 0, b"")
        c.send(lm.Command.HEALTH, "h")
        assert c.reply().code == 200
        c.send(lm.Command.LIST, "l")
        assert c.reply().code == 400  # not served (LMCache's own server never answers)
    finally:
        c.close()


def test_small_gets_do_not_stall(server) -> None:
    """Nagle plus delayed ACK costs ~44 ms per reply sent in two writes; ours is one."""
    c = LmClient(server.lm_port)
    try:
        c.send(lm.Command.PUT, "small", os.urandom(16 * 1024))
        times = []
        for _ in range(50):
            t0 = time.perf_counter()
            head, _ = c.get("small")
            times.append(time.perf_counter() - t0)
            assert head.code == 200
        times.sort()
        assert times[len(times) // 2] < 0.01 and times[-3] < 0.03, times
    finally:
        c.close()


@pytest.mark.parametrize(
    "bad",
    [
        "random",
        "unknown-command",
        "negative-length",
        "truncated-payload",
        "truncated-header",
    ],
)
def test_bad_input_closes_only_that_connection(server, bad: str) -> None:
    good = LmClient(server.lm_port)
    evil = LmClient(server.lm_port)
    try:
        good.send(lm.Command.PUT, "kept", b"v" * 100)
        if bad == "random":
            evil.sock.sendall(os.urandom(lm.REQUEST_SIZE * 3))
            # A random header may announce a PUT whose payload is then awaited (an
            # oversized one too: it is drained, not refused by closing).
            evil.sock.shutdown(socket.SHUT_WR)
        elif bad == "unknown-command":
            evil.sock.sendall(struct.pack("=9i", 99, 0, 1, 2, 0, 0, 0, 0, 0) + b"k".ljust(150))
            assert evil.reply().code == 400
        elif bad == "negative-length":
            evil.sock.sendall(struct.pack("=9i", 1, -5, 1, 2, 0, 0, 0, 0, 0) + b"k".ljust(150))
        elif bad == "truncated-payload":
            evil.sock.sendall(lm.LmRequest(1, 1000, 1, 2, 1, (0, 0, 0, 0), "t").pack() + b"x" * 10)
            evil.sock.shutdown(socket.SHUT_WR)
        elif bad == "truncated-header":
            evil.sock.sendall(lm.LmRequest(2, 0, 1, 2, 1, (0, 0, 0, 0), "t").pack()[:100])
            evil.sock.shutdown(socket.SHUT_WR)
        assert evil.closed_within()
        head, body = good.get("kept")
        assert head.code == 200 and body == b"v" * 100
    finally:
        evil.close()
        good.close()


def test_lmcache_client_stores_and_reads_back(server) -> None:
    """LMCache's StorageManager with remote_url=lm://..., in LMCache's own venv."""
    result = run_lmcache_client(server.lm_port, "6", log_level="WARNING")
    assert result["contains"] == [True] * 6
    assert result["absent_contains"] is False
    assert result["equal"] == [True] * 6
    assert result["missing_get"] is True

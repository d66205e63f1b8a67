"""common/observability/metrics.serve_metrics past its handler cap: every refused
client reads the 503, including one whose request arrives in more than one write
(closing on its unread bytes would reset it: EPIPE/ECONNRESET instead of the 503);
the refusals neither block the accepting thread nor take a thread each; and the
server answers again once slots free."""

from __future__ import annotations

import http.client
import io
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator

import pytest

from kvmesh.common.observability import Metrics
from kvmesh.common.observability import metrics as m
from kvmesh.common.observability.metrics import serve_metrics

HEAD = b"GET /metrics HTTP/1.1\r\n"


@pytest.fixture
def full_server() -> Iterator[tuple[m._ThreadingServer, list[socket.socket]]]:
    """A metrics server whose every handler slot is held by a client that sent half
    a request head."""
    srv = serve_metrics(Metrics(), 0)
    port = srv.server_address[1]
    held = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(32)]
    for s in held:
        s.sendall(HEAD)
    time.sleep(0.3)
    try:
        yield srv, held
    finally:
        for s in held:
            s.close()
        srv.shutdown()
        srv.server_close()


def _split_head(port: int) -> str:
    """One client sending its head in two writes; what it reads (or its error)."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as c:
        try:
            c.sendall(HEAD)
            time.sleep(0.005)
            c.sendall(b"Host: x\r\n\r\n")
            data = b""
            while chunk := c.recv(4096):
                data += chunk
            return data.split(b"\r\n", 1)[0].decode()
        except OSError as exc:
            return type(exc).__name__


def _streamed_body(port: int) -> str:
    """http.client with a file body: the head and the body are two writes."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        body = io.BytesIO(b"x" * 4096)
        conn.request("GET", "/metrics", body=body, headers={"Content-Length": "4096"})
        resp = conn.getresponse()
        resp.read()
        return str(resp.status)
    except OSError as exc:
        return type(exc).__name__
    finally:
        conn.close()


def test_every_refused_client_reads_the_503_and_slots_free_again(full_server) -> None:
    srv, held = full_server
    port = srv.server_address[1]
    split = [_split_head(port) for _ in range(50)]
    streamed = [_streamed_body(port) for _ in range(50)]
    assert split.count("HTTP/1.0 503 Service Unavailable") == 50, split
    assert streamed.count("503") == 50, streamed
    # One refusal thread, whatever the number refused.
    names = [t.name for t in threading.enumerate()]
    assert names.count("kvmesh-metrics-refuser") == 1
    for s in held:
        s.close()
    deadline = time.monotonic() + 10
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                assert r.status == 200
                break
        except OSError:
            # 503 (HTTPError) until the held handlers have seen their clients' EOF.
            assert time.monotonic() < deadline, "no slot freed after the clients left"
            time.sleep(0.1)


def test_lingering_refusals_neither_block_accepts_nor_pile_up(full_server, monkeypatch) -> None:
    """Refused clients that never hang up: each is closed after linger_s, the next
    one is answered meanwhile, and past max_pending they are closed at once."""
    monkeypatch.setattr(m._Refuser, "max_pending", 8)
    # Long enough that none expires while twelve connect on a loaded machine; refusals
    # that waited out one another's linger would take 44 s.
    monkeypatch.setattr(m._Refuser, "linger_s", 4.0)
    srv, _ = full_server
    port = srv.server_address[1]
    quiet = []
    t0 = time.monotonic()
    for _ in range(12):
        c = socket.create_connection(("127.0.0.1", port), timeout=5)
        c.sendall(HEAD)
        assert c.recv(100).startswith(b"HTTP/1.0 503")
        quiet.append(c)
    # Twelve answered without waiting out one another's linger (4 s each).
    assert time.monotonic() - t0 < 3.0
    assert srv._refuser._pending == 8
    deadline = time.monotonic() + m._Refuser.linger_s + 2
    while srv._refuser._pending and time.monotonic() < deadline:
        time.sleep(0.05)
    assert srv._refuser._pending == 0, "a refused socket outlived linger_s"
    for c in quiet:
        c.close()

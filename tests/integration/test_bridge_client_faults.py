"""The bridge (a real process) against clients that misbehave, with a stand-in decoder
(no vLLM) that streams without end:

- a client that asks for a stream and then stops reading, without closing, is dropped
  after decode_timeout_s: the decoder's request ends and the transfer goes;
- a compressed request body is refused (415) without being inflated;
- a request head that never completes, or an idle keep-alive connection, is closed
  after request_timeout_s;
- the bridge's own refusals and failures carry the request's X-Request-Id.
"""

from __future__ import annotations

import json
import os
import re
import socket
import threading
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiohttp import web
from kvtest.bridge import BridgeProcess, parse_metrics
from kvtest.http_backend import HttpBackend
from kvtest.waiting import wait_for

BODY = json.dumps({"prompt": "hi", "max_tokens": 4}).encode()


class EndlessDecoder(HttpBackend):
    """In mode "stream", answers every request with SSE events until the bridge hangs
    up (`ended` is set then); other modes as HttpBackend."""

    def __init__(self) -> None:
        super().__init__("stream")
        self.sent = 0
        self.ended = threading.Event()

    async def _any(self, request: web.Request) -> web.StreamResponse:
        if self.mode != "stream":
            return await super()._any(request)
        await request.read()
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        try:
            while True:
                await out.write(b"data: " + b"x" * 4096 + b"\n\n")
                self.sent += 1
        finally:
            self.ended.set()


@pytest.fixture(scope="module")
def mesh(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[BridgeProcess, EndlessDecoder]]:
    work: Path = tmp_path_factory.mktemp("bridge_client_faults")
    decoder = EndlessDecoder().start()
    bridge = BridgeProcess(
        work, prefillers=[], decoders=[(decoder.url, [])], decode_timeout_s=1, request_timeout_s=1
    )
    try:
        bridge.start()
        yield bridge, decoder
    finally:
        bridge.stop()
        decoder.stop()


def raw(port: int, head: bytes, body: bytes = b"", timeout_s: float = 10.0) -> bytes:
    """Send a request; everything the bridge answers until it closes the connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
        sock.sendall(head + body)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
        return answer


def head(path: str, body: bytes, *extra: str, close: bool = True) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: x", "Content-Type: application/json"]
    lines += [f"Content-Length: {len(body)}", *extra]
    if close:
        lines.append("Connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def cancelled(bridge: BridgeProcess) -> float:
    return bridge.metrics()[
        'kvmesh_bridge_requests_total{endpoint="completions",outcome="cancelled"}'
    ]


def cpu_s(bridge: BridgeProcess) -> float:
    assert bridge.proc is not None
    fields = Path(f"/proc/{bridge.proc.pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def test_a_client_that_stops_reading_is_dropped_and_the_decode_ends(mesh) -> None:
    bridge, decoder = mesh
    decoder.mode = "stream"
    decoder.ended.clear()
    before = cancelled(bridge)
    body = json.dumps({"prompt": "hi", "stream": True}).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # fills at once
    try:
        sock.connect(("127.0.0.1", bridge.port))
        sock.sendall(head("/v1/completions", body) + body)
        # Never read: the bridge's writes block once the buffers are full. Past
        # decode_timeout_s (1 s) it drops the client and so the decoder's request.
        assert decoder.ended.wait(10), f"decoder still streaming, {decoder.sent} events sent"
        wait_for(lambda: cancelled(bridge) == before + 1, 10, "the request counted cancelled")
        status, raw_transfers = bridge.get("/transfers")
        assert status == 200 and json.loads(raw_transfers) == []
    finally:
        sock.close()
    assert cancelled(bridge) == before + 1  # once
    assert bridge.alive()


def deflate_bomb(mib: int) -> bytes:
    """A zlib body that inflates to mib MiB and more. Each MiB is flushed to the same
    bytes, so they are compressed once; only the final checksum is then wrong, which
    an inflater finds after the work."""
    c = zlib.compressobj(9)
    start = c.compress(b'{"prompt":"') + c.flush(zlib.Z_FULL_FLUSH)
    mebibyte = c.compress(b"a" * (1 << 20)) + c.flush(zlib.Z_FULL_FLUSH)
    return start + mebibyte * mib + c.compress(b'"}') + c.flush()


def test_a_compressed_body_is_refused_without_inflating_it(mesh) -> None:
    bridge, decoder = mesh
    decoder.mode = "stream"
    seen = len(decoder.requests)
    small = zlib.compress(BODY)
    answer = raw(bridge.port, head("/v1/completions", small, "Content-Encoding: deflate"), small)
    assert answer.startswith(b"HTTP/1.1 415"), answer[:300]
    assert b"Content-Encoding 'deflate' is not supported" in answer
    # About 0.5 MB that inflate to 512 MiB: seconds of CPU on the bridge's event loop
    # if it inflated them, which it must not even in part.
    bomb = deflate_bomb(512)
    cpu0 = cpu_s(bridge)
    # Kept alive, so that the server reads the rest of the body after the answer.
    bomb_head = head("/v1/completions", bomb, "Content-Encoding: deflate", close=False)
    answer = raw(bridge.port, bomb_head, bomb)
    assert answer.startswith(b"HTTP/1.1 415"), answer[:300]
    assert cpu_s(bridge) - cpu0 < 0.5
    assert len(decoder.requests) == seen  # nothing went on
    assert (
        parse_metrics(bridge.get("/metrics")[1].decode())[
            'kvmesh_bridge_requests_total{endpoint="completions",outcome="bad_request"}'
        ]
        >= 2
    )


def test_half_sent_heads_and_idle_connections_are_closed(mesh) -> None:
    bridge, _ = mesh
    socks = [socket.create_connection(("127.0.0.1", bridge.port)) for _ in range(20)]
    idle = socket.create_connection(("127.0.0.1", bridge.port))
    try:
        t0 = time.monotonic()
        for sock in socks:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        idle.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        for sock in [*socks, idle]:
            # request_timeout_s is 1 s: closed well within 5 s (aiohttp's default is
            # an hour). The idle one first gets its answer, then is closed.
            sock.settimeout(5)
            while sock.recv(65536):
                pass
        assert time.monotonic() - t0 < 5
    finally:
        for sock in [*socks, idle]:
            sock.close()
    assert bridge.alive()


def test_the_bridge_s_own_answers_carry_the_request_id(mesh) -> None:
    bridge, decoder = mesh
    decoder.mode = "drop"  # the decoder closes the connection: 502
    cases = [
        (BODY, "X-Request-Id: client-42", b"502", b"client-42"),
        (b"{not json", "X-Request-Id: client-43", b"400", b"client-43"),
        (BODY, "X-Request-Id: has space", b"502", None),  # unusable: replaced
        (BODY, "X-Other: 1", b"502", None),  # none: one is made
    ]
    for body, extra, status, want in cases:
        answer = raw(bridge.port, head("/v1/completions", body, extra), body)
        assert answer.split(b" ", 2)[1] == status, answer[:300]
        got = re.search(rb"\r\nX-Request-Id: (\S+)\r\n", answer, re.IGNORECASE)
        assert got is not None, answer[:300]
        if want is not None:
            assert got[1] == want
        else:
            assert re.fullmatch(rb"[0-9a-f]{32}", got[1]), got[1]

"""The bridge (a real process) under load and against backends and clients that
misbehave, with scripted stand-in backends on loopback (no vLLM):

- a backend's plain (non-SSE) answer, however large, is never held whole in the
  bridge's memory: past PLAIN_BUFFER_BYTES it goes to the client as it arrives, at the
  client's pace, and a decoder failing mid-way cuts the answer visibly short;
- nor are the answers the bridge reads for itself (a prefill's, /v1/models);
- a decoder that refuses connections costs no request while another decoder is up;
- a client gone before the first byte, or while sending its body, ends the decoder's
  request and is counted once;
- 200 concurrent streams, 40 of them from clients that never read: the others
  finish, the bridge's memory stays bounded, the stalled ones' decoder requests end,
  the load is spread, and every counter is exact afterwards.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import http.client
import json
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiohttp import web
from kvtest.bridge import BridgeProcess, parse_metrics
from kvtest.http_backend import HttpBackend, Recorded
from kvtest.waiting import wait_for
from multidict import CIMultiDict

MIB = 1 << 20
COMPLETION = {"prompt": "hi", "max_tokens": 4}


class ScriptedBackend(HttpBackend):
    """HttpBackend with more modes:

    - "sse": `events` SSE events of `event_bytes` each, `delay_s` apart, then [DONE];
    - "big": a 200 application/json answer of `big_bytes`, written 1 MiB at a time
      (a backend gone wrong, or a huge logprobs answer);
    - "cut": as "big", but the connection is dropped after `big_bytes`, of twice that
      announced;
    - "stall": accept the request and never answer, until the bridge hangs up.
    A request's own "events", "event_bytes" and "delay_s" keys override the attributes.
    `active` counts the requests being answered; `ended` the ones whose answer ended
    (finished or cut off by the bridge)."""

    def __init__(self, mode: str = "sse") -> None:
        super().__init__(mode)
        self.events = 5
        self.event_bytes = 64
        self.delay_s = 0.0
        self.big_bytes = 256 * MIB
        self.active = 0
        self.ended = 0
        self._lock = threading.Lock()

    async def _any(self, request: web.Request) -> web.StreamResponse:
        if self.mode not in ("sse", "big", "cut", "stall"):
            return await super()._any(request)
        raw = await request.read()
        body = json.loads(raw) if raw else {}
        self.requests.append(Recorded(request.path, CIMultiDict(request.headers), body))
        with self._lock:
            self.active += 1
        try:
            if self.mode == "stall":
                await asyncio.sleep(3600)
            if self.mode == "sse":
                events = body.get("events", self.events)
                size = body.get("event_bytes", self.event_bytes)
                delay = body.get("delay_s", self.delay_s)
                return await self._sse(request, events, size, delay)
            return await self._big(request)
        finally:
            with self._lock:
                self.active -= 1
                self.ended += 1

    async def _sse(
        self, request: web.Request, events: int, size: int, delay_s: float
    ) -> web.StreamResponse:
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        for i in range(events):
            event = {"i": i, "pad": "x" * size}
            await out.write(b"data: " + json.dumps(event).encode() + b"\n\n")
            if delay_s:
                await asyncio.sleep(delay_s)
        await out.write(b"data: [DONE]\n\n")
        await out.write_eof()
        return out

    async def _big(self, request: web.Request) -> web.StreamResponse:
        out = web.StreamResponse(headers={"Content-Type": "application/json"})
        cut = self.mode == "cut"
        out.content_length = self.big_bytes * (2 if cut else 1)
        await out.prepare(request)
        block = b" " * MIB
        for _ in range(self.big_bytes // MIB):
            await out.write(block)
        if cut:
            assert request.transport is not None
            request.transport.abort()
            return out
        await out.write_eof()
        return out


class Growth:
    """How far the bridge's resident memory has peaked above where it stood when made:
    the kernel's high-water mark (VmHWM), reset here, so no sampling can miss a spike."""

    def __init__(self, bridge: BridgeProcess) -> None:
        assert bridge.proc is not None
        self._proc = Path(f"/proc/{bridge.proc.pid}")
        (self._proc / "clear_refs").write_text("5")  # VmHWM back to the current RSS
        self._base = self._kib("VmRSS")

    def _kib(self, field: str) -> int:
        for line in (self._proc / "status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1])
        raise AssertionError(f"no {field}")

    def mib(self) -> float:
        return (self._kib("VmHWM") - self._base) / 1024


def metrics(bridge: BridgeProcess) -> dict[str, float]:
    status, raw = bridge.get("/metrics")
    assert status == 200
    return parse_metrics(raw.decode())


def outcomes(bridge: BridgeProcess, endpoint: str = "completions") -> dict[str, float]:
    prefix = f'kvmesh_bridge_requests_total{{endpoint="{endpoint}",outcome="'
    return {k[len(prefix) : -2]: v for k, v in metrics(bridge).items() if k.startswith(prefix)}


def inflight(bridge: BridgeProcess) -> float:
    return sum(
        v for k, v in metrics(bridge).items() if k.startswith("kvmesh_bridge_backend_inflight")
    )


def post_head(path: str, body: bytes) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: x", "Content-Type: application/json"]
    lines += [f"Content-Length: {len(body)}", "Connection: close"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


@pytest.fixture(scope="module")
def plain(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[BridgeProcess, ScriptedBackend, ScriptedBackend]]:
    work: Path = tmp_path_factory.mktemp("bridge_audit")
    decoder = ScriptedBackend("big").start()
    prefiller = ScriptedBackend("big").start()
    bridge = BridgeProcess(
        work, prefillers=[prefiller.url], decoders=[(decoder.url, ["tcp://127.0.0.1:7650"])],
        decode_timeout_s=20, prefill_timeout_s=20,
    )  # fmt: skip
    try:
        bridge.start()
        yield bridge, prefiller, decoder
    finally:
        bridge.stop()
        decoder.stop()
        prefiller.stop()


def test_a_large_plain_answer_goes_through_at_the_client_s_pace(plain) -> None:
    bridge, prefiller, decoder = plain
    prefiller.mode, decoder.mode = "fail", "big"
    decoder.big_bytes = 256 * MIB
    growth = Growth(bridge)
    body = json.dumps(COMPLETION).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
    try:
        sock.connect(("127.0.0.1", bridge.port))
        sock.sendall(post_head("/v1/completions", body) + body)
        # The client reads nothing for 3 s: a bridge holding the whole answer grows by
        # its 256 MiB meanwhile; one that passes it on waits on the client.
        time.sleep(3)
        assert growth.mib() < 64, f"the bridge grew by {growth.mib():.0f} MiB"
        sock.settimeout(30)
        got = b""
        while b"\r\n\r\n" not in got:
            got += sock.recv(65536)
        head, _, rest = got.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200"), head
        n = len(rest)
        while chunk := sock.recv(1 << 20):
            n += len(chunk)
    finally:
        sock.close()
    assert n >= 256 * MIB  # all of it (chunked framing adds a little)
    assert growth.mib() < 64, f"the bridge grew by {growth.mib():.0f} MiB"
    wait_for(lambda: inflight(bridge) == 0, 10, "nothing in flight")
    assert bridge.alive()


def test_a_large_prefill_answer_is_thrown_away_as_it_arrives(plain) -> None:
    bridge, prefiller, decoder = plain
    prefiller.mode, decoder.mode = "big", "sse"
    prefiller.big_bytes, decoder.events = 256 * MIB, 3
    growth = Growth(bridge)
    status, raw = bridge_request(bridge, {**COMPLETION, "stream": True})
    assert status == 200 and raw.count(b"data: ") == 4, raw[:300]
    assert growth.mib() < 64, f"the bridge grew by {growth.mib():.0f} MiB"
    wait_for(lambda: inflight(bridge) == 0, 10, "nothing in flight")


def test_a_decoder_failing_mid_way_through_a_large_plain_answer_cuts_it_short(plain) -> None:
    bridge, prefiller, decoder = plain
    prefiller.mode, decoder.mode = "fail", "cut"
    decoder.big_bytes = 16 * MIB
    body = json.dumps(COMPLETION).encode()
    # The decoder announced 32 MiB and sends 16: the bridge passes its length on, so an
    # HTTP/1.0 client (no chunked framing) sees the cut as well as an HTTP/1.1 one.
    for version in (b"HTTP/1.1", b"HTTP/1.0"):
        before = outcomes(bridge)
        request = post_head("/v1/completions", body).replace(b"HTTP/1.1", version, 1) + body
        with socket.create_connection(("127.0.0.1", bridge.port), timeout=30) as sock:
            sock.sendall(request)
            got = b""
            with contextlib.suppress(ConnectionResetError):
                while chunk := sock.recv(1 << 20):
                    got += chunk
        head, _, rest = got.partition(b"\r\n\r\n")
        assert head.split(b"\r\n")[0].endswith(b" 200 OK"), head
        assert f"content-length: {32 * MIB}".encode() in head.lower(), head
        assert len(rest) < 32 * MIB  # short of its length: visibly incomplete
        wait_for(
            lambda before=before: (
                outcomes(bridge)["decoder_failed"] == before["decoder_failed"] + 1
            ),
            10,
            "counted decoder_failed",
        )
    assert outcomes(bridge)["ok"] == before["ok"]
    wait_for(lambda: inflight(bridge) == 0, 10, "nothing in flight")
    decoder.mode = "sse"
    status, raw = bridge_request(bridge, {**COMPLETION, "stream": True})
    assert status == 200 and b"[DONE]" in raw


def bridge_request(bridge: BridgeProcess, body: dict) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", bridge.port, timeout=60)
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), JSON)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


JSON = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
def pair(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[BridgeProcess, list[ScriptedBackend]]]:
    work: Path = tmp_path_factory.mktemp("bridge_audit_load")
    decoders = [ScriptedBackend("sse").start() for _ in range(2)]
    bridge = BridgeProcess(
        work, prefillers=[], decoders=[(d.url, []) for d in decoders],
        decode_timeout_s=3, request_timeout_s=5, health_interval_s=0.5,
    )  # fmt: skip
    try:
        bridge.start()
        yield bridge, decoders
    finally:
        bridge.stop()
        for d in decoders:
            d.stop()


async def stream_once(
    port: int, body: dict, hold: asyncio.Event | None = None
) -> tuple[float, bytes]:
    """One streamed request on its own connection; (seconds, answer). With `hold`, a
    client that sends and then reads nothing, its connection open until `hold` is set."""
    data = json.dumps(body).encode()
    t0 = time.monotonic()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        if hold is not None:
            sock = writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            writer.transport.pause_reading()
        writer.write(post_head("/v1/completions", data) + data)
        await writer.drain()
        if hold is not None:
            await hold.wait()
            return time.monotonic() - t0, b""
        answer = await asyncio.wait_for(reader.read(-1), 30)
        return time.monotonic() - t0, answer
    finally:
        writer.close()


def test_200_streams_with_stalled_clients_finish_and_leave_exact_counters(pair) -> None:
    bridge, decoders = pair
    for d in decoders:
        d.mode, d.delay_s = "sse", 0.05
    before = outcomes(bridge)
    growth = Growth(bridge)
    readers, stalled = 170, 40
    small = {**COMPLETION, "stream": True, "events": 20, "event_bytes": 256}
    # Endless for a client that reads nothing: the bridge must drop it after
    # decode_timeout_s (3 s) and end the decoder's request.
    huge = {**COMPLETION, "stream": True, "events": 10**6, "event_bytes": 4096, "delay_s": 0}
    dropped_after = [0.0]

    async def main() -> list[tuple[float, bytes]]:
        hold = asyncio.Event()
        t0 = time.monotonic()
        held = [asyncio.create_task(stream_once(bridge.port, huge, hold)) for _ in range(stalled)]
        try:
            answered = await asyncio.gather(
                *(stream_once(bridge.port, small) for _ in range(readers))
            )
            # The stalled clients still hold their connections: the bridge must have
            # ended their decoder requests itself.
            # (Polled: the stand-ins count in their own threads.)
            while any(d.active for d in decoders) and time.monotonic() - t0 < 20:  # noqa: ASYNC110
                await asyncio.sleep(0.1)
            dropped_after[0] = time.monotonic() - t0
            return answered
        finally:
            hold.set()
            await asyncio.gather(*held)

    answered = asyncio.run(main())
    slowest = max(s for s, _ in answered)
    for _, answer in answered:
        assert answer.startswith(b"HTTP/1.1 200"), answer[:300]
        assert answer.count(b"data: ") == 21 and b"data: [DONE]" in answer
    # 20 events 50 ms apart: ~1 s each, whatever the stalled clients do.
    assert slowest < 10, f"slowest reader took {slowest:.1f}s"
    # Each backend got a fair share (least loaded, ties round-robin).
    shares = sorted(d.ended for d in decoders)
    assert shares[0] >= 0.3 * (readers + stalled), shares
    assert dropped_after[0] < 15, f"stalled clients' decodes ran {dropped_after[0]:.1f}s"
    wait_for(lambda: inflight(bridge) == 0, 10, "nothing in flight")
    after = outcomes(bridge)
    assert after["ok"] - before["ok"] == readers
    assert after["cancelled"] - before["cancelled"] == stalled
    assert sum(after.values()) - sum(before.values()) == readers + stalled
    status, raw = bridge.get("/transfers")
    assert status == 200 and json.loads(raw) == []
    assert growth.mib() < 200, f"the bridge grew by {growth.mib():.0f} MiB"
    print(
        f"slowest {slowest:.2f}s, growth {growth.mib():.0f} MiB, shares {shares}, "
        f"stalled dropped after {dropped_after[0]:.1f}s"
    )


def test_a_decoder_refusing_connections_costs_no_request_while_another_is_up(
    tmp_path: Path,
) -> None:
    gone, live = ScriptedBackend("sse").start(), ScriptedBackend("sse").start()
    prefiller = ScriptedBackend("sse").start()
    kv = "tcp://127.0.0.1:7650"
    bridge = BridgeProcess(
        tmp_path, prefillers=[prefiller.url], decoders=[(gone.url, [kv]), (live.url, [kv])],
        health_interval_s=60,  # only the first check, which finds both up
    )  # fmt: skip
    try:
        bridge.start()
        wait_for(lambda: b'"state": "up"' in bridge.get("/health")[1], 10, "decoders up")
        gone.stop()  # refuses connections from now on, still "up" for the bridge
        answers = [bridge_request(bridge, {**COMPLETION, "stream": True}) for _ in range(6)]
        assert [status for status, _ in answers] == [200] * 6, answers[0][1][:300]
        assert all(raw.endswith(b"data: [DONE]\n\n") for _, raw in answers)
        assert len(live.requests) == 6
        # The first request's KV went to the decoder that refused: the one that took
        # it over prefilled itself (no transfer id); the others were routed to it.
        pds = [
            (r.body.get("kv_transfer_params") or {}).get("kvmesh", {}).get("pd")
            for r in live.requests
        ]
        assert pds[0] is None and all(pd is not None for pd in pds[1:]), pds
        got = metrics(bridge)
        assert got['kvmesh_bridge_fallbacks_total{reason="decoder_refused"}'] == 1
        assert outcomes(bridge)["ok"] == 6
        wait_for(lambda: inflight(bridge) == 0, 10, "nothing in flight")
    finally:
        bridge.stop()
        live.stop()
        prefiller.stop()


def test_a_small_plain_answer_to_a_client_that_reads_nothing_is_dropped_at_the_deadline(
    tmp_path: Path,
) -> None:
    """A 3 MiB answer (read whole, under PLAIN_BUFFER_BYTES) to a client that neither
    reads nor closes: written within decode_timeout_s like a large one, then dropped and
    counted cancelled, not held for as long as the client likes and counted ok."""
    decoder = ScriptedBackend("big").start()
    decoder.big_bytes = 3 * MIB
    bridge = BridgeProcess(tmp_path, prefillers=[], decoders=[(decoder.url, [])],
                           decode_timeout_s=2)  # fmt: skip
    try:
        bridge.start()
        wait_for(lambda: b'"state": "up"' in bridge.get("/health")[1], 10, "decoder up")
        before = outcomes(bridge)
        body = json.dumps(COMPLETION).encode()
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect(("127.0.0.1", bridge.port))
            sock.sendall(post_head("/v1/completions", body) + body)
            wait_for(
                lambda: outcomes(bridge)["cancelled"] == before["cancelled"] + 1,
                15,
                "the stalled client dropped and counted cancelled",
            )
        assert outcomes(bridge)["ok"] == before["ok"]
        wait_for(lambda: inflight(bridge) == 0, 10, "nothing in flight")
    finally:
        bridge.stop()
        decoder.stop()


def test_a_huge_model_list_is_refused_not_buffered(plain) -> None:
    bridge, _, decoder = plain
    decoder.mode, decoder.big_bytes = "big", 256 * MIB
    growth = Growth(bridge)
    status, raw = bridge.get("/v1/models")
    assert status == 502 and b"over 16777216 bytes" in raw, raw[:300]
    assert growth.mib() < 64, f"the bridge grew by {growth.mib():.0f} MiB"


def test_a_client_gone_before_the_first_byte_ends_the_decoder_s_request(plain) -> None:
    bridge, prefiller, decoder = plain
    prefiller.mode, decoder.mode = "fail", "stall"
    before = outcomes(bridge)
    ended = decoder.ended
    conn = http.client.HTTPConnection("127.0.0.1", bridge.port, timeout=10)
    conn.request("POST", "/v1/completions", json.dumps({**COMPLETION, "stream": True}), JSON)
    wait_for(lambda: decoder.active == 1, 10, "the decoder has the request")
    conn.close()
    t0 = time.monotonic()
    wait_for(lambda: decoder.ended == ended + 1, 10, "the decoder's request ended")
    assert time.monotonic() - t0 < 2
    wait_for(lambda: inflight(bridge) == 0, 10, "nothing in flight")
    after = outcomes(bridge)
    assert after["cancelled"] == before["cancelled"] + 1
    assert sum(after.values()) == sum(before.values()) + 1
    assert json.loads(bridge.get("/transfers")[1]) == []


def test_clients_gone_while_sending_their_body_are_counted(plain) -> None:
    bridge, _, decoder = plain
    decoder.mode = "sse"
    before = outcomes(bridge)
    body = json.dumps({"prompt": "x" * 1000}).encode()
    for _ in range(3):
        with socket.create_connection(("127.0.0.1", bridge.port)) as sock:
            sock.sendall(post_head("/v1/completions", body) + body[:300])
            time.sleep(0.2)
    wait_for(
        lambda: outcomes(bridge)["cancelled"] == before["cancelled"] + 3,
        10,
        "three cancellations counted",
    )
    after = outcomes(bridge)
    assert sum(after.values()) == sum(before.values()) + 3


def test_an_encoded_answer_keeps_its_content_encoding(tmp_path: Path) -> None:
    """The decoder's answer reaches the client as the decoder encoded it, with its
    Content-Encoding, whatever the encoding (one aiohttp could inflate, one it cannot,
    one nobody knows): never compressed bytes without the header that says so. The
    decoder is asked for what the client accepts, and for none when it says nothing."""
    decoder = HttpBackend("ok").start()
    bridge = BridgeProcess(tmp_path, prefillers=[], decoders=[(decoder.url, [])])
    try:
        bridge.start()
        plain = json.dumps({"object": "text_completion", "choices": [{"text": "ab", "index": 0}]})
        for encoding in ("gzip", "br", "x-foo"):
            decoder.encoding = encoding
            for stream in (False, True):
                conn = http.client.HTTPConnection("127.0.0.1", bridge.port, timeout=30)
                headers = {**JSON, "Accept-Encoding": "gzip, br"}
                body = json.dumps({**COMPLETION, "stream": stream})
                conn.request("POST", "/v1/completions", body, headers)
                resp = conn.getresponse()
                raw = resp.read()
                conn.close()
                assert resp.status == 200, raw[:300]
                assert resp.getheader("Content-Encoding") == encoding, resp.getheaders()
                text = gzip.decompress(raw).decode()
                if stream:
                    assert text.endswith("data: [DONE]\n\n") and '"text": "b"' in text, text
                else:
                    assert text == plain
                assert decoder.requests[-1].headers["Accept-Encoding"] == "gzip, br"
            status, models = bridge.get("/v1/models")  # also passed on as encoded
            assert status == 200 and gzip.decompress(models).decode() == plain
        decoder.encoding = ""
        status, answer = bridge.post("/v1/completions", COMPLETION)
        assert status == 200 and answer["choices"][0]["text"] == "ab"
        assert decoder.requests[-1].headers["Accept-Encoding"] == "identity"
    finally:
        bridge.stop()
        decoder.stop()


class SmallPoolBridge(BridgeProcess):
    """The bridge with `pool` outgoing connections instead of POOL_CONNECTIONS (a
    constant, no option): the same process, the constant set before it starts."""

    def __init__(self, workdir: Path, pool: int, **kwargs: object) -> None:
        super().__init__(workdir, **kwargs)  # type: ignore[arg-type]
        launch = (
            "import kvmesh.services.bridge.server as s; "
            f"s.POOL_CONNECTIONS = {pool}; "
            "from kvmesh.services.cli.bridge_cmd import bridge; "
            "bridge(prog_name='kvmesh serve bridge')"
        )
        self.cmd = [sys.executable, "-c", launch, *self.cmd[len(self.command) :]]


def test_a_request_that_waits_too_long_for_a_connection_is_a_503_saturated(
    tmp_path: Path,
) -> None:
    """Every pooled connection is busy (two here, streams that last 4 s): a request
    waiting past decode_timeout_s for one never reached a decoder. It is a 503 that
    says the bridge is saturated (with Retry-After), counted `saturated`, not a 504
    blaming a decoder that "sent nothing"; nor does it count against the decoder."""
    decoder = HttpBackend("trickle").start()
    decoder.trickle_s = 4.0
    bridge = SmallPoolBridge(tmp_path, 2, prefillers=[], decoders=[(decoder.url, [])],
                             decode_timeout_s=1.5)  # fmt: skip
    try:
        bridge.start()
        wait_for(lambda: b'"state": "up"' in bridge.get("/health")[1], 10, "decoder up")
        answers: list[tuple[int, dict[str, str], bytes]] = []

        def one() -> None:
            conn = http.client.HTTPConnection("127.0.0.1", bridge.port, timeout=30)
            try:
                body = json.dumps({**COMPLETION, "stream": True})
                conn.request("POST", "/v1/completions", body, JSON)
                resp = conn.getresponse()
                answers.append((resp.status, dict(resp.getheaders()), resp.read()))
            finally:
                conn.close()

        threads = [threading.Thread(target=one) for _ in range(2)]
        for t in threads:
            t.start()
        wait_for(lambda: len(decoder.requests) == 2, 10, "both connections busy")
        threads += [threading.Thread(target=one) for _ in range(2)]
        for t in threads[2:]:
            t.start()
        for t in threads:
            t.join(30)
        statuses = sorted(status for status, _, _ in answers)
        assert statuses == [200, 200, 503, 503], [a[2][:200] for a in answers]
        for status, headers, raw in answers:
            if status == 503:
                assert b"the bridge is saturated" in raw, raw
                assert b"sent nothing" not in raw
                assert headers["Retry-After"] == "1"
        assert len(decoder.requests) == 2  # the waiting ones never reached it
        got = outcomes(bridge)
        assert got["saturated"] == 2 and got["ok"] == 2 and got["decoder_timeout"] == 0
        status, raw = bridge.get("/health")
        assert b"failures_in_a_row" not in raw and b"ejected" not in raw, raw
    finally:
        bridge.stop()
        decoder.stop()

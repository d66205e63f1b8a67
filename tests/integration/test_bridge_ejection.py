"""Passive ejection (services/bridge/backends.py), with the bridge as a real process and
stand-in backends on loopback: a backend whose GET /health answers 200 while it fails
every real request (drops the connection, answers 502/503, cuts its stream short) is
taken out of rotation after EJECT_AFTER_FAILURES failures in a row, stays out for its
cooldown whatever the health checks say, comes back on probation, and is ejected
again at its first failure there (for twice as long) or forgiven at its first
success. The last backend of a role in rotation is never ejected. A 500 (vLLM's
answer to some bad requests) does not count, a 4xx is a success, a client hanging up
is neither.
"""

from __future__ import annotations

import http.client
import json
import socket
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from aiohttp import web
from kvtest.bridge import BridgeProcess, parse_metrics
from kvtest.http_backend import HttpBackend, Recorded
from kvtest.waiting import wait_for
from multidict import CIMultiDict

from kvmesh.services.bridge.backends import EJECT_AFTER_FAILURES

STREAM = {"prompt": "hi", "max_tokens": 2, "stream": True}
KV = "tcp://127.0.0.1:7650"


class Backend(HttpBackend):
    """The stand-in, with one more mode: "status" answers every real request with
    `status` (an OpenAI-style error), its /health 200 all along."""

    def __init__(self, mode: str) -> None:
        super().__init__(mode)
        self.status = 502

    async def _any(self, request: web.Request) -> web.StreamResponse:
        if self.mode != "status":
            return await super()._any(request)
        raw = await request.read()
        body = json.loads(raw) if raw else {}
        self.requests.append(Recorded(request.path, CIMultiDict(request.headers), body))
        error = {"message": f"stand-in {self.status}", "type": "Error", "code": self.status}
        return web.json_response({"error": error}, status=self.status)


def failing(status: int) -> Callable[[Callable[[str], Backend]], Backend]:
    def start(backends: Callable[[str], Backend]) -> Backend:
        b = backends("status")
        b.status = status
        return b

    return start


class PatchedBridge(BridgeProcess):
    """The bridge with EJECT_BASE_S (a constant, no option) set to `base_s` before it
    starts: a cooldown long enough for a slow box, or short enough to wait out."""

    def __init__(self, workdir: Path, base_s: float, **kwargs: object) -> None:
        super().__init__(workdir, **kwargs)  # type: ignore[arg-type]
        launch = (
            "import kvmesh.services.bridge.backends as b; "
            f"b.EJECT_BASE_S = {base_s}; "
            "from kvmesh.services.cli.bridge_cmd import bridge; "
            "bridge(prog_name='kvmesh serve bridge')"
        )
        self.cmd = [sys.executable, "-c", launch, *self.cmd[len(self.command) :]]


def complete(bridge: BridgeProcess, body: dict) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", bridge.port, timeout=30)
    try:
        conn.request(
            "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def went_through(answer: tuple[int, bytes]) -> bool:
    status, raw = answer
    return status == 200 and raw.endswith(b"data: [DONE]\n\n") and b'"error"' not in raw


def report(bridge: BridgeProcess, role: str = "decoders") -> dict[str, dict]:
    status, raw = bridge.get("/health")
    assert status == 200, raw
    return {b["url"]: b for b in json.loads(raw)[role]}


def metric(bridge: BridgeProcess, name: str, backend: HttpBackend, role: str = "decoder") -> float:
    got = parse_metrics(bridge.get("/metrics")[1].decode())
    return got[f'kvmesh_bridge_{name}{{backend="{backend.url}",role="{role}"}}']


def until_it_got(bridge: BridgeProcess, backend: HttpBackend, n: int, body: dict) -> None:
    """Send requests one at a time until `backend` got n more (the others take turns)."""
    want = len(backend.requests) + n
    for _ in range(10 * n):
        if len(backend.requests) >= want:
            return
        complete(bridge, body)
    raise AssertionError(f"{backend.url} got {len(backend.requests)} requests, not {want}")


def all_up(bridge: BridgeProcess, role: str = "decoders") -> None:
    wait_for(lambda: all(b["state"] == "up" for b in report(bridge, role).values()), 10, "up")


@pytest.fixture
def backends() -> Iterator[Callable[[str], Backend]]:
    started: list[Backend] = []

    def start(mode: str) -> Backend:
        started.append(Backend(mode).start())
        return started[-1]

    yield start
    for b in started:
        b.stop()


@pytest.mark.parametrize("broken", ["drop", "502", "503", "504", "truncate"])
def test_a_half_dead_decoder_is_ejected_and_no_request_fails_after(
    tmp_path: Path, backends, broken: str
) -> None:
    bad = failing(int(broken))(backends) if broken.isdigit() else backends(broken)
    good = backends("ok")
    # A cooldown far longer than the test (a loaded box may take seconds over the 24
    # requests): still ejected when looked at.
    base_s = 60.0
    bridge = PatchedBridge(
        tmp_path, base_s, prefillers=[], decoders=[(bad.url, []), (good.url, [])],
        health_interval_s=0.2,  # checks that would mark it up again, often
    )  # fmt: skip
    try:
        bridge.start()
        wait_for(lambda: all(b["state"] == "up" for b in report(bridge).values()), 10, "up")
        answers = [complete(bridge, STREAM) for _ in range(24)]
        failed = [i for i, a in enumerate(answers) if not went_through(a)]
        # Its share of requests until ejected, failed; then it got none.
        assert len(bad.requests) == EJECT_AFTER_FAILURES, (len(bad.requests), failed)
        assert len(failed) == EJECT_AFTER_FAILURES, failed
        assert failed[-1] < 2 * EJECT_AFTER_FAILURES, failed
        assert len(good.requests) == 24 - EJECT_AFTER_FAILURES
        time.sleep(0.5)  # a few more health checks, all 200
        state = report(bridge)[bad.url]
        assert state["state"] == "up" and "ejected" in state, state
        assert f"{EJECT_AFTER_FAILURES} failed request(s) in a row" in state["ejected"]["reason"]
        assert 0 < state["ejected"]["s_left"] <= base_s
        assert "ejected" not in report(bridge)[good.url]
        assert metric(bridge, "backend_ejected", bad) == 1
        assert metric(bridge, "backend_ejections_total", bad) == 1
        assert metric(bridge, "backend_ejected", good) == 0
        assert metric(bridge, "backend_up", bad) == 1  # its health, as before
    finally:
        bridge.stop()


def test_an_ejected_decoder_comes_back_on_probation(tmp_path: Path, backends) -> None:
    bad, good = failing(502)(backends), backends("ok")
    base_s = 3.0
    bridge = PatchedBridge(
        tmp_path, base_s, prefillers=[], decoders=[(bad.url, []), (good.url, [])],
        health_interval_s=0.5,
    )  # fmt: skip
    try:
        bridge.start()
        wait_for(lambda: all(b["state"] == "up" for b in report(bridge).values()), 10, "up")
        for _ in range(2 * EJECT_AFTER_FAILURES):
            complete(bridge, STREAM)
        assert "ejected" in report(bridge)[bad.url]
        # Past the cooldown it is back; still failing, its first request there ejects it
        # again, for twice as long.
        time.sleep(base_s + 0.2)
        assert "ejected" not in report(bridge)[bad.url]
        seen = len(bad.requests)
        t0 = time.monotonic()
        answers = [complete(bridge, STREAM) for _ in range(6)]
        assert len(bad.requests) == seen + 1
        assert sum(not went_through(a) for a in answers) == 1
        state = report(bridge)[bad.url]["ejected"]
        # Ejected after t0 for 2 * base_s: however slow the box, at least this is left.
        floor = 2 * base_s - (time.monotonic() - t0) - 0.05
        assert state["times_in_a_row"] == 2 and floor < state["s_left"] <= 2 * base_s, state
        assert metric(bridge, "backend_ejections_total", bad) == 2
        # Repaired meanwhile: past the cooldown, on probation, one success forgives it.
        bad.mode = "ok"
        time.sleep(state["s_left"] + 0.2)
        assert report(bridge)[bad.url].get("probation") is True
        seen = len(bad.requests)
        answers = [complete(bridge, STREAM) for _ in range(4)]
        assert all(went_through(a) for a in answers)
        assert len(bad.requests) == seen + 2  # its share again
        state = report(bridge)[bad.url]
        assert "ejected" not in state and "probation" not in state, state
        assert metric(bridge, "backend_ejected", bad) == 0
    finally:
        bridge.stop()


def test_the_last_decoder_in_rotation_is_never_ejected(tmp_path: Path, backends) -> None:
    first, second = failing(503)(backends), failing(503)(backends)
    bridge = BridgeProcess(
        tmp_path, prefillers=[], decoders=[(first.url, []), (second.url, [])],
        health_interval_s=0.5,
    )  # fmt: skip
    try:
        bridge.start()
        wait_for(lambda: all(b["state"] == "up" for b in report(bridge).values()), 10, "up")
        answers = [complete(bridge, {**STREAM, "stream": False}) for _ in range(12)]
        # Every request got the decoders' own 503, passed through: an error, not none.
        assert {status for status, _ in answers} == {503}
        states = report(bridge)
        ejected = [url for url, s in states.items() if "ejected" in s]
        assert len(ejected) == 1, states
        left = states[second.url if ejected[0] == first.url else first.url]
        assert left["failures_in_a_row"] >= EJECT_AFTER_FAILURES, left
        assert left["last_failure"] == "answered 503"
        assert len(first.requests) + len(second.requests) == 12
    finally:
        bridge.stop()


def test_a_half_dead_prefiller_is_ejected(tmp_path: Path, backends) -> None:
    bad, good, decoder = backends("drop"), backends("ok"), backends("ok")
    bridge = BridgeProcess(
        tmp_path, prefillers=[bad.url, good.url], decoders=[(decoder.url, [KV])],
        health_interval_s=0.2,
    )  # fmt: skip
    try:
        bridge.start()
        wait_for(
            lambda: all(b["state"] == "up" for b in report(bridge, "prefillers").values()),
            10,
            "up",
        )
        answers = [complete(bridge, STREAM) for _ in range(16)]
        assert all(went_through(a) for a in answers)  # a failed prefill falls back
        assert len(bad.requests) == EJECT_AFTER_FAILURES
        assert len(good.requests) == 16 - EJECT_AFTER_FAILURES
        got = parse_metrics(bridge.get("/metrics")[1].decode())
        assert got['kvmesh_bridge_fallbacks_total{reason="error"}'] == EJECT_AFTER_FAILURES
        assert "ejected" in report(bridge, "prefillers")[bad.url]
        assert metric(bridge, "backend_ejected", bad, "prefiller") == 1
    finally:
        bridge.stop()


def test_a_decoder_answering_500_is_not_ejected(tmp_path: Path, backends) -> None:
    """vLLM answers 500 to some bad requests, and SDKs retry 5xx: one client repeating
    a poison prompt must not eject healthy decoders. A 500 counts neither way; a
    502/503/504 does."""
    bad, good = failing(500)(backends), backends("ok")
    bridge = BridgeProcess(
        tmp_path, prefillers=[], decoders=[(bad.url, []), (good.url, [])], health_interval_s=0.5
    )
    try:
        bridge.start()
        all_up(bridge)
        answers = [
            complete(bridge, {**STREAM, "stream": False}) for _ in range(4 * EJECT_AFTER_FAILURES)
        ]
        assert len(bad.requests) == 2 * EJECT_AFTER_FAILURES  # its share, to the end
        assert sorted({status for status, _ in answers}) == [200, 500]
        state = report(bridge)[bad.url]
        assert "ejected" not in state and "failures_in_a_row" not in state, state
        assert metric(bridge, "backend_ejections_total", bad) == 0
    finally:
        bridge.stop()


def test_a_4xx_is_a_success_and_ends_a_streak(tmp_path: Path, backends) -> None:
    """A 4xx is the request's fault: the decoder works. Two failures, a 404, two more
    failures: no three in a row, not ejected."""
    bad, good = failing(502)(backends), backends("ok")
    bridge = BridgeProcess(
        tmp_path, prefillers=[], decoders=[(bad.url, []), (good.url, [])], health_interval_s=0.5
    )
    try:
        bridge.start()
        all_up(bridge)
        until_it_got(bridge, bad, EJECT_AFTER_FAILURES - 1, STREAM)
        assert report(bridge)[bad.url]["failures_in_a_row"] == EJECT_AFTER_FAILURES - 1
        bad.status = 404
        until_it_got(bridge, bad, 1, STREAM)
        state = report(bridge)[bad.url]
        assert "failures_in_a_row" not in state, state
        bad.status = 502
        until_it_got(bridge, bad, EJECT_AFTER_FAILURES - 1, STREAM)
        state = report(bridge)[bad.url]
        assert "ejected" not in state, state
        assert state["failures_in_a_row"] == EJECT_AFTER_FAILURES - 1
    finally:
        bridge.stop()


def test_clients_hanging_up_do_not_count(tmp_path: Path, backends) -> None:
    """Clients that go away mid-stream cut the decoder's answer short from the
    bridge's side: nothing about the decoder."""
    first, second = backends("trickle"), backends("trickle")
    for b in (first, second):
        b.trickle_s = 3.0
    bridge = BridgeProcess(
        tmp_path, prefillers=[], decoders=[(first.url, []), (second.url, [])],
        health_interval_s=0.5,
    )  # fmt: skip
    try:
        bridge.start()
        all_up(bridge)
        n = 2 * EJECT_AFTER_FAILURES + 1
        for _ in range(n):
            with socket.create_connection(("127.0.0.1", bridge.port), timeout=30) as sock:
                body = json.dumps(STREAM).encode()
                sock.sendall(
                    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                    b"Content-Type: application/json\r\n"
                    + f"Content-Length: {len(body)}\r\n\r\n".encode() + body
                )  # fmt: skip
                got = b""
                while b"data: " not in got:  # streaming: then gone
                    chunk = sock.recv(4096)
                    assert chunk, got
                    got += chunk
        wait_for(lambda: bridge_idle(bridge), 10, "the cancelled decodes ended")
        assert len(first.requests) + len(second.requests) == n
        for url, state in report(bridge).items():
            assert "ejected" not in state and "failures_in_a_row" not in state, (url, state)
    finally:
        bridge.stop()


def bridge_idle(bridge: BridgeProcess) -> bool:
    return all(b["inflight"] == 0 for b in report(bridge).values())


def test_an_ejected_decoder_still_takes_requests_when_all_others_are_down(
    tmp_path: Path, backends
) -> None:
    bad, good = failing(502)(backends), backends("ok")
    bridge = PatchedBridge(
        tmp_path, 60.0, prefillers=[], decoders=[(bad.url, []), (good.url, [])],
        health_interval_s=0.2,
    )  # fmt: skip
    try:
        bridge.start()
        all_up(bridge)
        until_it_got(bridge, bad, EJECT_AFTER_FAILURES, STREAM)
        assert "ejected" in report(bridge)[bad.url]
        good.mode = "down"  # /health 503 too
        wait_for(lambda: report(bridge)[good.url]["state"] == "down", 10, "good down")
        seen = len(bad.requests)
        status, raw = complete(bridge, STREAM)
        # Tried there rather than nowhere: its own answer, passed through.
        assert len(bad.requests) == seen + 1
        assert status == 502 and b"stand-in 502" in raw, raw[:300]
        assert "ejected" in report(bridge)[bad.url]
    finally:
        bridge.stop()


def test_the_ejected_gauge_clears_after_the_cooldown_on_an_idle_bridge(
    tmp_path: Path, backends
) -> None:
    """Nothing but time passes (no request, no GET /health): the gauge must not say
    ejected for good."""
    bad, good = backends("drop"), backends("ok")
    base_s = 1.0
    bridge = PatchedBridge(
        tmp_path, base_s, prefillers=[], decoders=[(bad.url, []), (good.url, [])],
        health_interval_s=0.2,
    )  # fmt: skip
    try:
        bridge.start()
        all_up(bridge)
        until_it_got(bridge, bad, EJECT_AFTER_FAILURES, STREAM)
        assert metric(bridge, "backend_ejections_total", bad) == 1
        time.sleep(base_s + 0.5)
        assert metric(bridge, "backend_ejected", bad) == 0
        assert report(bridge)[bad.url].get("probation") is True
    finally:
        bridge.stop()

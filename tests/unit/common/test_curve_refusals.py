"""Why a CURVE server refused a connection, as counted by CurveGuard, against real
ZMQ sockets on loopback: a client without CURVE is `no_key` (libzmq reports it as a
protocol error, mechanism mismatch), one with the wrong server key `bad_handshake`, one
whose key is not allowed `unknown_key`."""

from __future__ import annotations

import time

import pytest
import zmq

from kvmesh.common.observability import Metrics
from kvmesh.common.transport.curve import CurveGuard, CurveKeys


@pytest.fixture
def server():
    ctx = zmq.Context()
    pub, sec = zmq.curve_keypair()
    allowed_pub, allowed_sec = zmq.curve_keypair()
    keys = CurveKeys(pub, sec, allowed_pub, allowed_sec, frozenset({allowed_pub}))
    guard = CurveGuard(ctx, keys, Metrics(), "test")
    sock = ctx.socket(zmq.ROUTER)
    sock.linger = 0
    guard.serve(sock)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    yield ctx, guard, keys, f"tcp://127.0.0.1:{port}"
    sock.close()
    guard.close()
    ctx.term()


def attempt(ctx: zmq.Context, url: str, public=None, secret=None, server=None) -> None:
    c = ctx.socket(zmq.DEALER)
    c.linger = 0
    if public is not None:
        c.curve_publickey, c.curve_secretkey, c.curve_serverkey = public, secret, server
    c.connect(url)
    c.send(b"hello")
    time.sleep(0.3)
    c.close()


def counts(guard: CurveGuard) -> dict[str, float]:
    return {r: c._value.get() for r, c in guard.failures.items()}


def wait_counted(guard: CurveGuard, reason: str) -> dict[str, float]:
    deadline = time.monotonic() + 5
    while counts(guard)[reason] < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    return counts(guard)


def test_a_client_without_curve_is_no_key(server) -> None:
    ctx, guard, _keys, url = server
    attempt(ctx, url)
    found = wait_counted(guard, "no_key")
    assert found["no_key"] >= 1 and found["bad_handshake"] == 0, found


def test_a_client_with_the_wrong_server_key_is_bad_handshake(server) -> None:
    ctx, guard, keys, url = server
    wrong, _ = zmq.curve_keypair()
    attempt(ctx, url, keys.client_public, keys.client_secret, wrong)
    found = wait_counted(guard, "bad_handshake")
    assert found["bad_handshake"] >= 1 and found["no_key"] == 0, found


def test_a_client_key_not_allowed_is_unknown_key(server) -> None:
    ctx, guard, keys, url = server
    other_pub, other_sec = zmq.curve_keypair()
    attempt(ctx, url, other_pub, other_sec, keys.server_public)
    found = wait_counted(guard, "unknown_key")
    assert found["unknown_key"] >= 1 and found["no_key"] == 0, found

"""Why a ZMQ server did not answer: connect once more, watch the socket's monitor
events, and name what the connection and the CURVE handshake did.

A server that refuses a client under CURVE sends it nothing at all, so a client only
sees a request time out, the same as for a stopped server. The handshake itself is
visible from the client's side, though: libzmq reports a refused key
(HANDSHAKE_FAILED_AUTH), a mechanism mismatch (one side CURVE, the other not), a
failed handshake (most often the wrong server key), or no TCP connection at all.
`kvmesh status` and `kvmesh doctor` add this to "no answer" so an operator reads
"the server refused this client's key" instead of guessing.

    why = handshake_problem("tcp://host:7600", keys, timeout_s=1.0)   # "" = nothing wrong seen

Blocking (a sync socket in a private context): call it in a thread from a loop.
"""

from __future__ import annotations

import time

import zmq
from zmq.utils.monitor import parse_monitor_message

from kvmesh.common.transport.curve import CurveKeys, apply_client
from kvmesh.common.transport.tcp_address import connect

_EVENTS = (
    zmq.EVENT_CONNECTED
    | zmq.EVENT_CLOSED
    | zmq.EVENT_CONNECT_RETRIED
    | zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL,
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
    zmq.EVENT_HANDSHAKE_FAILED_AUTH,
)
# libzmq retries a refused TCP connect every 100 ms by default: after a few refusals
# and no connection, nothing is listening.
_REFUSALS_FOR_NOTHING_LISTENING = 3
_FAILURES_FOR_NO_DETAIL = 3

REFUSED_KEY = (
    "CURVE: the server refused this client's key "
    "(its .key file is not in the servers' security.allowed_clients)"
)
NO_CLIENT_KEY = (
    "CURVE: the server requires CURVE and this client has no key "
    "(set security.server_key and security.client_key)"
)
SERVER_NOT_CURVE = (
    "CURVE: this client has keys but the server does not speak CURVE "
    "(no security.server_key on the server)"
)
WRONG_SERVER_KEY = (
    "CURVE: the handshake failed; the server's key pair is not the one "
    "security.server_key names here, or the server does not use CURVE"
)


def _explain(event: int, value: int, curve: bool) -> str:
    if not curve:
        return NO_CLIENT_KEY  # any failed handshake: only CURVE makes ours fail
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return REFUSED_KEY
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and (
        value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH
    ):
        return SERVER_NOT_CURVE
    return WRONG_SERVER_KEY


def handshake_problem(endpoint: str, keys: CurveKeys | None, timeout_s: float = 1.0) -> str:
    """What stops a client keyed with keys (None: CURVE off) at endpoint, as one line;
    "" when the handshake succeeded or nothing could be told within timeout_s (e.g. a
    connection accepted but never answered: the handshake then waits on the server)."""
    if not endpoint.startswith("tcp://"):
        return ""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    monitor = sock.get_monitor_socket(_EVENTS)
    try:
        apply_client(sock, keys, endpoint)
        connect(sock, endpoint)
        deadline = time.monotonic() + timeout_s
        connected, refusals, failures = False, 0, 0
        while (left := deadline - time.monotonic()) > 0:
            if not monitor.poll(max(1, int(left * 1000))):
                break
            msg = parse_monitor_message(monitor.recv_multipart())
            event, value = msg["event"], msg["value"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                return ""
            if event in _FAILED:
                why = _explain(event, value, keys is not None)
                failures += 1
                # "No detail" is what a wrong server key and (sometimes, racing the
                # mismatch report) a server without CURVE both give: a few retries
                # tell them apart; the other answers are certain at once.
                if why != WRONG_SERVER_KEY or failures >= _FAILURES_FOR_NO_DETAIL:
                    return why
            if event == zmq.EVENT_CONNECTED:
                connected = True
            elif event in (zmq.EVENT_CLOSED, zmq.EVENT_CONNECT_RETRIED) and not connected:
                refusals += 1
                if refusals >= _REFUSALS_FOR_NOTHING_LISTENING:
                    return f"nothing accepts connections at {endpoint}"
        if failures:
            return WRONG_SERVER_KEY
        if not connected:
            return f"no TCP connection to {endpoint} within {timeout_s:g}s"
        return ""
    finally:
        sock.disable_monitor()
        monitor.close(linger=0)
        sock.close(linger=0)
        ctx.term()

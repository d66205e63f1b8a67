"""common/observability/metrics.serve_metrics (the engine's metrics_port): a client that
hangs up before its answer is written costs no traceback on stderr (vLLM's log), and
the endpoint keeps serving. Found by tests/fuzz."""

from __future__ import annotations

import socket
import struct
import urllib.request

from kvmesh.common.observability import Metrics
from kvmesh.common.observability.metrics import serve_metrics


def test_clients_that_hang_up_leave_no_traceback(capfd) -> None:
    metrics = Metrics()
    metrics.counter("hangup_test_total", "A counter").inc()
    server = serve_metrics(metrics, 0)
    port = server.server_address[1]
    try:
        for _ in range(30):
            with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
                # A bad request line, then a reset (linger 0) before the 400 is written.
                sock.sendall(b"GARBAGE\r\n\r\n" + b"x" * 65536)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        url = f"http://127.0.0.1:{port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as resp:
            assert b"kvmesh_hangup_test_total 1.0" in resp.read()
    finally:
        server.shutdown()
        server.server_close()
    assert "Traceback" not in capfd.readouterr().err

"""common/observability/metrics.serve_metrics (the engine's metrics_port): a client that
hangs up before its answer is written costs no traceback on stderr (vLLM's log), and
the endpoint keeps serving. Found by tests/fuzz."""

from __future__ import annotations

import socket
import struct
import urllib.error
import urllib.request

from kvtest.waiting import wait_for

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


def test_a_dripping_client_is_cut_at_the_request_deadline_and_handlers_are_capped(
    monkeypatch,
) -> None:
    """The handler's timeout bounds each read only: a client sending a header byte at a
    time must still lose its thread at the whole-request deadline, and clients past
    the cap are refused instead of each getting a thread."""
    import time

    from kvmesh.common.observability import metrics as m

    monkeypatch.setattr(m._ThreadingServer, "request_deadline_s", 1.0, raising=False)
    monkeypatch.setattr(m._ThreadingServer, "max_handlers", 2, raising=False)
    srv = serve_metrics(Metrics(), 0)
    port = srv.server_address[1]
    try:
        drips = [socket.create_connection(("127.0.0.1", port)) for _ in range(2)]
        for s in drips:
            s.sendall(b"GET /metrics HTTP/1.1\r\n")
        time.sleep(0.3)
        with socket.create_connection(("127.0.0.1", port), timeout=5) as third:
            third.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            assert third.recv(100).startswith(b"HTTP/1.0 503")
        cut = []
        t0 = time.monotonic()
        while len(cut) < 2 and time.monotonic() - t0 < 5:
            for s in drips:
                if s in cut:
                    continue
                try:
                    s.sendall(b"X")
                    s.settimeout(0.01)
                    if s.recv(100) == b"":
                        cut.append(s)
                except TimeoutError:
                    pass
                except OSError:
                    cut.append(s)
            time.sleep(0.2)
        assert len(cut) == 2, "a dripping client kept its thread past the deadline"
        assert time.monotonic() - t0 < 3

        # The client sees the cut (the socket shut) before the handler's thread has
        # returned and given its slot back: scrapes are refused 503 until then.
        def scraped() -> int | None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                    return r.status
            except urllib.error.HTTPError as exc:
                assert exc.code == 503, exc
                return None

        assert wait_for(scraped, 5, "a handler slot free again after the cut") == 200
        for s in drips:
            s.close()
    finally:
        srv.shutdown()
        srv.server_close()

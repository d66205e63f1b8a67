"""Prometheus metrics through prometheus-client, one registry per component.

Each component (an engine, a service) owns a `Metrics` with its own
CollectorRegistry rather than the library's global one: a test process or a
vLLM worker may hold several engines, and two of them registering the same
metric name in one global registry would fail.
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import msgspec
import prometheus_client as prom
from prometheus_client.core import CollectorRegistry

from kvmesh.common.transport.tcp_address import ipv4_first

PREFIX = "kvmesh_"

# Latency buckets from 10 µs to 10 s: cache operations span that whole range.
LATENCY_BUCKETS: tuple[float, ...] = (
    1e-5,
    2.5e-5,
    5e-5,
    1e-4,
    2.5e-4,
    5e-4,
    1e-3,
    2.5e-3,
    5e-3,
    1e-2,
    2.5e-2,
    5e-2,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)


class Metrics:
    """Factory and cache of the metrics of one component, under the `kvmesh_` prefix."""

    def __init__(self, const_labels: dict[str, str] | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._labels = dict(const_labels or {})
        self._made: dict[str, prom.metrics.MetricWrapperBase] = {}
        self._lock = threading.Lock()

    def _get(self, kind: type, name: str, doc: str, labels: Sequence[str], **kw: object):
        full = name if name.startswith(PREFIX) else PREFIX + name
        with self._lock:
            metric = self._made.get(full)
            if metric is None:
                metric = kind(
                    full,
                    doc,
                    labelnames=tuple(labels) + tuple(self._labels),
                    registry=self.registry,
                    **kw,
                )
                self._made[full] = metric
            elif not isinstance(metric, kind):
                raise ValueError(f"metric {full} already exists as {type(metric).__name__}")
        if self._labels:
            return _BoundLabels(metric, self._labels)
        return metric

    def counter(self, name: str, doc: str, labels: Sequence[str] = ()) -> prom.Counter:
        return self._get(prom.Counter, name, doc, labels)

    def gauge(self, name: str, doc: str, labels: Sequence[str] = ()) -> prom.Gauge:
        return self._get(prom.Gauge, name, doc, labels)

    def histogram(
        self,
        name: str,
        doc: str,
        labels: Sequence[str] = (),
        buckets: Iterable[float] = LATENCY_BUCKETS,
    ) -> prom.Histogram:
        return self._get(prom.Histogram, name, doc, labels, buckets=tuple(buckets))

    def render(self) -> bytes:
        """The registry in the Prometheus text format."""
        return prom.generate_latest(self.registry)

    def value(self, name: str, labels: dict[str, str] | None = None) -> float | None:
        """The current value of one sample, for tests and status views."""
        full = name if name.startswith(PREFIX) else PREFIX + name
        return self.registry.get_sample_value(full, {**(labels or {}), **self._labels})


class _BoundLabels:
    """Adds the component's constant labels to every `.labels(...)` call."""

    def __init__(self, metric: prom.metrics.MetricWrapperBase, const: dict[str, str]) -> None:
        self._metric = metric
        self._const = const

    def labels(self, *args: str, **kwargs: str):
        if args:
            names = [n for n in self._metric._labelnames if n not in self._const]
            kwargs.update(zip(names, args, strict=True))
        return self._metric.labels(**kwargs, **self._const)

    def __getattr__(self, attr: str):
        # Unlabelled use (inc, set, observe) of a metric that has only constant labels.
        # The child's method is kept on the instance: `.labels()` costs microseconds,
        # too much for a counter bumped on every request.
        value = getattr(self._metric.labels(**self._const), attr)
        if callable(value):
            setattr(self, attr, value)
        return value


def serve_metrics(
    metrics: Metrics,
    port: int,
    host: str = "127.0.0.1",
    health: Callable[[], object] | None = None,
) -> WSGIServer:
    """Serve one component's /metrics and /health over HTTP on a daemon thread; port 0
    picks one. Stop with `shutdown()` then `server_close()` (which frees the port).

    GET /metrics            the Prometheus text (or OpenMetrics, by the Accept header:
                            prometheus_client's own negotiation, gzip included)
    GET /health, /healthz   200 and `health()` encoded as JSON (msgspec: a Struct or a
                            dict); 500 with the error when it raises. Without `health`,
                            {"status": "ok"}: answering at all is the liveness.

    HEAD works on each; any other method gets 405, any other path 404. A thread per
    request, never the component's event loop: in a vLLM worker that loop does cache
    I/O, and a slow scraper must not stall it (nor it the scraper)."""
    family, addr = _best_family(host, port)
    server_cls = type("_ProbeServer", (_ThreadingServer,), {"address_family": family})
    app = _ProbeApp(prom.make_wsgi_app(metrics.registry), health)
    server = make_server(addr, port, app, server_cls, handler_class=_QuietHandler)
    server.handle_error = _QuietHangups(server.handle_error)  # type: ignore[method-assign]
    thread = threading.Thread(target=server.serve_forever, name="kvmesh-metrics-http", daemon=True)
    thread.start()
    return server


HEALTH_PATHS = ("/health", "/healthz")
# Copied into each answer's headers: wsgiref adds Content-Length to the list it is given.
_JSON = ("Content-Type", "application/json")
_TEXT = ("Content-Type", "text/plain; charset=utf-8")


class _ProbeApp:
    """The WSGI router of `serve_metrics`."""

    def __init__(
        self, metrics_app: Callable[..., Iterable[bytes]], health: Callable[[], object] | None
    ) -> None:
        self._metrics_app = metrics_app
        self._health = health

    def __call__(
        self, environ: dict[str, Any], start_response: Callable[..., Any]
    ) -> Iterable[bytes]:
        method = environ.get("REQUEST_METHOD", "")
        path = environ.get("PATH_INFO", "")
        if method not in ("GET", "HEAD"):
            start_response("405 Method Not Allowed", [_TEXT, ("Allow", "GET, HEAD")])
            return [b"GET only\n"]
        if path == "/metrics":
            # prometheus_client answers HEAD with 405: ask it for a GET, send no body.
            body = self._metrics_app({**environ, "REQUEST_METHOD": "GET"}, start_response)
            return [] if method == "HEAD" else body
        if path in HEALTH_PATHS:
            status, body = self._health_body()
            start_response(status, [_JSON])
            return [] if method == "HEAD" else [body]
        start_response("404 Not Found", [_TEXT])
        return [b"try /metrics or /health\n"]

    def _health_body(self) -> tuple[str, bytes]:
        if self._health is None:
            return "200 OK", b'{"status":"ok"}'
        try:
            return "200 OK", msgspec.json.encode(self._health())
        except Exception as exc:
            # A bug in the report, not an outage: say so, without taking the process down.
            error = {"status": "error", "error": f"{type(exc).__name__}: {exc}"}
            return "500 Internal Server Error", msgspec.json.encode(error)


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    """One thread per request, none of which keeps the process alive at exit.

    The server may face a network (metrics_host 0.0.0.0): at most `max_handlers`
    requests at once, each cut after `request_deadline_s` in all. The handler's
    timeout bounds each read only, so a client sending a byte at a time would
    otherwise hold its thread for ever, and enough of them the process. A client
    over the cap gets a 503 (see `_Refuser`)."""

    daemon_threads = True
    max_handlers = 32
    # socketserver's default backlog of 5 made a burst of scrapes wait a SYN resend (1 s).
    request_queue_size = 128
    request_deadline_s = 20.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._slots = threading.BoundedSemaphore(self.max_handlers)
        self._refuser = _Refuser()

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self._refuser.refuse(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        # shutdown, not close: the handler's blocked read or write returns, and the fd
        # stays the handler's to close (a closed one could be reused under it).
        cut = threading.Timer(self.request_deadline_s, _shut, (request,))
        cut.daemon = True
        cut.start()
        try:
            super().process_request_thread(request, client_address)
        finally:
            cut.cancel()
            self._slots.release()

    def server_close(self) -> None:
        super().server_close()
        self._refuser.close()


_BUSY = b"HTTP/1.0 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"


class _Refuser:
    """Answers the clients over the handler cap with a 503 they can read.

    Closing a socket whose request bytes are unread (or arrive after the close) makes
    Linux send RST, and a client still writing its request then fails with EPIPE or
    ECONNRESET instead of reading the 503. So the accepting thread only writes the
    503 and shuts the write side (a fresh socket's send buffer takes those bytes
    without blocking), and one daemon thread reads and drops what the client sends
    until its EOF, `linger_s` or `max_drain` bytes, then closes. At most
    `max_pending` such sockets at once: one more is closed at once, as a flood past
    that bound is not a scraper to be polite to."""

    max_pending = 64
    linger_s = 1.0
    max_drain = 65536

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._new: list[socket.socket] = []
        self._pending = 0
        self._closed = False
        # Made at the first refusal: most servers never refuse anyone.
        self._thread: threading.Thread | None = None
        self._wake: tuple[socket.socket, socket.socket] | None = None

    def refuse(self, request: socket.socket) -> None:
        """Called on the accepting thread; never waits."""
        with contextlib.suppress(OSError):
            request.sendall(_BUSY)
            request.shutdown(socket.SHUT_WR)
        with self._lock:
            keep = not self._closed and self._pending < self.max_pending and self._started()
            if keep:
                self._pending += 1
                self._new.append(request)
        if not keep:
            request.close()
            return
        self._poke()

    def close(self) -> None:
        """Closes every socket still draining, and ends the thread."""
        with self._lock:
            self._closed = True
        self._poke()
        if self._thread is not None:
            self._thread.join(5.0)

    def _started(self) -> bool:
        """Whether the thread runs, started now if need be (under self._lock)."""
        if self._thread is not None:
            return True
        try:
            if self._wake is None:
                self._wake = socket.socketpair()
                for s in self._wake:
                    s.setblocking(False)
            thread = threading.Thread(target=self._run, name="kvmesh-metrics-refuser", daemon=True)
            thread.start()
        except (OSError, RuntimeError):
            # No fd or thread to spare: this client is closed at once, as before.
            return False
        self._thread = thread
        return True

    def _poke(self) -> None:
        if self._wake is not None:
            # A full pipe (BlockingIOError) means the thread has wake-ups waiting already.
            with contextlib.suppress(OSError):
                self._wake[1].send(b"\0")

    def _run(self) -> None:
        assert self._wake is not None
        wake_r, wake_w = self._wake
        sel = selectors.DefaultSelector()
        sel.register(wake_r, selectors.EVENT_READ)
        draining: dict[socket.socket, list[float]] = {}  # sock -> [deadline, bytes read]
        try:
            while True:
                now = time.monotonic()
                wait = max(0.0, min(d for d, _ in draining.values()) - now) if draining else None
                for key, _ in sel.select(wait):
                    sock = key.fileobj
                    if sock is wake_r:
                        with contextlib.suppress(OSError):
                            wake_r.recv(4096)
                        continue
                    assert isinstance(sock, socket.socket)
                    try:
                        data = sock.recv(16384)
                    except BlockingIOError:
                        continue
                    except OSError:
                        data = b""
                    draining[sock][1] += len(data)
                    if not data or draining[sock][1] >= self.max_drain:
                        self._drop(sel, draining, sock)
                with self._lock:
                    new, self._new = self._new, []
                    closed = self._closed
                deadline = time.monotonic() + self.linger_s
                for sock in new:
                    draining[sock] = [deadline, 0.0]
                    try:
                        sock.setblocking(False)
                        sel.register(sock, selectors.EVENT_READ)
                    except (OSError, ValueError):
                        self._drop(sel, draining, sock)
                now = time.monotonic()
                for sock in [s for s, (d, _) in draining.items() if closed or d <= now]:
                    self._drop(sel, draining, sock)
                if closed:
                    return
        finally:
            # Whatever ended the thread, later refusals close at once (no one drains).
            with self._lock:
                self._closed = True
                for sock in self._new:
                    draining.setdefault(sock, [0.0, 0.0])
                self._new = []
            for sock in list(draining):
                self._drop(sel, draining, sock)
            sel.close()
            wake_r.close()
            wake_w.close()

    def _drop(
        self,
        sel: selectors.BaseSelector,
        draining: dict[socket.socket, list[float]],
        sock: socket.socket,
    ) -> None:
        with contextlib.suppress(KeyError, ValueError):
            sel.unregister(sock)
        draining.pop(sock, None)
        sock.close()
        with self._lock:
            self._pending -= 1


def _shut(request: socket.socket) -> None:
    with contextlib.suppress(OSError):
        request.shutdown(socket.SHUT_RDWR)


class _QuietHandler(WSGIRequestHandler):
    """No access log on stderr (vLLM's log); a client that sends nothing is dropped
    after `timeout` instead of holding its thread."""

    timeout = 10.0

    def log_message(self, format: str, *args: Any) -> None:
        pass


def _best_family(host: str, port: int) -> tuple[socket.AddressFamily, str]:
    """The address family of host (an IPv6 literal such as "::" needs AF_INET6)."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, _, _, _, sockaddr = ipv4_first(infos)
    return family, str(sockaddr[0])


class _QuietHangups:
    """socketserver's handle_error, less the traceback it prints on stderr (vLLM's own
    log) for a client that hung up before its answer was written: a port scan, a
    scraper that timed out. That is not an error of ours; anything else still is."""

    def __init__(self, handle_error: Callable[[Any, Any], None]) -> None:
        self._handle_error = handle_error

    def __call__(self, request: Any, client_address: Any) -> None:
        if isinstance(sys.exc_info()[1], ConnectionError | TimeoutError):
            return
        self._handle_error(request, client_address)

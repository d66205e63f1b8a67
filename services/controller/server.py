"""The controller: one asyncio process holding the cluster registry.

Listeners:
- a ZMQ ROUTER (`host:port`) speaking common/protocol/controller.py to workers and
  admin clients (KV events travel on it too: see that module for why);
- optionally HTTP (`http_port`): the JSON admin API, `/metrics`, `/health` (http.py).

One reader callback on the event loop drains the ROUTER socket, decodes each message
with one reused decoder and dispatches through the handler table (handlers.py); admin
commands, which wait on workers, run as tasks. Plain ZMQ sockets read from the loop's
selector, as in the cache-server: no future or task per message, which is what lets
one core ingest hundreds of thousands of KV events a second.

Housekeeping drops workers silent for `heartbeat_misses` of their heartbeat periods
and writes the registry snapshot every `snapshot_interval_s` (and on stop); a
restarted controller loads it first, so lookups are answered from it until the
workers re-register and send their full state (or are dropped for silence).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import socket
import time
from pathlib import Path
from typing import Any

import msgspec
import zmq

from kvmesh.common.config import ControllerConfig
from kvmesh.common.observability import get_logger
from kvmesh.common.protocol import controller as proto
from kvmesh.common.protocol.controller import ErrorCode
from kvmesh.services.controller.admin import AdminFanout
from kvmesh.services.controller.handlers import Handlers
from kvmesh.services.controller.http import AdminHttp
from kvmesh.services.controller.registry import Registry
from kvmesh.services.controller.stats import ControllerStats

log = get_logger(__name__)

DRAIN_BATCH = 256
HOUSEKEEPING_S = 0.1
SESSION_IDLE_S = 600.0
MAX_INFLIGHT_TASKS = 256
MAX_MESSAGE_BYTES = 64 << 20
FREEZE_S = 1.0


class ControllerServer:
    """Build with a config, `await start()`, then `await wait_closed()` or `stop()`."""

    def __init__(self, config: ControllerConfig, *, name: str = "kvmesh-controller") -> None:
        self.config = config
        self.name = name
        self.stats = ControllerStats()
        self.registry = Registry()
        self.fanout = AdminFanout(self.push, config.admin_timeout_s)
        self.handlers = Handlers(
            self.registry, self.stats, self.fanout, self.push, server_name=name
        )
        self.sessions: dict[bytes, float] = {}
        self.started = time.monotonic()
        self._ctx = zmq.Context()
        self._sock: zmq.Socket | None = None
        self._tasks: list[asyncio.Task] = []
        self._inflight: set[asyncio.Task] = set()
        self._stopped = asyncio.Event()
        self._closed = asyncio.Event()
        self.http: AdminHttp | None = None
        self.port = 0
        self.restored_workers = 0

    # -- lifecycle ----------------------------------------------------------------------
    async def start(self) -> None:
        cfg = self.config
        if cfg.snapshot_path:
            data = await asyncio.to_thread(_read_if_exists, cfg.snapshot_path)
            try:
                if data is not None:
                    self.restored_workers = self.registry.load(data)
            except (msgspec.DecodeError, ValueError) as exc:
                log.error("snapshot unreadable, starting empty", error=str(exc))
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 100_000)
        sock.setsockopt(zmq.RCVHWM, 100_000)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
        endpoint = f"tcp://{_zmq_host(cfg.host)}"
        if cfg.port:
            sock.bind(f"{endpoint}:{cfg.port}")
            self.port = cfg.port
        else:
            self.port = sock.bind_to_random_port(endpoint)
        self._sock = sock
        loop = asyncio.get_running_loop()
        loop.add_reader(sock.getsockopt(zmq.FD), self._on_readable)
        loop.call_soon(self._on_readable)
        self._tasks = [asyncio.create_task(self._housekeeping(), name="controller-housekeeping")]
        http_port = cfg.http_port or cfg.metrics_port
        if http_port:
            self.http = AdminHttp(self, cfg.host)
            await self.http.start(http_port)
        self._update_gauges()
        log.info(
            "controller ready",
            port=self.port,
            http_port=self.http.port if self.http else None,
            restored_workers=self.restored_workers,
            restored_chunks=self.registry.chunks_total(),
        )

    async def stop(self) -> None:
        """Stop serving: snapshot, cancel tasks, then close the socket, then the context."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        if self.http is not None:
            await self.http.stop()
        tasks = [*self._tasks, *self._inflight]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.config.snapshot_path:
            await self.save_snapshot()
        sock, self._sock = self._sock, None
        if sock is not None:
            asyncio.get_running_loop().remove_reader(sock.getsockopt(zmq.FD))
            sock.close(linger=0)
        self._ctx.term()
        log.info("controller stopped")
        self._closed.set()

    async def wait_closed(self) -> None:
        await self._closed.wait()

    def health_report(self) -> dict[str, Any]:
        return {
            "status": "ok",
            "uptime_s": round(time.monotonic() - self.started, 3),
            "workers": len(self.registry.workers),
            "chunks": self.registry.chunks_total(),
            "protocol_version": proto.PROTOCOL_VERSION,
        }

    # -- the ROUTER loop ----------------------------------------------------------------
    def _on_readable(self) -> None:
        """Serve what the socket holds (ZMQ's FD is edge-triggered, so drain it), at most
        DRAIN_BATCH messages per turn so timers and other callbacks still run."""
        sock = self._sock
        if sock is None:
            return
        for _ in range(DRAIN_BATCH):
            if not sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                return
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            if len(frames) < 2:
                continue  # nothing to answer to
            try:
                self._dispatch(frames[0].bytes, frames[1].buffer, len(frames))
            except Exception:  # a bug must not stop serving everyone else
                log.exception("dispatch failed")
                self.stats.errors[ErrorCode.INTERNAL].inc()
        asyncio.get_running_loop().call_soon(self._on_readable)

    def _dispatch(self, peer: bytes, raw: memoryview, nframes: int) -> None:
        try:
            msg = proto.decode_request(raw)
        except proto.MalformedMessage as exc:
            self.stats.requests["invalid"].inc()
            self.stats.errors[ErrorCode(exc.reply.code)].inc()
            self.push(peer, exc.reply)
            return
        op = msg.__struct_config__.tag
        self.stats.requests[op].inc()
        if nframes != 2:
            self.push(peer, proto.error_reply(msg.rid, ErrorCode.BAD_MESSAGE, "one frame expected"))
            return
        if isinstance(msg, proto.Hello):
            self.push(peer, self._hello(peer, msg))
            return
        if peer not in self.sessions:
            self.stats.errors[ErrorCode.NO_HELLO].inc()
            self.push(peer, proto.error_reply(msg.rid, ErrorCode.NO_HELLO, "say hello first"))
            return
        self.sessions[peer] = time.monotonic()
        handler = self.handlers.table.get(type(msg))
        if handler is not None:
            reply = handler(peer, msg)
            if reply is not None:
                self.push(peer, reply)
            return
        if len(self._inflight) >= MAX_INFLIGHT_TASKS:
            self.push(peer, proto.error_reply(msg.rid, ErrorCode.SHUTTING_DOWN, "busy, retry"))
            return
        task = asyncio.get_running_loop().create_task(
            self._handle_async(peer, self.handlers.async_table[type(msg)], msg)
        )
        self._inflight.add(task)
        task.add_done_callback(self._inflight.discard)

    async def _handle_async(self, peer: bytes, handler: Any, msg: Any) -> None:
        try:
            reply = await handler(peer, msg)
        except Exception as exc:  # a bug: answer, log, keep serving
            log.exception("handler failed", op=msg.__struct_config__.tag)
            self.stats.errors[ErrorCode.INTERNAL].inc()
            reply = proto.error_reply(msg.rid, ErrorCode.INTERNAL, repr(exc))
        self.push(peer, reply)
        self._on_readable()  # the send may have swallowed the FD's edge

    def _hello(self, peer: bytes, msg: proto.Hello) -> Any:
        if msg.version != proto.PROTOCOL_VERSION:
            self.stats.errors[ErrorCode.VERSION_MISMATCH].inc()
            return proto.error_reply(
                msg.rid,
                ErrorCode.VERSION_MISMATCH,
                f"controller speaks protocol version {proto.PROTOCOL_VERSION}, "
                f"client {msg.version}",
            )
        self.sessions[peer] = time.monotonic()
        return proto.HelloReply(msg.rid, proto.PROTOCOL_VERSION, self.name)

    def push(self, peer: bytes, msg: Any) -> bool:
        """Send one message to a peer; False when it could not go out."""
        sock = self._sock
        if sock is None:
            return False
        try:
            # ROUTER never blocks: a message for a gone (or far behind) peer is dropped.
            sock.send_multipart([peer, proto.encode(msg)], zmq.NOBLOCK, copy=False)
            return True
        except zmq.ZMQError as exc:
            log.debug("message not sent", error=str(exc))
            return False

    # -- background ---------------------------------------------------------------------
    async def _housekeeping(self) -> None:
        last_snapshot = last_freeze = time.monotonic()
        while True:
            await asyncio.sleep(HOUSEKEEPING_S)
            now = time.monotonic()
            if now - last_freeze >= FREEZE_S:
                # The registry's per-worker chunk sets are GC-tracked: a full collection
                # walks them all (~85 ms per million chunks, stalling every request).
                # They hold only ints and form no cycles, so move everything alive
                # out of the collector's reach; new objects are young again.
                last_freeze = now
                gc.freeze()
            self.drop_silent(now)
            for peer in [p for p, t in self.sessions.items() if now - t > SESSION_IDLE_S]:
                del self.sessions[peer]
            self._update_gauges()
            if self.config.snapshot_path and now - last_snapshot >= self.config.snapshot_interval_s:
                last_snapshot = now
                await self.save_snapshot()

    def drop_silent(self, now: float) -> list[str]:
        misses = self.config.heartbeat_misses
        silent = [
            e.worker_id
            for e in self.registry.workers.values()
            if now - e.last_seen > misses * e.heartbeat_s
        ]
        for worker_id in silent:
            n = self.registry.drop(worker_id)
            self.stats.dropped_by["heartbeat"].inc()
            log.warning("worker dropped: missed heartbeats", worker=worker_id, chunks=n)
        return silent

    def _update_gauges(self) -> None:
        self.stats.workers.set(len(self.registry.workers))
        self.stats.chunks.set(self.registry.chunks_total())

    async def save_snapshot(self) -> None:
        """Encode on the loop (a consistent view), write and rename in a thread."""
        t0 = time.perf_counter()
        data = self.registry.snapshot()
        path = self.config.snapshot_path
        try:
            await asyncio.to_thread(_write_atomic, path, data)
        except OSError as exc:
            log.error("snapshot not written", path=path, error=str(exc))
            return
        self.stats.snapshots.inc()
        self.stats.snapshot_seconds.set(time.perf_counter() - t0)


def _read_if_exists(path: str) -> bytes | None:
    try:
        return Path(path).read_bytes()
    except FileNotFoundError:
        return None


def _write_atomic(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _zmq_host(host: str) -> str:
    """ZMQ wants an interface or an address: resolve a host name once."""
    if host in ("", "0.0.0.0", "*"):
        return "*"
    with contextlib.suppress(OSError):
        return socket.gethostbyname(host)
    return host

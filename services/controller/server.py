"""The controller: one asyncio process holding the cluster registry.

Listeners:
- a ZMQ ROUTER (`host:port`) speaking common/protocol/controller.py to workers and
  admin clients (KV events travel on it too: see that module for why);
- optionally HTTP (`http_port`): the JSON admin API, `/metrics`, `/health` (http.py);
- optionally the KV-event feed: an XPUB (`events_port`, event_pub.py) and its replay
  ROUTER (`events_replay_port`, event_replay.py).

Lookup-servers follow the registry through the ROUTER too: they subscribe, get a
snapshot, then every change pushed (index_feed.py).

The ROUTER is served from the event loop's selector, as in the cache-server
(common/transport/router_loop.py: no future or task per message, which is what lets
one core ingest hundreds of thousands of KV events a second); each decoded message goes
through the handler table (handlers.py), and admin commands, which wait on workers,
run as tasks.

Housekeeping drops workers silent for `heartbeat_misses` of their heartbeat periods
and writes the registry snapshot every `snapshot_interval_s` (and on stop); a
restarted controller loads it first, so lookups are answered from it until the
workers re-register and send their full state (or are dropped for silence, given at
least RESTORED_GRACE_S to come back).
"""

from __future__ import annotations

import asyncio
import gc
import os
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import msgspec
import zmq

from kvmesh.common.config import ControllerConfig
from kvmesh.common.observability import get_logger
from kvmesh.common.protocol import controller as proto
from kvmesh.common.protocol.controller import ErrorCode
from kvmesh.common.transport.curve import CurveGuard, CurveKeys
from kvmesh.common.transport.router_loop import Answer, RouterLoop
from kvmesh.common.transport.tcp_address import bind_host_async
from kvmesh.services.controller.admin import AdminFanout
from kvmesh.services.controller.event_pub import EventPublisher
from kvmesh.services.controller.event_replay import EventReplay
from kvmesh.services.controller.handlers import Handlers
from kvmesh.services.controller.http import AdminHttp
from kvmesh.services.controller.index_feed import IndexFeed
from kvmesh.services.controller.registry import PackedWorker, Registry, encode_snapshot
from kvmesh.services.controller.stats import ControllerStats

log = get_logger(__name__)

HOUSEKEEPING_S = 0.1
SESSION_IDLE_S = 600.0
MAX_INFLIGHT_TASKS = 256
MAX_MESSAGE_BYTES = 64 << 20
FREEZE_S = 1.0
# A worker restored from the snapshot has to notice the restart and reach us again
# (its heartbeat request times out, then it retries): a few of its heartbeat periods may
# be less than that, and dropping it would empty the index until it re-registers.
RESTORED_GRACE_S = 3.0


class ControllerServer:
    """Build with a config, `await start()`, then `await wait_closed()` or `stop()`."""

    def __init__(
        self,
        config: ControllerConfig,
        *,
        name: str = "kvmesh-controller",
        curve: CurveKeys | None = None,
        http_token: str = "",
    ) -> None:
        self.config = config
        self.curve = curve
        self.http_token = http_token
        self.guard: CurveGuard | None = None
        self.name = name
        self.stats = ControllerStats()
        self.registry = Registry()
        self.fanout = AdminFanout(self.push, config.admin_timeout_s, self._peer_of)
        self.feed = IndexFeed(
            self.registry,
            self.push,
            self.stats,
            max_subscribers=config.max_index_subscribers,
            timeout_s=config.index_subscriber_timeout_s,
        )
        self.events_pub = (
            EventPublisher(
                self.stats.metrics,
                replay_size=config.events_replay_size if config.events_replay_port else 0,
            )
            if config.events_port
            else None
        )
        self.events_replay: EventReplay | None = None
        self.handlers = Handlers(
            self.registry,
            self.stats,
            self.fanout,
            self.push,
            server_name=name,
            feed=self.feed,
            events_pub=self.events_pub,
        )
        self.sessions: dict[bytes, float] = {}
        self.started = time.monotonic()
        self._ctx = zmq.Context()
        self.router = RouterLoop(self._ctx, proto.codec, self._dispatch, self.stats)
        self._tasks: list[asyncio.Task] = []
        self._stopped = asyncio.Event()
        self._closed = asyncio.Event()
        self.http: AdminHttp | None = None
        self.port = 0
        self.restored_workers = 0
        self._writing: asyncio.Future[None] | None = None  # the snapshot write in a thread
        self._served = False  # start() finished

    def _peer_of(self, worker_id: str) -> bytes | None:
        entry = self.registry.workers.get(worker_id)
        return None if entry is None else entry.peer

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
        self.guard = CurveGuard(self._ctx, self.curve, self.stats.metrics, "controller")
        host = await bind_host_async(cfg.host)  # once, off the loop, for the ZMQ binds
        self.port = self.router.start(
            host, cfg.port, max_message_bytes=MAX_MESSAGE_BYTES, secure=self.guard.serve
        )
        if self.events_pub is not None:
            self.events_pub.start(self._ctx, host, cfg.events_port, self.guard.serve)
            if cfg.events_replay_port:
                self.events_replay = EventReplay(self._ctx, self.events_pub, self.stats.metrics)
                self.events_replay.start(host, cfg.events_replay_port, self.guard.serve)
        self._tasks = [asyncio.create_task(self._housekeeping(), name="controller-housekeeping")]
        http_port = cfg.http_port or cfg.metrics_port
        if http_port:
            self.http = AdminHttp(self, cfg.host, self.http_token)
            await self.http.start(http_port)
        now = time.monotonic()
        for entry in self.registry.workers.values():
            if entry.restored:  # silent since now, not since the snapshot was loaded
                entry.last_seen = now
        self._update_gauges()
        self._served = True
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
        tasks = [*self._tasks, *self.router.inflight]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.config.snapshot_path and self._served:
            # Not for a controller that never served: a port in use most likely means
            # another one runs on this config, and its snapshot is not ours to replace.
            if self._writing is not None:  # cancelled housekeeping's write runs on
                await asyncio.gather(self._writing, return_exceptions=True)
            await self.save_snapshot()
        self.router.close()
        if self.events_replay is not None:
            self.events_replay.close()
        if self.events_pub is not None:
            self.events_pub.close()
        if self.guard is not None:
            await asyncio.to_thread(self.guard.close)
        # destroy, not term: after a failed start a socket may be left open, and
        # term() would wait for it on the loop for ever.
        self._ctx.destroy(linger=0)
        log.info("controller stopped")
        self._closed.set()

    async def wait_closed(self) -> None:
        await self._closed.wait()

    def health_report(self) -> dict[str, Any]:
        report: dict[str, Any] = {
            "status": "ok",
            "uptime_s": round(time.monotonic() - self.started, 3),
            "workers": len(self.registry.workers),
            "chunks": self.registry.chunks_total(),
            "protocol_version": proto.PROTOCOL_VERSION,
            "index_subscribers": len(self.feed.subscribers),
        }
        if self.events_pub is not None:
            pub = self.events_pub
            report["event_feed"] = {"epoch": pub.epoch, "seq": pub.seq, "topics": len(pub.topics)}
        return report

    # -- requests -----------------------------------------------------------------------
    def _dispatch(self, peer: bytes, msg: Any, values: list) -> None:
        op = msg.__struct_config__.tag
        self.stats.requests[op].inc()
        if values:
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
        sized = self.handlers.sized_table.get(type(msg))
        if sized is not None:
            reply = sized(peer, msg, self.router.header_nbytes)
            if reply is not None:
                self.push(peer, reply)
            return
        handler = self.handlers.table.get(type(msg))
        # An index snapshot is a task too. A full state is one as well but is not
        # refused: a worker's batches wait for it from its handler's first step on.
        if (handler is None or isinstance(msg, proto.IndexSubscribe)) and len(
            self.router.inflight
        ) >= MAX_INFLIGHT_TASKS:
            self.push(peer, proto.error_reply(msg.rid, ErrorCode.SHUTTING_DOWN, "busy, retry"))
            return
        if handler is not None:
            reply = handler(peer, msg)
            if asyncio.iscoroutine(reply):  # begun in order here, finished by a task
                self.router.spawn(peer, msg, self._finish, reply)
            elif reply is not None:
                self.push(peer, reply)
            return
        handle = self.handlers.async_table[type(msg)]
        self.router.spawn(peer, msg, self._finish, handle(peer, msg))

    async def _finish(self, rest: Coroutine[Any, Any, Any]) -> Answer:
        return await rest, ()

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
        return self.router.send(peer, msg)

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
            while True:  # chunks of workers gone or replaced, a step per turn
                if self.registry.sweep():
                    break
                await asyncio.sleep(0)
            self.feed.expire(now)
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
            if now - e.last_seen
            > max(misses * e.heartbeat_s, RESTORED_GRACE_S if e.restored else 0.0)
        ]
        for worker_id in silent:
            if self.events_pub is not None:
                self.events_pub.left(self.registry.workers[worker_id], "dropped")
            n = self.registry.drop(worker_id)
            self.stats.dropped_by["heartbeat"].inc()
            log.warning("worker dropped: missed heartbeats", worker=worker_id, chunks=n)
        return silent

    def _update_gauges(self) -> None:
        self.stats.workers.set(len(self.registry.workers))
        self.stats.chunks.set(self.registry.chunks_total())

    async def save_snapshot(self) -> None:
        """Pack on the loop a step at a time, serving requests between steps
        (registry.pack_workers); encode, write and rename in a thread."""
        t0 = time.perf_counter()
        parts: list[PackedWorker] = []
        for _ in self.registry.pack_workers(parts):
            await asyncio.sleep(0)
        data = await asyncio.to_thread(encode_snapshot, parts)
        path = self.config.snapshot_path
        # A thread is not stopped by cancelling its caller: stop() waits for this one
        # before writing the same temp file itself.
        self._writing = asyncio.ensure_future(asyncio.to_thread(_write_atomic, path, data))
        try:
            await asyncio.shield(self._writing)
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

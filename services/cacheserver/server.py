"""The cache-server: the shared remote tier (L4), one asyncio process.

Listeners:
- a ZMQ ROUTER (`host:port`) speaking kvmesh's protocol (common/protocol/cacheserver.py);
- optionally LMCache's `lm://` protocol on `lm_port` (lm_listener.py);
- gets over plain TCP data connections on `data_port` (data_listener.py; not with CURVE);
- optionally HTTP on `metrics_port`: `/metrics` and `/healthz`, `/health`
  (common/observability/http.py).

The ROUTER is served from the event loop's selector (common/transport/router_loop.py),
which hands each decoded header to the handler table (handlers.py): memory operations
are answered inline, a get that reads the spill runs as a task.

Anything malformed gets an `ErrorReply` and a metric, never a crash: bytes that are
not ZMTP cost only their own connection (ZMQ drops it, or reads them as ZMTP 1.0
frames that then fail to decode), and a frame larger than the limit closes its
connection (ZMQ's MAXMSGSIZE). A peer from which no whole frame arrives within
stall_timeout_s of a heartbeat (one stalled or gone mid-way through a large put), or
that leaves what the server sent it unacknowledged that long, is disconnected, which
frees what it sent and what was queued for it.

Sessions and the connection limit: a client is served once it said hello (routing id
→ session). ZMQ gives no per-peer disconnect notice without its draft API, so the
open-connection count comes from the socket monitor (accepted − disconnected), and
sessions idle for `session_idle_s` are forgotten (their client just says hello
again). A hello is refused with TOO_MANY_CONNECTIONS while either count is at
`max_connections`.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq
from zmq.utils.monitor import parse_monitor_message

from kvmesh.common.config import CacheServerConfig
from kvmesh.common.observability import Metrics, get_logger
from kvmesh.common.observability.http import ProbeServer
from kvmesh.common.protocol import cacheserver as proto
from kvmesh.common.protocol.cacheserver import ErrorCode
from kvmesh.common.transport.curve import CurveGuard, CurveKeys
from kvmesh.common.transport.router_loop import Answer, RouterLoop
from kvmesh.common.transport.tcp_address import bind_host_async
from kvmesh.services.cacheserver.data_listener import DataListener
from kvmesh.services.cacheserver.handlers import Handlers, RequestError
from kvmesh.services.cacheserver.lm_listener import LmListener
from kvmesh.services.cacheserver.spill import DiskSpill
from kvmesh.services.cacheserver.stats import ServerStats
from kvmesh.services.cacheserver.store import MemoryStore

log = get_logger(__name__)

MAX_INFLIGHT_TASKS = 256
GAUGE_PERIOD_S = 1.0
# ZMTP heartbeats and TCP_USER_TIMEOUT, both at the config's stall_timeout_s. libzmq
# allocates a frame whole when its size is announced, so a client that sent part of a
# large put and then stalled (or whose host vanished without a FIN) held that memory
# for ever. The heartbeat's timeout is not reset by a frame still arriving, nor is a
# PONG sent before the peer's own frame ends: the timeout must outlast the slowest
# legitimate put (max_value_size over a busy link), hence a setting of its own rather
# than request_timeout_s. A peer that reads nothing gets no PING (one goes out only
# between frames): TCP's own timeout closes that one.
HEARTBEAT_MAX_IVL_S = 10.0


@dataclass(slots=True)
class _Session:
    client: str
    last_seen: float
    part_bytes: int = 0  # values longer than this go out in parts (0: never)


GET_REPLIES = (proto.GetValueReply, proto.GetValuesReply)


def in_parts(reply: Any, values: list, part: int) -> Answer:
    """A get's reply and value frames with each value longer than `part` bytes cut
    into frames of at most `part` (views of the stored value, no copy); unchanged for
    other replies, for `part` 0, and when every value fits in one frame."""
    if not part or not values or not isinstance(reply, GET_REPLIES):
        return reply, values
    frames: list[Any] = []
    counts: list[int] = []
    for value in values:
        view = memoryview(value).cast("B")
        pieces = [view[i : i + part] for i in range(0, len(view), part)] or [view]
        frames += pieces if len(pieces) > 1 else [value]
        counts.append(len(pieces))
    if len(frames) == len(values):
        return reply, values
    if isinstance(reply, proto.GetValueReply):
        return msgspec.structs.replace(reply, parts=counts[0]), frames
    return msgspec.structs.replace(reply, parts=counts), frames


class CacheServer:
    """Build with a config, `await start()`, then `await wait_closed()` or `stop()`."""

    def __init__(
        self,
        config: CacheServerConfig,
        *,
        name: str = "kvmesh-cacheserver",
        curve: CurveKeys | None = None,
    ) -> None:
        self.config = config
        self.curve = curve
        self.guard: CurveGuard | None = None
        self.name = name
        self.stats = ServerStats(Metrics())
        spill = None
        if config.spill_path:
            spill = DiskSpill(
                config.spill_path,
                int(config.spill_max_size),
                max_backlog=max(64 << 20, 2 * int(config.max_value_size)),
            )
        self.store = MemoryStore(
            int(config.max_memory), int(config.max_value_size), spill, on_evict=self._evicted
        )
        self.started = time.monotonic()
        self.handlers = Handlers(
            self.store,
            self.stats,
            server_name=name,
            request_timeout_s=config.request_timeout_s,
            started=self.started,
            connections=self.connections,
        )
        self.sessions: dict[bytes, _Session] = {}
        self.zmq_connections = 0
        self._ctx = zmq.Context()
        self.router = RouterLoop(self._ctx, proto.codec, self._dispatch, self.stats)
        self._tasks: list[asyncio.Task] = []
        self._stopped = asyncio.Event()
        self._closed = asyncio.Event()
        self.lm: LmListener | None = None
        self.data: DataListener | None = None
        self.http: ProbeServer | None = None
        self.port = 0
        self.stats.max_memory.set(int(config.max_memory))

    # -- lifecycle ----------------------------------------------------------------------
    async def start(self) -> None:
        cfg = self.config
        # The router's monitor (connection counts) also carries the refused handshakes.
        self.guard = guard = CurveGuard(self._ctx, self.curve, self.stats.metrics, "cacheserver")

        def prepare(sock: zmq.Socket) -> None:
            stall_ms = int(cfg.stall_timeout_s * 1000)
            ivl_s = min(HEARTBEAT_MAX_IVL_S, cfg.stall_timeout_s / 2)
            sock.setsockopt(zmq.HEARTBEAT_IVL, max(1, int(ivl_s * 1000)))
            sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, stall_ms)
            sock.setsockopt(zmq.TCP_MAXRT, stall_ms)
            guard.secure(sock)

        self.port = self.router.start(
            await bind_host_async(cfg.host),
            cfg.port,
            # Values are bounded by max_value_size, headers (up to MAX_BATCH keys) by a
            # few MiB.
            max_message_bytes=int(cfg.max_value_size) + (8 << 20),
            max_frames=proto.MAX_BATCH + 2,  # routing id, header, a batch of values
            monitor_events=zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | guard.events,
            secure=prepare,
        )
        assert self.router.monitor is not None
        loop = asyncio.get_running_loop()
        loop.add_reader(self.router.monitor.getsockopt(zmq.FD), self._on_monitor)
        loop.call_soon(self._on_monitor)
        self._tasks = [asyncio.create_task(self._housekeeping(), name="cacheserver-housekeeping")]
        if cfg.lm_enabled:
            self.lm = LmListener(self.store, self.stats, cfg)
            await self.lm.start()
        if cfg.data_enabled and self.curve is None:
            self.data = DataListener(self.handlers, self.stats, cfg, self.connections)
            await self.data.start()
        if cfg.metrics_port:
            self.http = ProbeServer(self.stats.metrics, self.health_report, cfg.host)
            await self.http.start(cfg.metrics_port)
        log.info(
            "cacheserver ready",
            port=self.port,
            lm_port=self.lm.port if self.lm else None,
            data_port=self.data.port if self.data else None,
            metrics_port=self.http.port if self.http else None,
            max_memory=int(cfg.max_memory),
            spill=cfg.spill_path or None,
        )

    async def stop(self) -> None:
        """Stop serving: close the sockets, cancel tasks, then end the context."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        if self.lm is not None:
            await self.lm.stop()
        if self.data is not None:
            await self.data.stop()
        if self.http is not None:
            await self.http.stop()
        if self.router.monitor is not None:
            asyncio.get_running_loop().remove_reader(self.router.monitor.getsockopt(zmq.FD))
        self.router.close()
        tasks = [*self._tasks, *self.router.inflight]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.guard is not None:
            await asyncio.to_thread(self.guard.close)
        # destroy, not term: after a failed start a socket may be left open, and
        # term() would wait for it on the loop for ever.
        self._ctx.destroy(linger=0)
        if self.store.spill is not None:
            self.store.spill.close()
        log.info("cacheserver stopped")
        self._closed.set()

    async def wait_closed(self) -> None:
        await self._closed.wait()

    def connections(self) -> int:
        self._on_monitor()  # take in connection events not yet seen
        return (
            self.zmq_connections
            + (self.lm.connections if self.lm else 0)
            + (self.data.connections if self.data else 0)
        )

    def health_report(self) -> dict[str, Any]:
        return {
            "status": "ok",
            "uptime_s": round(time.monotonic() - self.started, 3),
            "keys": self.store.keys_total,
            "memory_bytes": self.store.used_bytes,
            "connections": self.connections(),
            "protocol_version": proto.PROTOCOL_VERSION,
        }

    # -- requests -----------------------------------------------------------------------
    def _dispatch(self, peer: bytes, msg: Any, values: list) -> None:
        now = time.monotonic()
        if isinstance(msg, proto.Hello):
            self.router.send(peer, self._hello(peer, msg, now))
            return
        session = self.sessions.get(peer)
        if session is None:
            self.stats.errors[ErrorCode.NO_HELLO].inc()
            self.router.send(peer, self._error(msg, ErrorCode.NO_HELLO, "say hello first"))
            return
        session.last_seen = now
        handler = self.handlers.table.get(type(msg))
        if handler is None:  # a request type this server decodes but does not serve
            self.stats.errors[ErrorCode.UNKNOWN_MESSAGE].inc()
            self.router.send(peer, self._error(msg, ErrorCode.UNKNOWN_MESSAGE, "not served here"))
            return
        op = msg.__struct_config__.tag
        part = session.part_bytes
        if len(self.router.inflight) < MAX_INFLIGHT_TASKS and self.handlers.suspends(msg, values):
            # Over the cap, a get is answered from memory alone (a miss is always safe)
            # and a put hashes on the loop.
            handle = self.handlers.async_table[type(msg)]
            self.router.spawn(peer, msg, self._handle_async, handle, msg, values, now, part)
            return
        try:
            reply, out = in_parts(*handler(msg, values), part)
        except RequestError as exc:
            reply, out = self._refused(msg, exc)
        self._served(op, now)
        self.router.send(peer, reply, out)

    async def _handle_async(
        self, handler: Any, msg: Any, values: list, t0: float, part: int
    ) -> Answer:
        try:
            return in_parts(*await handler(msg, values), part)
        except RequestError as exc:
            return self._refused(msg, exc)
        finally:
            self._served(msg.__struct_config__.tag, t0)

    def _refused(self, msg: Any, exc: RequestError) -> tuple[proto.ErrorReply, list]:
        self.stats.errors[exc.code].inc()
        return self._error(msg, exc.code, str(exc)), []

    def _served(self, op: str, t0: float) -> None:
        self.stats.requests[op].inc()
        self.stats.seconds[op].observe(time.monotonic() - t0)

    def _hello(self, peer: bytes, msg: proto.Hello, now: float) -> Any:
        self.stats.requests["hello"].inc()
        if msg.version != proto.PROTOCOL_VERSION:
            self.stats.errors[ErrorCode.VERSION_MISMATCH].inc()
            return self._error(
                msg,
                ErrorCode.VERSION_MISMATCH,
                f"server speaks protocol version {proto.PROTOCOL_VERSION}, client {msg.version}",
            )
        limit = self.config.max_connections
        if peer not in self.sessions:
            self._on_monitor()  # count the connection this hello came on
            if self.zmq_connections > limit:
                self.stats.errors[ErrorCode.TOO_MANY_CONNECTIONS].inc()
                return self._error(
                    msg, ErrorCode.TOO_MANY_CONNECTIONS, f"at the limit of {limit} connections"
                )
            if len(self.sessions) >= limit:
                # Open connections are under the limit, so sessions of closed ones fill
                # the table (ZMQ names no disconnected peer): without this, `limit`
                # short-lived clients locked everyone out for session_idle_s. The
                # least recently seen goes; if its client is still there, it gets
                # NO_HELLO (retryable) and says hello again.
                oldest = min(self.sessions, key=lambda p: self.sessions[p].last_seen)
                del self.sessions[oldest]
        part = msg.value_part_bytes
        part = max(part, proto.MIN_PART_BYTES) if part > 0 else 0
        self.sessions[peer] = _Session(msg.client[:100], now, part)
        self.stats.sessions.set(len(self.sessions))
        return proto.HelloReply(
            msg.rid,
            proto.PROTOCOL_VERSION,
            self.name,
            int(self.config.max_value_size),
            proto.MAX_BATCH,
            self.data.port if self.data else 0,
            self.data.token if self.data else b"",
        )

    def _error(self, msg: Any, code: ErrorCode, message: str) -> proto.ErrorReply:
        return proto.ErrorReply(getattr(msg, "rid", 0), int(code), message, code in proto.RETRYABLE)

    # -- background ---------------------------------------------------------------------
    def _on_monitor(self) -> None:
        monitor = self.router.monitor
        if monitor is None:
            return
        while monitor.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            try:
                event = parse_monitor_message(monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                break
            if event["event"] == zmq.EVENT_ACCEPTED:
                self.zmq_connections += 1
            elif event["event"] == zmq.EVENT_DISCONNECTED:
                self.zmq_connections = max(0, self.zmq_connections - 1)
            elif self.guard is not None:
                self.guard.count(event)
        self.stats.connections["zmq"].set(self.zmq_connections)

    async def _housekeeping(self) -> None:
        idle = self.config.session_idle_s
        while True:
            await asyncio.sleep(GAUGE_PERIOD_S)
            now = time.monotonic()
            for peer in [p for p, s in self.sessions.items() if now - s.last_seen > idle]:
                del self.sessions[peer]
            self.stats.sessions.set(len(self.sessions))
            self._on_monitor()
            self._update_gauges()

    def _update_gauges(self) -> None:
        store = self.store
        self.stats.keys.set(store.keys_total)
        self.stats.memory_bytes.set(store.used_bytes)
        if store.spill is not None:
            self.stats.spill_bytes.set(store.spill.used_bytes)

    def _evicted(self, key: str, spilled: bool) -> None:
        self.stats.evicted_to["spill" if spilled else "drop"].inc()

"""Serves this engine's L1 to peers (kvmesh.common.protocol.p2p), on the engine's loop.

Only L1 is served: a peer asking for a chunk that lives only on our disk or remote
tier gets a miss, since reading it here first would cost us I/O on someone else's
behalf (and the peer can read the shared remote tier itself).

- `ReadChunks` (ZMQ channel): the chunks go out as zero-copy frames; the server keeps
  a reference on each until ZMQ has sent it, so the page cannot be reused meanwhile.
- `PinChunks` (NIXL channel): the server takes a reference on each chunk (no eviction,
  no reuse of its page) under a lease, and answers with addresses in the pool the
  channel's agent registered. `ReleaseChunks` or the lease time drops them.
- Each chunk's xxh3 is computed once (off the loop, on every core) and kept in
  `MemoryObj.checksum`: L1 chunks never change after they are inserted.

Anything malformed gets an ErrorReply; nothing a client sends stops the server.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import secrets
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import zmq
import zmq.asyncio

from kvmesh.common.chunk_codec import chunk_checksums, dtype_name
from kvmesh.common.keys import ChunkKey
from kvmesh.common.memory import MemoryObj
from kvmesh.common.observability import get_logger
from kvmesh.common.protocol import p2p as proto
from kvmesh.common.protocol import wire
from kvmesh.common.transport.channel import TransferChannel
from kvmesh.common.transport.curve import CurveGuard
from kvmesh.common.transport.frames import FrameReader
from kvmesh.common.transport.tcp_address import (
    UnresolvedHost,
    bind,
    bind_host_async,
    tcp_endpoint,
)
from kvmesh.services.worker.pd_receiver import PdRefused

if TYPE_CHECKING:
    from kvmesh.services.worker.engine import KVEngine

log = get_logger(__name__)

COPY_BELOW = 1 << 20  # smaller payloads are copied: a send tracker costs more
SEND_WAIT_S = 30.0  # a zero-copy frame ZMQ has not sent by then is reported
# A reader that died without closing its connection (host down, network cut): ZMQ pings
# it and, unanswered, drops its connection and the replies queued for it.
HEARTBEAT_IVL_S, HEARTBEAT_TIMEOUT_S = 10.0, 60.0
Handled = tuple[proto.Reply, list[MemoryObj]]


class P2PServerError(RuntimeError):
    """The server could not bind its endpoint."""


class P2PServer:
    def __init__(self, engine: KVEngine, channel: TransferChannel, host: str, port: int) -> None:
        self.engine = engine
        self.channel = channel
        # As the services bind: "" is every IPv4 address, a name its IPv4 address first,
        # resolved on the loop's resolver thread when the server starts (_main).
        self._host, self._port = host, port
        self.endpoint = tcp_endpoint(host, port)
        self.lease_s = max(10.0, 4 * engine.config.p2p.timeout_s)
        self._leases: dict[int, tuple[list[MemoryObj], float]] = {}
        self._done: concurrent.futures.Future[None] | None = None
        self._task: asyncio.Task[None] | None = None
        self._bg: set[asyncio.Task[Any]] = set()
        # Zero-copy replies ZMQ may still be sending from: their chunks, referenced.
        self._unsent: dict[zmq.MessageTracker, list[MemoryObj]] = {}
        m = engine.stats.metrics
        req = m.counter("p2p_server_requests_total", "Peer requests served", ["kind"])
        self._requests = {k: req.labels(kind=k) for k in ("hello", "read", "pin", "release", "pd")}
        self._errors = m.counter("p2p_server_errors_total", "Peer error replies", ["code"])
        self._served = m.counter("p2p_served_bytes_total", "Chunk bytes handed to peers")
        self._leased = m.gauge("p2p_server_leases", "NIXL leases holding chunks for peers")
        self._served.inc(0)
        self._leased.set(0)

    # -- life cycle ---------------------------------------------------------------------
    def start(self, timeout: float = 10.0) -> str:
        """Bind and serve on the engine's loop; the bound endpoint (port 0 resolved)."""
        bound: concurrent.futures.Future[str] = concurrent.futures.Future()
        self._done = self.engine.loop.submit(self._main(bound))
        try:
            self.endpoint = bound.result(timeout)
        except concurrent.futures.TimeoutError:
            self.stop()
            raise P2PServerError(f"p2p server did not bind {self.endpoint}") from None
        log.info("p2p server listening", endpoint=self.endpoint, channel=self.channel.name)
        return self.endpoint

    def stop(self, timeout: float = 5.0) -> None:
        done, self._done = self._done, None
        if done is None or done.done() or not self.engine.loop.running:
            return
        self.engine.loop.loop.call_soon_threadsafe(self._cancel)
        if self.engine.loop.in_loop_thread():
            return
        with contextlib.suppress(concurrent.futures.CancelledError, TimeoutError):
            done.result(timeout)

    def _cancel(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _main(self, bound: concurrent.futures.Future[str]) -> None:
        self._task = asyncio.current_task()
        ctx = zmq.asyncio.Context()
        sock = ctx.socket(zmq.ROUTER)
        sock.linger = 0
        # No valid frame (a header, a pushed chunk or layer) is larger than all of L1:
        # a peer's giant one drops its connection instead of being buffered whole in
        # the engine's process (vLLM's).
        sock.setsockopt(zmq.MAXMSGSIZE, self.engine.pool.capacity_bytes + proto.MAX_HEADER_BYTES)
        sock.setsockopt(zmq.HEARTBEAT_IVL, int(HEARTBEAT_IVL_S * 1000))
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(HEARTBEAT_TIMEOUT_S * 1000))
        guard = CurveGuard(ctx, self.engine.curve, self.engine.stats.metrics, "worker")
        guard.serve(sock)
        try:
            try:
                host = await bind_host_async(self._host)
                self.endpoint = tcp_endpoint(host, self._port)
                bind(sock, self.endpoint)
            except (zmq.ZMQError, UnresolvedHost) as exc:
                bound.set_exception(P2PServerError(f"cannot bind {self.endpoint}: {exc}"))
                return
            bound.set_result(sock.getsockopt_string(zmq.LAST_ENDPOINT))
            expiry = asyncio.create_task(self._expire_leases())
            try:
                await self._serve(sock)
            finally:
                expiry.cancel()
        finally:
            for task in list(self._bg):
                task.cancel()
            sock.close(0)
            await asyncio.to_thread(guard.close)
            ctx.term()
            # Terminated: ZMQ has let go of every frame it had not sent.
            for objs in self._unsent.values():
                for obj in objs:
                    obj.ref_down()
            self._unsent.clear()
            for lease in list(self._leases):
                self._release(lease)

    async def _serve(self, sock: zmq.asyncio.Socket) -> None:
        # Routing id, header, and at most one frame a chunk (a PD push's layers).
        reader = FrameReader(sock, proto.MAX_KEYS + 2)
        while True:
            # Frames, not copies: a PD push carries whole chunk layers (megabytes each),
            # which a copy would copy once more on the loop before the push does.
            frames, dropped = await reader.recv()
            if len(frames) < 2:
                continue  # no routing id and message: nothing to answer
            if dropped:
                problem = f"{len(frames) + dropped - 2} frames after the header"
                rid = wire.rid_at_head(frames[1].buffer)
                reply, objs = proto.error_reply(rid, proto.ErrorCode.BAD_MESSAGE, problem), []
            else:
                reply, objs = await self.handle([f.buffer for f in frames[1:]])
            if isinstance(reply, proto.ErrorReply):
                self._errors.labels(code=proto.codec.code_name(reply.code)).inc()
            await self._send(sock, frames[0].bytes, reply, objs)

    async def _send(
        self, sock: zmq.asyncio.Socket, ident: bytes, reply: proto.Reply, objs: list[MemoryObj]
    ) -> None:
        """Send reply with the objs' bytes as payloads (ReadChunks), then drop their refs."""
        payloads = [obj.raw.numpy() for obj in objs]
        total = sum(p.nbytes for p in payloads)
        zero_copy = total >= COPY_BELOW
        try:
            tracker = await sock.send_multipart(
                [ident, proto.encode(reply), *payloads], copy=not zero_copy, track=zero_copy
            )
        except zmq.ZMQError as exc:
            log.debug("p2p reply not sent", error=str(exc))
            tracker = None
        self._served.inc(total)
        if zero_copy and tracker is not None:
            self._unsent[tracker] = objs
            task = asyncio.create_task(self._release_when_sent(tracker))
            self._bg.add(task)
            task.add_done_callback(self._bg.discard)
        else:
            for obj in objs:
                obj.ref_down()

    async def _release_when_sent(self, tracker: zmq.MessageTracker) -> None:
        """Drop the chunks' references once ZMQ has let go of their frames: sent, or
        dropped with the reader's connection (however long that takes). The server's
        shutdown releases them if it comes first."""
        warn_at = time.monotonic() + SEND_WAIT_S
        pause = 0.001  # pages back soon after a send; slower polls only past the warning
        while not tracker.done:
            if warn_at and time.monotonic() > warn_at:
                log.error("zero-copy chunk frames not sent yet; pages kept until they are")
                warn_at, pause = 0.0, 0.5
            await asyncio.sleep(pause)
        for obj in self._unsent.pop(tracker, []):
            obj.ref_down()

    # -- requests -----------------------------------------------------------------------
    async def handle(self, frames: Sequence[bytes | memoryview]) -> Handled:
        """The reply to one request (without routing id), and the objects whose bytes
        follow it as payload frames (one reference each, dropped once sent)."""
        if frames and len(frames[0]) > proto.MAX_HEADER_BYTES:
            # Decoding it would hold the loop (and every transfer on it) for seconds.
            problem = f"header of {len(frames[0])} bytes, over {proto.MAX_HEADER_BYTES}"
            rid = wire.rid_at_head(frames[0])
            return proto.error_reply(rid, proto.ErrorCode.BAD_MESSAGE, problem), []
        try:
            msg = proto.decode_request(frames)
        except proto.MalformedMessage as exc:
            return exc.reply, []
        try:
            if isinstance(msg, proto.Hello):
                return self._hello(msg), []
            if isinstance(msg, proto.ReadChunks):
                return await self._read(msg)
            if isinstance(msg, proto.PinChunks):
                return await self._pin(msg), []
            if isinstance(msg, proto.ReleaseChunks):
                return self._release_msg(msg), []
            return await self._pd(msg, frames[1:]), []
        except _BadKey as exc:
            return proto.error_reply(msg.rid, proto.ErrorCode.BAD_KEY, str(exc)), []
        except PdRefused as exc:
            return proto.error_reply(msg.rid, exc.code, str(exc)), []
        except Exception as exc:
            log.exception("p2p request failed", request=type(msg).__name__)
            return proto.error_reply(msg.rid, proto.ErrorCode.INTERNAL, repr(exc)), []

    def _hello(self, msg: proto.Hello) -> proto.Reply:
        self._requests["hello"].inc()
        agent, metadata = self.channel.hello_fields()
        e = self.engine
        return proto.HelloReply(
            msg.rid, proto.PROTOCOL_VERSION, e.instance_id, e.rank, agent, metadata
        )

    async def _held(self, keys: list[str], deadline: float) -> list[tuple[ChunkKey, MemoryObj]]:
        """The L1 chunks of keys (missing ones left out), one reference each."""
        parsed = []
        for k in keys:
            try:
                parsed.append(ChunkKey.from_str(k))
            except ValueError as exc:
                raise _BadKey(str(exc)) from None
        l1 = self.engine.storage.l1
        held = [(key, obj) for key in parsed if (obj := l1.get(key)) is not None]
        unsummed = [obj for _, obj in held if obj.checksum is None]
        if unsummed:
            # Off the loop, and on every core: the reader waits for this reply.
            sums = await chunk_checksums(unsummed)
            for obj, s in zip(unsummed, sums, strict=True):
                obj.checksum = s
        if deadline and time.time() > deadline:
            for _, obj in held:
                obj.ref_down()
            return []
        return held

    async def _read(self, msg: proto.ReadChunks) -> Handled:
        self._requests["read"].inc()
        held = await self._held(msg.keys, msg.deadline)
        metas = [_meta(key, obj) for key, obj in held]
        return proto.ReadChunksReply(msg.rid, metas), [obj for _, obj in held]

    async def _pin(self, msg: proto.PinChunks) -> proto.Reply:
        self._requests["pin"].inc()
        agent = self.channel.hello_fields()[0]
        if not agent:
            return proto.error_reply(msg.rid, proto.ErrorCode.NO_NIXL, "this peer serves ZMQ only")
        held = await self._held(msg.keys, msg.deadline)
        # Random, not counted: a ReleaseChunks meant for a lease of a server before a
        # restart does not release another reader's lease here.
        lease = secrets.randbits(63)
        if held:
            self._leases[lease] = ([obj for _, obj in held], time.monotonic() + self.lease_s)
            self._leased.set(len(self._leases))
        metas = [_meta(key, obj, obj.data_ptr) for key, obj in held]
        return proto.PinChunksReply(msg.rid, lease, metas, agent)

    async def _pd(self, msg: proto.Request, payloads: Sequence[bytes | memoryview]) -> proto.Reply:
        """Disaggregated prefill messages, for the engine's PD receiver."""
        receiver = self.engine.pd_receiver
        if receiver is None:
            return proto.error_reply(
                msg.rid, proto.ErrorCode.NOT_RECEIVER, "this engine does not receive PD transfers"
            )
        self._requests["pd"].inc()
        if isinstance(msg, proto.AllocChunks):
            return receiver.alloc(msg, self.channel.hello_fields()[0])
        if isinstance(msg, proto.PushChunks):
            return await receiver.push(msg, payloads)
        if isinstance(msg, proto.CommitChunks):
            return await receiver.commit(msg)
        assert isinstance(msg, proto.CancelChunks)
        return receiver.cancel(msg)

    def _release_msg(self, msg: proto.ReleaseChunks) -> proto.Reply:
        self._requests["release"].inc()
        return proto.ReleaseChunksReply(msg.rid, self._release(msg.lease))

    def _release(self, lease: int) -> bool:
        entry = self._leases.pop(lease, None)
        self._leased.set(len(self._leases))
        if entry is None:
            return False
        for obj in entry[0]:
            obj.ref_down()
        return True

    async def _expire_leases(self) -> None:
        while True:
            await asyncio.sleep(min(1.0, self.lease_s / 4))
            now = time.monotonic()
            for lease, (_, until) in list(self._leases.items()):
                if until < now:
                    log.warning("p2p lease expired unreleased", lease=lease)
                    self._release(lease)

    def lease_count(self) -> int:
        return len(self._leases)


class _BadKey(ValueError):
    pass


def _meta(key: ChunkKey, obj: MemoryObj, addr: int = 0) -> proto.ChunkMeta:
    assert obj.checksum is not None
    return proto.ChunkMeta(
        key.to_str(), obj.nbytes, obj.checksum, list(obj.shape), dtype_name(obj.dtype),
        int(obj.fmt), addr,
    )  # fmt: skip


def attach_p2p_server(engine: KVEngine, channel: TransferChannel) -> P2PServer:
    """Start serving engine's L1 to peers at `engine.p2p` host/port; `engine.close()`
    stops it. Sets `engine.p2p_endpoint` (what the controller client registers)."""
    cfg = engine.config.p2p
    # A fixed port is rank 0's; rank r serves on port + r (what a bridge's list of a
    # decoder's endpoints names).
    server = P2PServer(engine, channel, cfg.host, cfg.port + engine.rank if cfg.port else 0)
    engine.p2p_endpoint = server.start()
    engine.add_close_hook(server.stop)
    return server

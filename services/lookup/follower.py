"""Keeps the lookup-server's ChunkIndex in step with the controller's registry.

One DEALER to the controller of its own (the request path's connection is not held up
by an 80 MB snapshot), owned by one reader task. The follower says hello, subscribes
(`IndexSubscribe`: a snapshot, then every registry change pushed in order, see
common/protocol/controller.py), builds a fresh index from the snapshot in steps while
the pushes that follow are buffered, then applies pushes as they come and pings every
`ping_s`.

Staleness rule: the index is used only while it is *in sync*: built from a snapshot
of the current controller, every push since applied in sequence, and confirmed
within the last `max_staleness_s`. A confirmation is an `IndexTick` whose seq equals
the last push applied (the tick travels behind every push it counts, so the index then
held everything the controller had when it answered); it dates from when its ping was
sent. So an answer from the index is never older than `max_staleness_s` of the
controller's registry. Otherwise (starting, rebuilding, the controller silent or
gone) the server asks the controller, as without an index.

Resync (a fresh subscribe and snapshot, counted by reason): a push out of sequence or
a tick ahead of the last push (`gap`: the controller dropped pushes for us), another
epoch or a NO_HELLO / NOT_SUBSCRIBED answer (`restart`: the controller restarted or
forgot us), a change for a worker the index does not know (`diverged`). A frame that
does not decode is counted and dropped; if it was a push, the next push or tick shows
the gap.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import Iterator
from typing import Any

import zmq
import zmq.asyncio

from kvmesh.common.chunk_holders import WALK_STEP, unpack_ints
from kvmesh.common.observability import Metrics, get_logger
from kvmesh.common.protocol import controller as proto
from kvmesh.common.protocol.controller import ErrorCode
from kvmesh.common.transport.curve import CurveKeys, apply_client
from kvmesh.common.transport.tcp_address import connect
from kvmesh.services.lookup.index import ChunkIndex, UnknownWorker

log = get_logger(__name__)

RCV_HWM = 100_000
# Chunk ints added between two yields to the loop while building: into a dict of
# millions, an insert costs 1-4 µs (cache misses), so 100k of them held every
# request up for 0.1-0.4 s.
BUILD_STEP = WALK_STEP
RETRY_MAX_S = 2.0
RESYNC_REASONS = ("start", "gap", "restart", "diverged", "unavailable")


class _Resync(Exception):
    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(detail or reason)
        self.reason = reason


class FollowerStats:
    def __init__(self, m: Metrics, follower: IndexFollower) -> None:
        resyncs = m.counter(
            "lookup_index_resyncs_total", "Index rebuilds from a controller snapshot", ["reason"]
        )
        self.resyncs = {r: resyncs.labels(reason=r) for r in RESYNC_REASONS}
        self.events = m.counter(
            "lookup_index_events_total", "Chunk admits and evicts applied to the index"
        )
        self.pushes = m.counter("lookup_index_pushes_total", "Controller pushes applied")
        self.malformed = m.counter(
            "lookup_index_malformed_total", "Frames from the controller that did not decode"
        )
        for c in (self.events, self.pushes, self.malformed, *self.resyncs.values()):
            c.inc(0)
        m.gauge("lookup_index_in_sync", "1 while lookups are answered from the index").set_function(
            lambda: float(follower.in_sync())
        )
        m.gauge("lookup_index_chunks", "Distinct chunks in the index").set_function(
            lambda: float(follower.index.chunks if follower.index else 0)
        )
        m.gauge("lookup_index_workers", "Workers in the index").set_function(
            lambda: float(len(follower.index.workers) if follower.index else 0)
        )
        m.gauge(
            "lookup_index_staleness_seconds", "Seconds since the index was last confirmed current"
        ).set_function(lambda: follower.staleness_s())


class IndexFollower:
    def __init__(
        self,
        url: str,
        metrics: Metrics,
        *,
        ping_s: float,
        max_staleness_s: float,
        request_timeout_s: float,
        snapshot_timeout_s: float,
        name: str = "kvmesh-lookup-index",
        curve: CurveKeys | None = None,
    ) -> None:
        self.url = url
        self.curve = curve
        self.ping_s = ping_s
        self.max_staleness_s = max_staleness_s
        self.request_timeout_s = request_timeout_s
        self.snapshot_timeout_s = snapshot_timeout_s
        self.name = name
        self.index: ChunkIndex | None = None  # the one in use; never half built
        self.epoch = ""
        self.seq = 0
        self.stats = FollowerStats(metrics, self)
        self._ctx = zmq.asyncio.Context()
        self._sock: zmq.asyncio.Socket | None = None
        self._rids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._pinged: dict[int, float] = {}  # ping rid → when sent
        self._confirmed = float("-inf")  # monotonic time the index was last known current
        self._following = False  # pushes go to self.index
        self._buffer: list[Any] | None = None  # pushes that arrive while building
        # Pushes that arrive while a large push is applied in steps, and its task.
        self._held: list[Any] | None = None
        self._held_to = 0  # the seq of the last push held (or of the replacement)
        # The newest tick answered while a push went in in steps, (seq, sent): it
        # confirms the index once the push and those held behind it are in.
        self._held_tick: tuple[int, float] | None = None
        self._replacing: asyncio.Task | None = None
        self._resync = asyncio.Event()
        self._resync_reason = ""
        self._tasks: list[asyncio.Task] = []

    # -- the rule -------------------------------------------------------------------------
    def in_sync(self, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        return self._following and now - self._confirmed <= self.max_staleness_s

    def staleness_s(self) -> float:
        """Seconds since the last confirmation (-1: never confirmed)."""
        if self._confirmed == float("-inf"):
            return -1.0
        return round(time.monotonic() - self._confirmed, 3)

    def synced_index(self) -> ChunkIndex | None:
        """The index when it may answer now, else None (ask the controller)."""
        return self.index if self.in_sync() else None

    def last_index(self) -> tuple[ChunkIndex | None, float]:
        """The index in use, in sync or not, and the monotonic time it was last
        confirmed (-inf: never)."""
        return self.index, self._confirmed

    # -- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        sock = self._ctx.socket(zmq.DEALER)
        sock.linger = 0
        sock.setsockopt(zmq.RCVHWM, RCV_HWM)
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        apply_client(sock, self.curve, self.url)
        connect(sock, self.url)
        self._sock = sock
        self._tasks = [
            asyncio.create_task(self._read(), name="lookup-index-reader"),
            asyncio.create_task(self._run(), name="lookup-index-follow"),
        ]

    async def stop(self) -> None:
        """Cancel the tasks, then close the socket, then the context."""
        self._drop_replacement()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for fut in self._pending.values():
            fut.cancel()
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None
        self._ctx.term()

    # -- following ------------------------------------------------------------------------
    async def _run(self) -> None:
        reason, retry_s = "start", 0.1
        while True:
            self._resync.clear()
            # Pings queued while the controller was away reach its new life together and
            # are all refused (NO_HELLO): only the first may start a resync, not each.
            self._pinged.clear()
            self.stats.resyncs[reason].inc()
            try:
                await self._subscribe()
                retry_s = 0.1
                reason = await self._keep_following()
            except _Resync as exc:
                reason = exc.reason
            except TimeoutError:
                reason = "unavailable"
            except Exception:  # a bug: the index must not stop following for good
                log.exception("index follower failed; starting over")
                reason = "unavailable"
            self._following, self._buffer = False, None
            if reason == "unavailable":
                await asyncio.sleep(retry_s)
                retry_s = min(retry_s * 2, RETRY_MAX_S)
            log.info("index resync", reason=reason, detail=self._resync_reason)

    async def _subscribe(self) -> None:
        self._following, self._buffer = False, None
        self._drop_replacement()
        hello = await self._request(
            proto.Hello(self._rid(), proto.PROTOCOL_VERSION, self.name), self.request_timeout_s
        )
        if not isinstance(hello, proto.HelloReply):
            raise _Resync("unavailable", f"hello refused: {hello!r}"[:200])
        asked_at = time.monotonic()
        snap = await self._request(proto.IndexSubscribe(self._rid()), self.snapshot_timeout_s)
        if not isinstance(snap, proto.IndexSnapshotReply):
            raise _Resync("unavailable", f"subscribe refused: {snap!r}"[:200])
        index = await self._build(snap)
        buffered, self._buffer = self._buffer or [], None
        self.epoch, self.seq, self.index = snap.epoch, snap.seq, index
        self._following = True
        for push in buffered:
            self._take(push)
        self._confirmed = asked_at  # the snapshot is at least as new as the request
        log.info("index in sync", chunks=index.chunks, workers=len(index.workers), seq=self.seq)

    async def _build(self, snap: proto.IndexSnapshotReply) -> ChunkIndex:
        index = ChunkIndex()
        for state in snap.workers:
            w = index.join(state.worker)
            for tier, raw in state.tiers.items():
                ints = unpack_ints(raw)
                for start in range(0, len(ints), BUILD_STEP):
                    index.apply(w, proto.EventKind.ADMIT, tier, ints[start : start + BUILD_STEP])
                    await asyncio.sleep(0)  # requests keep being answered meanwhile
        return index

    async def _keep_following(self) -> str:
        """Ping every ping_s (and sweep the index between pings) until a resync is due;
        its reason."""
        while not self._resync.is_set():
            rid = self._rid()
            self._pinged[rid] = time.monotonic()
            self._send(proto.IndexPing(rid, self.epoch))
            deadline = time.monotonic() + self.ping_s
            index = self.index
            while index is not None and not index.sweep():
                await asyncio.sleep(0)
                if time.monotonic() > deadline:
                    break
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                    await self._resync.wait()
            self._pinged = {r: t for r, t in self._pinged.items() if r > rid - 64}
        return self._resync_reason.split(":", 1)[0]

    def _trigger(self, reason: str, detail: str) -> None:
        if not self._resync.is_set():
            self._following = False
            self._resync_reason = f"{reason}: {detail}"
            self._resync.set()

    # -- the socket -----------------------------------------------------------------------
    def _rid(self) -> int:
        return next(self._rids)

    def _send(self, msg: Any) -> None:
        if self._sock is None:
            return
        with contextlib.suppress(zmq.ZMQError):  # a full queue: the deadline says so
            self._sock.send(proto.encode(msg), zmq.NOBLOCK)

    async def _request(self, msg: Any, timeout_s: float) -> Any:
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending[msg.rid] = fut
        try:
            self._send(msg)
            async with asyncio.timeout(timeout_s):
                reply = await fut
        finally:
            self._pending.pop(msg.rid, None)
        return reply

    async def _read(self) -> None:
        assert self._sock is not None
        while True:
            # A frame, not a copy: a full index state runs to tens of megabytes.
            frame = await self._sock.recv(copy=False)
            try:
                msg = proto.decode_reply(frame.buffer)
            except proto.MalformedMessage:
                self.stats.malformed.inc()
                continue
            try:
                self._on_message(msg)
            except Exception:  # a bug: never let it stop the reader
                log.exception("index message not handled", tag=msg.__struct_config__.tag)
                self._trigger("diverged", "handler failed")

    def _on_message(self, msg: Any) -> None:
        if isinstance(msg, proto.IndexPush):
            if self._following:
                self._take(msg)
            elif self._buffer is not None:
                self._buffer.append(msg)
            return  # else: of a subscription given up on
        if isinstance(msg, proto.IndexTick):
            self._on_tick(msg)
            return
        if isinstance(msg, proto.ErrorReply) and msg.rid in self._pinged:
            if msg.code in (ErrorCode.NO_HELLO, ErrorCode.NOT_SUBSCRIBED):
                self._trigger("restart", msg.message)
            return
        fut = self._pending.get(msg.rid) if msg.rid else None
        if fut is not None and not fut.done():
            if isinstance(msg, proto.IndexSnapshotReply):
                self._buffer = []  # before any push that follows it is read
            fut.set_result(msg)

    def _on_tick(self, tick: proto.IndexTick) -> None:
        sent = self._pinged.pop(tick.rid, None)
        if sent is None or not self._following:
            return
        if tick.epoch != self.epoch:
            self._trigger("restart", f"epoch {tick.epoch}")
        elif self._held is not None:
            # A push is going in in steps: nothing is confirmed until it is; a tick past
            # the last push received still shows one lost.
            if tick.seq > self._held_to:
                self._trigger("gap", f"tick at {tick.seq}, pushes received to {self._held_to}")
            elif tick.seq < self._held_to:
                # Ticks and pushes share one ordered socket: this one was sent after
                # the pushes held, with a lower seq. The controller went back.
                self._trigger("diverged", f"tick at {tick.seq} behind pushes to {self._held_to}")
            elif self._held_tick is None or sent > self._held_tick[1]:
                self._held_tick = (tick.seq, sent)
        elif tick.seq > self.seq:
            self._trigger("gap", f"tick at {tick.seq}, index at {self.seq}")
        elif tick.seq == self.seq:
            self._confirmed = max(self._confirmed, sent)
        else:
            self._trigger("diverged", f"tick at {tick.seq} behind index at {self.seq}")

    def _take(self, push: Any) -> None:
        """Apply a push now, or once the push being applied in steps is in. A large
        WorkerReplaced (a million chunks take ~0.3 s) or IndexEvents (65,536 admits
        into an index of millions take 0.1-0.3 s) is applied in steps."""
        if self._held is not None:
            self._held.append(push)
            self._held_to = max(self._held_to, push.seq)
        elif _chunks_in(push) > WALK_STEP:
            self._held, self._held_to = [], push.seq
            self._replacing = asyncio.get_running_loop().create_task(self._in_steps(push))
        else:
            self._apply(push)

    def _event_steps(self, index: ChunkIndex, push: proto.IndexEvents) -> Iterator[None]:
        """An event batch, WALK_STEP chunks a step. Stopped midway, the index holds the
        worker's state after the events applied so far: one it did have (its events
        are in order), and the resync that stops it replaces the index anyway."""
        w = index.worker(push.worker_id)
        since_yield = 0  # chunks applied since the last step: many small runs are one
        for kind, tier, raw in push.runs:
            ints = unpack_ints(raw)
            start = 0
            while start < len(ints):
                step = ints[start : start + WALK_STEP - since_yield]
                start += len(step)
                index.apply(w, kind, tier, step)
                self.stats.events.inc(len(step))
                since_yield += len(step)
                if since_yield == WALK_STEP:
                    since_yield = 0
                    yield

    async def _in_steps(self, push: proto.WorkerReplaced | proto.IndexEvents) -> None:
        index = self.index
        assert index is not None
        try:
            if self._in_order(push):
                steps = (
                    index.replace_steps(push.worker_id, push.tiers)
                    if isinstance(push, proto.WorkerReplaced)
                    else self._event_steps(index, push)
                )
                try:
                    for _ in steps:
                        await asyncio.sleep(0)
                finally:
                    steps.close()
                self.seq = push.seq
                self.stats.pushes.inc()
        except Exception as exc:
            # As for a push applied at once (_apply, _read): resync. Held pushes are
            # dropped, or they would pile up and no tick would confirm the index again.
            if not isinstance(exc, UnknownWorker):
                log.exception("push not applied", worker=push.worker_id)
            self._held = self._replacing = self._held_tick = None
            self._trigger("diverged", f"push for {push.worker_id} failed: {exc!r}"[:200])
            return
        held, self._held, self._replacing = self._held or [], None, None
        for later in held:
            self._take(later)
        tick = self._held_tick
        if self._held is None and tick is not None:
            # No other push in steps started: the index holds every push the tick counted.
            self._held_tick = None
            if self.seq >= tick[0]:
                self._confirmed = max(self._confirmed, tick[1])

    def _drop_replacement(self) -> None:
        """Give up a push in steps (its index is being replaced, or we stop)."""
        if self._replacing is not None:
            self._replacing.cancel()
        self._held = self._replacing = self._held_tick = None

    def _in_order(self, push: Any) -> bool:
        """Whether push is the next to apply; one out of order triggers a resync, one
        already in the snapshot is skipped."""
        if push.epoch != self.epoch:
            self._trigger("restart", f"push of epoch {push.epoch}")
            return False
        if push.seq <= self.seq:
            return False  # in the snapshot already
        if push.seq != self.seq + 1:
            self._trigger("gap", f"push {push.seq} after {self.seq}")
            return False
        return True

    def _apply(self, push: Any) -> None:
        if not self._in_order(push):
            return
        index = self.index
        assert index is not None
        try:
            if isinstance(push, proto.IndexEvents):
                w = index.worker(push.worker_id)
                for kind, tier, raw in push.runs:
                    ints = unpack_ints(raw)
                    index.apply(w, kind, tier, ints)
                    self.stats.events.inc(len(ints))
            elif isinstance(push, proto.WorkerJoined):
                index.join(push.worker)
            elif isinstance(push, proto.WorkerLeft):
                index.leave(push.worker_id)
            elif isinstance(push, proto.WorkerReplaced):
                index.replace(push.worker_id, push.tiers)
        except UnknownWorker as exc:
            self._trigger("diverged", f"no worker {exc}")
            return
        self.seq = push.seq
        self.stats.pushes.inc()


def _chunks_in(push: Any) -> int:
    """Chunk ints a push carries (8 bytes each): what applying it costs."""
    if isinstance(push, proto.WorkerReplaced):
        return sum(len(raw) for raw in push.tiers.values()) // 8
    if isinstance(push, proto.IndexEvents):
        return sum(len(raw) for _, _, raw in push.runs) // 8
    return 0

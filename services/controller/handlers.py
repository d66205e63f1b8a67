"""The controller's request handlers: one per message type, in one dispatch table.

Sync handlers (registry work, all in memory) return the reply, or None for the
fire-and-forget messages (KV event batches, command replies), or a coroutine for work
too long for one loop step (a full state, an index snapshot): begun in order by the
handler, finished by a task whose result is the reply. Admin commands fan out to
workers and are `async`: the server runs them as tasks and sends what they return.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from kvmesh.common.keys import NS_ID_HEX_LEN
from kvmesh.common.observability import get_logger
from kvmesh.common.protocol import controller as proto
from kvmesh.common.protocol.controller import ErrorCode
from kvmesh.services.controller import move
from kvmesh.services.controller.admin import AdminFanout
from kvmesh.services.controller.event_pub import EventPublisher
from kvmesh.services.controller.index_feed import IndexFeed
from kvmesh.services.controller.registry import Registry, WorkerEntry, is_namespace_id
from kvmesh.services.controller.stats import ControllerStats

log = get_logger(__name__)

MAX_ID_CHARS = 256
MAX_COMPRESS_S = 3600.0
# A worker registers one namespace per model/layout it serves: a handful.
MAX_NAMESPACES = 64
MAX_HEARTBEAT_S = 86_400.0
# Ranks of one engine instance (tensor x pipeline parallel): far below this.
MAX_WORLD_SIZE = 4096
MAX_ENDPOINT_CHARS = 1024
# Event batches held back while a worker's full state is applied (~1 s a million
# keys); beyond this many, or this much memory, all are dropped and the worker
# resyncs once the state is in. Bytes as well as a count: one batch may fill a whole
# message (64 MiB), and 4096 of those would be hundreds of GiB.
MAX_HELD_BATCHES = 4096
MAX_HELD_BYTES = 64 << 20  # one worker's
# All workers' together: after a controller restart they all send their state at once.
MAX_HELD_BYTES_TOTAL = 256 << 20
# A decoded event's memory besides its strings' bytes: the tuple, its list slot, two
# str headers (~166 measured, msgspec 0.22 on CPython 3.11); a batch's own, likewise.
HELD_EVENT_BYTES = 176
HELD_BATCH_BYTES = 256


def held_cost(msg: proto.KVEventBatch, nbytes: int) -> int:
    """What holding msg costs in memory, estimated from nbytes, the size of the frame it
    arrived in (its events' encoded size and a few fields more: encoding them again
    took ~1-3 ms and a 3.5 MiB copy per full batch, on the loop), plus each event's
    objects. A str is stored in at most as many bytes as its UTF-8, but for one with a
    character beyond the BMP (4 bytes each): such keys are not chunk keys, and cost at
    most 4x this."""
    return HELD_BATCH_BYTES + nbytes + HELD_EVENT_BYTES * len(msg.events)


SyncHandler = Callable[[bytes, Any], Any]
# Also given the size in bytes of the frame the request arrived in.
SizedHandler = Callable[[bytes, Any, int], Any]
AsyncHandler = Callable[[bytes, Any], Awaitable[Any]]


class Handlers:
    def __init__(
        self,
        registry: Registry,
        stats: ControllerStats,
        fanout: AdminFanout,
        push: Callable[[bytes, Any], bool],
        *,
        server_name: str,
        feed: IndexFeed,
        events_pub: EventPublisher | None = None,
    ) -> None:
        self.registry = registry
        self.stats = stats
        self.fanout = fanout
        self.push = push
        self.server_name = server_name
        self.feed = feed
        self.events_pub = events_pub  # the external KV-event feed; None: off
        self.held_bytes = 0  # every worker's entry.held_bytes, summed
        self.table: dict[type, SyncHandler] = {
            proto.Register: self.register,
            proto.Deregister: self.deregister,
            proto.Heartbeat: self.heartbeat,
            proto.FullState: self.full_state,
            proto.CommandReply: self.command_reply,
            proto.P2PLookup: self.p2p_lookup,
            proto.ListWorkers: self.list_workers,
            proto.PrefixCounts: self.prefix_counts,
            proto.CheckFinish: self.check_finish,
            proto.IndexSubscribe: feed.subscribe,
            proto.IndexPing: feed.ping,
        }
        # Synchronous like `table`'s, and never refused as busy.
        self.sized_table: dict[type, SizedHandler] = {proto.KVEventBatch: self.events}
        self.async_table: dict[type, AsyncHandler] = {
            proto.Clear: self.admin,
            proto.Pin: self.admin,
            proto.Health: self.admin,
            proto.Move: self.move,
            proto.Compress: self.compress,
        }

    # -- workers ------------------------------------------------------------------------
    def register(self, peer: bytes, msg: proto.Register) -> Any:
        if not 0 < len(msg.instance_id) <= MAX_ID_CHARS or not msg.instance_id.isprintable():
            return proto.error_reply(msg.rid, ErrorCode.BAD_REQUEST, "instance_id: 1-256 printable")
        if not (0 <= msg.rank < msg.world_size <= MAX_WORLD_SIZE):
            return proto.error_reply(
                msg.rid,
                ErrorCode.BAD_REQUEST,
                f"need 0 <= rank < world_size <= {MAX_WORLD_SIZE}",
            )
        if max(len(msg.p2p_endpoint), len(msg.lookup_endpoint)) > MAX_ENDPOINT_CHARS:
            return proto.error_reply(
                msg.rid, ErrorCode.BAD_REQUEST, f"endpoints: at most {MAX_ENDPOINT_CHARS} chars"
            )
        # NaN, inf or a period of years would keep the worker, silent or gone, forever.
        if not 0 < msg.heartbeat_s <= MAX_HEARTBEAT_S:
            return proto.error_reply(
                msg.rid, ErrorCode.BAD_REQUEST, f"heartbeat_s: in (0, {MAX_HEARTBEAT_S:g}]"
            )
        # The registry and the lookup-servers' indexes read namespaces as hex ints: one
        # that is not would fail every later prefix count, not just this worker's.
        bad = next((ns for ns in msg.namespaces if not is_namespace_id(ns)), None)
        if bad is not None or len(msg.namespaces) > MAX_NAMESPACES:
            return proto.error_reply(
                msg.rid,
                ErrorCode.BAD_REQUEST,
                f"namespaces: at most {MAX_NAMESPACES} ids of {NS_ID_HEX_LEN} hex digits"
                + (f" (got {bad[:40]!r})" if bad is not None else ""),
            )
        entry = self.registry.register(
            msg.instance_id,
            msg.rank,
            msg.world_size,
            msg.namespaces,
            msg.p2p_endpoint,
            msg.heartbeat_s,
            peer,
            msg.lookup_endpoint,
        )
        self.stats.workers.set(len(self.registry.workers))
        return proto.RegisterReply(msg.rid, entry.worker_id)

    def _entry(self, peer: bytes, worker_id: str) -> WorkerEntry | None:
        entry = self.registry.workers.get(worker_id)
        if entry is None or entry.peer != peer:
            return None  # unknown, or a stale connection of a worker that re-registered
        entry.last_seen = time.monotonic()
        return entry

    def _not_registered(self, msg: Any) -> proto.ErrorReply:
        self.stats.errors[ErrorCode.NOT_REGISTERED].inc()
        return proto.error_reply(
            msg.rid, ErrorCode.NOT_REGISTERED, f"{msg.worker_id}: register first"
        )

    def deregister(self, peer: bytes, msg: proto.Deregister) -> Any:
        if self._entry(peer, msg.worker_id) is None:
            return self._not_registered(msg)
        if self.events_pub is not None:
            self.events_pub.left(self.registry.workers[msg.worker_id], "deregistered")
        n = self.registry.drop(msg.worker_id)
        self.stats.dropped_by["deregister"].inc()
        self.stats.workers.set(len(self.registry.workers))
        return proto.DeregisterReply(msg.rid, n)

    def heartbeat(self, peer: bytes, msg: proto.Heartbeat) -> Any:
        entry = self._entry(peer, msg.worker_id)
        if entry is None:
            return self._not_registered(msg)
        # Batches and this heartbeat share one ordered connection: a last_seq ahead of
        # what arrived means events were lost on the way.
        resync = (
            entry.held is None
            and msg.last_seq > entry.last_seq
            and self._resync(entry, "events lost")
        )
        return proto.HeartbeatReply(msg.rid, resync)

    def events(self, peer: bytes, msg: proto.KVEventBatch, nbytes: int) -> Any:
        """Apply msg (nbytes: its frame's size), or hold it while a full state is applied."""
        entry = self._entry(peer, msg.worker_id)
        if entry is None:
            return self._not_registered(msg)
        if len(msg.events) > proto.MAX_EVENTS_PER_BATCH:
            return proto.error_reply(msg.rid, ErrorCode.BAD_REQUEST, "batch too large")
        if entry.held is not None:  # its full state is being applied: these follow it
            self._hold(entry, msg, nbytes)
            return None
        if entry.resync_sent:
            # Waiting for its FullState, which covers these events; re-ask if it is late.
            self._resync(entry, "full state overdue")
            return None
        if msg.first_seq != entry.last_seq + 1:
            self._resync(entry, f"gap: expected seq {entry.last_seq + 1}, got {msg.first_seq}")
            return None
        self.registry.apply(entry, msg.events)
        if self.events_pub is not None:
            self.events_pub.events(entry, msg.events)
        entry.last_seq = msg.first_seq + len(msg.events) - 1
        self.stats.events.inc(len(msg.events))
        return None

    def _hold(self, entry: WorkerEntry, msg: proto.KVEventBatch, nbytes: int) -> None:
        """Keep msg for after the full state, or, past a bound, drop it and all held
        before it: the resync that follows the state covers them."""
        held = entry.held
        if held is None or entry.held_overflow:
            return
        if len(held) >= MAX_HELD_BATCHES:
            self._overflow(entry, "batches")
            return
        cost = held_cost(msg, nbytes)
        if entry.held_bytes + cost > MAX_HELD_BYTES:
            self._overflow(entry, "bytes")
            return
        # Over the total, the largest holder gives its batches up first: dropping the
        # sender's (maybe none) would free nothing, and every worker after it would
        # resync too (after a controller restart all of them send their states at once).
        while self.held_bytes + cost > MAX_HELD_BYTES_TOTAL:
            largest = max(
                (e for e in self.registry.workers.values() if e.held_bytes and e is not entry),
                key=lambda e: e.held_bytes,
                default=None,
            )
            if largest is None or largest.held_bytes <= entry.held_bytes + cost:
                self._overflow(entry, "total_bytes")
                return
            self._overflow(largest, "total_bytes")
        held.append(msg)
        entry.held_bytes += cost
        self.held_bytes += cost
        self.stats.held_bytes.set(self.held_bytes)

    def _overflow(self, entry: WorkerEntry, bound: str) -> None:
        """Drop entry's held batches (freed now: the resync after its state replaces
        what they say) and ignore its later ones until then."""
        log.warning(
            "held event batches dropped, the worker resyncs after its full state",
            worker=entry.worker_id,
            bound=bound,
            batches=len(entry.held or ()),
            held_bytes=entry.held_bytes,
            all_held_bytes=self.held_bytes,
        )
        self._set_held(entry, [])
        entry.held_overflow = True
        self.stats.held_overflows[bound].inc()

    def _set_held(self, entry: WorkerEntry, held: list[Any] | None) -> None:
        """Give entry's held batches up (their bytes off the total) for `held`."""
        self.held_bytes -= entry.held_bytes
        entry.held, entry.held_bytes = held, 0
        self.stats.held_bytes.set(self.held_bytes)

    def _resync(self, entry: WorkerEntry, reason: str) -> bool:
        """Push a Resync unless one is pending and not yet overdue; True when pending."""
        now = time.monotonic()
        if entry.resync_sent and now - entry.resync_sent < 3 * entry.heartbeat_s:
            return True
        if entry.peer is None or not self.push(
            entry.peer, proto.Resync(0, entry.worker_id, reason)
        ):
            return False
        entry.resync_sent = now
        self.stats.resyncs.inc()
        return True

    def full_state(self, peer: bytes, msg: proto.FullState) -> Any:
        entry = self._entry(peer, msg.worker_id)
        if entry is None:
            return self._not_registered(msg)
        # Batches after this message are later than the state: held until it is in.
        # A full state arriving while another is applied supersedes it.
        self._set_held(entry, [])
        entry.held_overflow = False
        steps = self.registry.replace_steps(entry, msg.tiers)
        # Its generation now, not when its task first runs: a later full state may be
        # begun in the same loop turn, and this one would take that one's for its own.
        return self._apply_full_state(peer, entry, msg, steps, entry.state_gen)

    async def _apply_full_state(
        self,
        peer: bytes,
        entry: WorkerEntry,
        msg: proto.FullState,
        steps: Iterator[None],
        gen: int,
    ) -> Any:
        def current() -> bool:  # not superseded by a later full state, not gone
            return entry.state_gen == gen and self.registry.workers.get(entry.worker_id) is entry

        try:
            try:
                for _ in steps:
                    await asyncio.sleep(0)
            finally:
                steps.close()
            if current() and self.events_pub is not None:
                published = self.events_pub.state(entry, msg.tiers)
                try:
                    for _ in published:
                        await asyncio.sleep(0)
                        if not current():
                            break  # its last step would publish a state now void
                finally:
                    published.close()
        except BaseException:
            if entry.state_gen == gen:  # its held batches are this state's: free them
                self._set_held(entry, None)
                entry.held_overflow = False
                if current():  # stopped, or a bug: no batch may wait for it forever
                    self._resync(entry, "full state not applied")
            raise
        if not current():
            # Superseded by a later full state (which holds the batches now), or gone:
            # then nobody will apply its held batches, and their bytes must count no more.
            if entry.state_gen == gen:
                self._set_held(entry, None)
                entry.held_overflow = False
            return proto.error_reply(
                msg.rid, ErrorCode.NOT_REGISTERED, "full state superseded or worker gone"
            )
        held, overflow = entry.held or [], entry.held_overflow
        self._set_held(entry, None)
        entry.held_overflow = False
        entry.last_seq, entry.resync_sent = msg.seq, 0.0
        for batch in held:
            self.events(peer, batch, 0)  # applied now, not held: its size is not needed
        if overflow:
            self._resync(entry, "events dropped while the full state was applied")
        return proto.FullStateReply(msg.rid, sum(len(s) for s in entry.tiers.values()))

    def command_reply(self, peer: bytes, msg: proto.CommandReply) -> Any:
        self.fanout.on_reply(peer, msg)
        return None

    # -- lookups and listings -----------------------------------------------------------
    def p2p_lookup(self, peer: bytes, msg: proto.P2PLookup) -> Any:
        if len(msg.keys) > proto.MAX_LOOKUP_KEYS:
            return proto.error_reply(msg.rid, ErrorCode.BAD_REQUEST, "too many keys")
        found = self.registry.locate(msg.keys, msg.exclude_instance)
        if found is None:
            self.stats.lookup_miss.inc()
            return proto.P2PLookupReply(msg.rid)
        entry, count = found
        self.stats.lookup_hit.inc()
        return proto.P2PLookupReply(
            msg.rid, entry.instance_id, entry.rank, entry.p2p_endpoint, count
        )

    def prefix_counts(self, peer: bytes, msg: proto.PrefixCounts) -> Any:
        if len(msg.hashes) > proto.MAX_LOOKUP_KEYS:
            return proto.error_reply(msg.rid, ErrorCode.BAD_REQUEST, "too many hashes")
        if any(len(h) != 16 for h in msg.hashes):
            return proto.error_reply(msg.rid, ErrorCode.BAD_REQUEST, "hashes must be 16 bytes each")
        counts = self.registry.prefix_counts(msg.hashes, msg.instance_id)
        return proto.PrefixCountsReply(msg.rid, [proto.InstancePrefix(*c) for c in counts])

    def list_workers(self, peer: bytes, msg: proto.ListWorkers) -> Any:
        return proto.ListWorkersReply(msg.rid, self.worker_infos())

    def worker_infos(self) -> list[proto.WorkerInfo]:
        now = time.monotonic()
        return [
            proto.WorkerInfo(
                e.worker_id,
                e.instance_id,
                e.rank,
                e.world_size,
                e.p2p_endpoint,
                e.counts(),
                e.last_seq,
                round(now - e.last_seen, 3),
                e.restored,
                e.lookup_endpoint,
            )
            for e in sorted(self.registry.workers.values(), key=lambda e: e.worker_id)
        ]

    def check_finish(self, peer: bytes, msg: proto.CheckFinish) -> Any:
        known = self.fanout.events.get(msg.event_id)
        if known is None:
            return proto.error_reply(
                msg.rid, ErrorCode.BAD_REQUEST, f"unknown event id {msg.event_id!r}"
            )
        return proto.AdminReply(msg.rid, msg.event_id, known[0], known[1])

    # -- admin fan-out ------------------------------------------------------------------
    async def admin(self, peer: bytes, msg: proto.Clear | proto.Pin | proto.Health) -> Any:
        if not msg.event_id or len(msg.event_id) > MAX_ID_CHARS:
            return proto.error_reply(msg.rid, ErrorCode.BAD_REQUEST, "event_id: 1-256 characters")
        if isinstance(msg, proto.Pin) and len(msg.keys) > move.MAX_MOVE_KEYS:
            return proto.error_reply(
                msg.rid, ErrorCode.BAD_REQUEST, f"at most {move.MAX_MOVE_KEYS} keys a pin"
            )
        targets = [
            w
            for w in self.registry.workers.values()
            if not msg.instance_id or w.instance_id == msg.instance_id
        ]
        if isinstance(msg, proto.Clear):
            op, tier, keys = "clear", msg.tier, []
        elif isinstance(msg, proto.Pin):
            op, tier, keys = ("unpin" if msg.unpin else "pin"), "", msg.keys
        else:
            op, tier, keys = "health", "", []
        results = await self.fanout.run(msg.event_id, op, targets, tier, keys)
        return proto.AdminReply(msg.rid, msg.event_id, True, results)

    async def move(self, peer: bytes, msg: proto.Move) -> Any:
        if not msg.event_id or len(msg.event_id) > MAX_ID_CHARS:
            return proto.error_reply(msg.rid, ErrorCode.BAD_REQUEST, "event_id: 1-256 characters")
        try:
            plans = move.plan(self.registry, msg)
        except move.MoveRefused as exc:
            return proto.error_reply(msg.rid, ErrorCode.BAD_REQUEST, str(exc))
        results = await move.run(self.fanout, msg, plans)
        return proto.AdminReply(msg.rid, msg.event_id, True, results)

    async def compress(self, peer: bytes, msg: proto.Compress) -> Any:
        if not msg.event_id or len(msg.event_id) > MAX_ID_CHARS:
            return proto.error_reply(msg.rid, ErrorCode.BAD_REQUEST, "event_id: 1-256 characters")
        if msg.method not in proto.COMPRESS_METHODS:
            return proto.error_reply(
                msg.rid,
                ErrorCode.BAD_REQUEST,
                f"method {msg.method!r:.40}: one of {', '.join(proto.COMPRESS_METHODS)}",
            )
        if msg.tier not in proto.COMPRESS_TIERS:
            return proto.error_reply(
                msg.rid, ErrorCode.BAD_REQUEST, f"tier {msg.tier!r:.40}: disk or remote"
            )
        if len(msg.keys) > move.MAX_MOVE_KEYS:
            return proto.error_reply(
                msg.rid,
                ErrorCode.BAD_REQUEST,
                f"at most {move.MAX_MOVE_KEYS} keys (none: every chunk)",
            )
        if not 0 <= msg.timeout_s <= MAX_COMPRESS_S:
            return proto.error_reply(
                msg.rid, ErrorCode.BAD_REQUEST, f"timeout_s: 0 to {MAX_COMPRESS_S:.0f}"
            )
        targets = [
            w
            for w in self.registry.workers.values()
            if not msg.instance_id or w.instance_id == msg.instance_id
        ]
        results = await self.fanout.run(
            msg.event_id,
            "compress",
            targets,
            msg.tier,
            msg.keys,
            method=msg.method,
            timeout_s=msg.timeout_s,
        )
        return proto.AdminReply(msg.rid, msg.event_id, True, results)

    async def unsupported(self, peer: bytes, msg: Any) -> Any:
        self.stats.errors[ErrorCode.UNSUPPORTED].inc()
        op = msg.__struct_config__.tag
        return proto.error_reply(msg.rid, ErrorCode.UNSUPPORTED, f"{op} is not supported yet")

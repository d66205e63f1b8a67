"""The worker engine's link to the controller: registration, heartbeats, batched KV
events, full-state resyncs, admin commands, and P2P lookups (the PeerLocator).

Runs on the engine's event loop (LoopThread); nothing here blocks inference. The
controller being down only means no events reach it and `locate` finds no peer: the
client keeps saying hello every heartbeat period and re-registers when it answers
(its registry then comes back from the snapshot plus this worker's full state).

Sequence numbers are this client's own: each event sent gets the next one. Events
lost on the way (a full send queue, or this client's event subscription overflowing)
still advance the count, so the controller sees a gap and asks for a resync.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvmesh.common import offload
from kvmesh.common.config import EngineControllerConfig
from kvmesh.common.keys import ChunkKey
from kvmesh.common.observability import get_logger
from kvmesh.common.protocol import controller as proto
from kvmesh.common.transport.controller_client import (
    ControllerConnection,
    ControllerError,
    ControllerUnavailable,
)
from kvmesh.services.worker import peer_copy
from kvmesh.services.worker.compress import CompressResult, rewrite_chunks
from kvmesh.services.worker.peer_locator import PeerLocation

if TYPE_CHECKING:
    from kvmesh.services.worker.engine import KVEngine

log = get_logger(__name__)

_REREGISTER = frozenset({proto.ErrorCode.NO_HELLO, proto.ErrorCode.NOT_REGISTERED})
# Keys parsed (~3 µs each) and pinned on the engine's loop up to this many (~1 ms, the
# cost of `offload.OFFLOAD_FROM` bytes of copying); more go to a thread.
KEYS_ON_LOOP = 256


class ControllerClient:
    """Build with an engine, `start_controller_client` runs it; implements PeerLocator."""

    def __init__(self, engine: KVEngine, config: EngineControllerConfig | None = None) -> None:
        self.engine = engine
        self.cfg = config if config is not None else engine.config.controller
        self.worker_id = f"{engine.instance_id}/{engine.rank}"
        self._sub = engine.events.subscribe("controller")
        self._conn: ControllerConnection | None = None
        self._tasks: list[asyncio.Task] = []
        self._side: set[asyncio.Task] = set()
        self._seq = 0  # seq of the last event sent (or lost)
        self._seen_dropped = 0
        # Full states being built or sent: events wait meanwhile, so none recorded after
        # the state's snapshot goes out numbered at or below the state's seq.
        self._states = 0
        self._pinning = asyncio.Lock()  # pin and unpin commands, in arrival order
        self.registered = False
        self.registrations = 0
        self.resyncs = 0
        self._sent_lookup_endpoint = ""

    # -- lifecycle (on the engine's loop) ----------------------------------------------
    async def start(self) -> None:
        self._conn = ControllerConnection(
            self.cfg.url,
            timeout_s=self.cfg.timeout_s,
            client=f"worker {self.worker_id}",
            on_push=self._on_push,
            curve=self.engine.curve,
        )
        await self._conn.connect(hello=False)
        self._tasks = [
            asyncio.create_task(self._session_loop(), name="controller-session"),
            asyncio.create_task(self._event_loop(), name="controller-events"),
        ]

    async def aclose(self) -> None:
        """Flush events and deregister (within the deadline), then cancel tasks, then
        close the connection."""
        conn = self._conn
        if conn is not None and self.registered:
            self._flush_events()
            try:
                await conn.request(
                    proto.Deregister(conn.next_rid(), self.worker_id), proto.DeregisterReply
                )
            except (ControllerError, ControllerUnavailable) as exc:
                log.info("deregister failed", worker=self.worker_id, error=str(exc))
        self.registered = False
        tasks = [*self._tasks, *self._side]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if conn is not None:
            await conn.close()
        self.engine.events.unsubscribe(self._sub)

    def close(self) -> None:
        """The engine's close hook: run aclose on the engine's loop, bounded."""
        try:
            self.engine.loop.run(self.aclose(), self.cfg.timeout_s + 2.0)
        except (TimeoutError, RuntimeError) as exc:
            log.warning("controller client did not close cleanly", error=str(exc))

    @property
    def events_dropped(self) -> int:
        """KV events lost before they reached the controller (a resync repairs them)."""
        return self._sub.dropped

    # -- session: register, heartbeat ----------------------------------------------------
    async def _session_loop(self) -> None:
        while True:
            if not self.registered:
                try:
                    await self._register()
                except (ControllerError, ControllerUnavailable) as exc:
                    log.debug("controller not reached", url=self.cfg.url, error=str(exc))
                    await asyncio.sleep(self.cfg.heartbeat_s)
                    continue
            await asyncio.sleep(self.cfg.heartbeat_s)
            if self._lookup_endpoint() != self._sent_lookup_endpoint:
                # A lookup server bound after we registered: register it too.
                self.registered = False
                continue
            await self._heartbeat()

    def _lookup_endpoint(self) -> str:
        return str(getattr(self.engine, "lookup_endpoint", "") or "")

    async def _register(self) -> None:
        conn = self._conn
        assert conn is not None
        await conn.hello()
        engine = self.engine
        lookup_endpoint = self._lookup_endpoint()
        await conn.request(
            proto.Register(
                conn.next_rid(),
                engine.instance_id,
                engine.rank,
                engine.world_size,
                [engine.namespace.ns_id],
                str(getattr(engine, "p2p_endpoint", "") or ""),
                self.cfg.heartbeat_s,
                lookup_endpoint,
            ),
            proto.RegisterReply,
        )
        self._sent_lookup_endpoint = lookup_endpoint
        await self._send_full_state()
        self.registered = True
        self.registrations += 1
        log.info("registered with the controller", worker=self.worker_id, url=self.cfg.url)

    async def _heartbeat(self) -> None:
        conn = self._conn
        assert conn is not None
        self._flush_events()  # so last_seq only names events already on the wire
        try:
            await conn.request(
                proto.Heartbeat(conn.next_rid(), self.worker_id, self._seq), proto.HeartbeatReply
            )
        except ControllerError as exc:
            if exc.code in _REREGISTER:  # the controller restarted or dropped us
                self.registered = False
        except ControllerUnavailable:
            pass  # down or restarting: the next heartbeat tries again

    async def _send_full_state(self) -> None:
        conn = self._conn
        assert conn is not None
        # Events not yet sent are older than the state taken now: it covers them.
        self._sub.drain()
        self._seen_dropped = self._sub.dropped
        held = self.engine.storage.l1.keys()  # a copy, taken under the tier's lock
        self._states += 1
        try:
            # ~0.3 µs a key: a thread, so a large L1 does not hold the engine's loop (the
            # GIL comes back to it every switch interval).
            keys = await asyncio.to_thread(lambda: [k.to_str() for k in held])
            await conn.request(
                proto.FullState(conn.next_rid(), self.worker_id, self._seq, {"l1": keys}),
                proto.FullStateReply,
                deadline_s=max(self.cfg.timeout_s, 5.0),
            )
        finally:
            self._states -= 1

    # -- events -------------------------------------------------------------------------
    async def _event_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.event_flush_s)
            if self.registered:
                self._flush_events()

    def _flush_events(self) -> None:
        conn = self._conn
        if conn is None or self._states:
            return
        dropped = self._sub.dropped
        if dropped > self._seen_dropped:  # fell behind: leave a gap, the controller resyncs
            self._seq += dropped - self._seen_dropped
            self._seen_dropped = dropped
        batch = self.cfg.event_batch
        while True:
            events = self._sub.drain(batch)
            if not events:
                return
            items = [(int(e.kind), e.key, e.tier) for e in events]
            conn.send(proto.KVEventBatch(0, self.worker_id, self._seq + 1, items))
            self._seq += len(items)  # a batch not sent is a gap the heartbeat reveals
            if len(events) < batch:
                return

    # -- pushes from the controller ------------------------------------------------------
    def _on_push(self, msg: Any) -> None:
        if isinstance(msg, proto.Resync):
            self._spawn(self._resync())
        elif isinstance(msg, proto.Command):
            self._spawn(self._execute(msg))

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._side.add(task)
        task.add_done_callback(self._side.discard)

    async def _resync(self) -> None:
        if not self.registered:
            return  # registering sends the full state anyway
        self.resyncs += 1
        try:
            await self._send_full_state()
        except (ControllerError, ControllerUnavailable) as exc:
            log.warning("resync failed", worker=self.worker_id, error=str(exc))

    async def _execute(self, cmd: proto.Command) -> None:
        engine, l1 = self.engine, self.engine.storage.l1
        ok, count, error, detail = True, 0, "", {}
        keys: list[str] = []
        try:
            if cmd.op == "clear":
                count = await asyncio.to_thread(engine.clear, None, cmd.tier or None)
                # The state after it also repairs what the clear's events could not
                # carry (more than the event buffer holds).
                await self._send_full_state()
            elif cmd.op in ("pin", "unpin"):
                act = l1.pin if cmd.op == "pin" else l1.unpin
                keys_in = cmd.keys

                def pin() -> int:
                    return sum(act(ChunkKey.from_str(k)) for k in keys_in)

                # One at a time, in arrival order: a later unpin must not pass a large
                # pin still running on its thread.
                async with self._pinning:
                    count = pin() if len(keys_in) <= KEYS_ON_LOOP else await offload.offload(pin)
            elif cmd.op == "health":
                detail = {
                    "l1_chunks": len(l1),
                    "l1_used_bytes": engine.pool.used_bytes,
                    "events_dropped": self.events_dropped,
                    "last_seq": self._seq,
                }
                count = len(l1)
            elif cmd.op == "keys":
                keys = peer_copy.l1_keys(engine)
                count = len(keys)
            elif cmd.op == "fetch":
                got = await peer_copy.fetch(engine, cmd.source, cmd.keys, cmd.deadline_s)
                keys, count = got.held, got.copied
                detail = {
                    "requested": got.requested,
                    "copied": got.copied,
                    "present": got.present,
                    "failed": got.failed,
                }
                if got.failed:
                    ok = False
                    error = got.error or f"{got.failed} of {got.requested} chunks not copied"
            elif cmd.op == "compress":
                done = await asyncio.to_thread(_compress, engine, cmd)
                count, detail = done.rewritten, done.detail
                if done.timed_out or done.failed:
                    ok = False
                    error = (
                        f"deadline passed after {done.tried} of {done.asked} chunks"
                        if done.timed_out
                        else f"{done.failed} of {done.asked} chunks not rewritten"
                    )
            elif cmd.op == "remove":
                count, kept = await peer_copy.remove(engine, cmd.keys)
                detail = {"removed": count, "kept": kept}
            else:
                ok, error = False, f"{cmd.op}: unsupported"
        except (peer_copy.CopyRefused, ValueError) as exc:  # refusals that explain themselves
            ok, error = False, str(exc)
        except Exception as exc:  # answered, not raised: the controller waits on us
            ok, error = False, repr(exc)[:300]
        conn = self._conn
        if conn is not None:
            reply = proto.CommandReply(cmd.rid, self.worker_id, ok, count, error, detail, keys)
            conn.send(reply)

    # -- PeerLocator ----------------------------------------------------------------------
    def locate(self, keys: Sequence[ChunkKey], timeout: float) -> PeerLocation | None:
        """Blocking lookup from a thread other than the engine's loop (there, use
        `alocate`: blocking the loop would deadlock, so this answers None). Never raises."""
        try:
            loop = self.engine.loop
            if not self.registered or not keys or loop.in_loop_thread():
                return None
            # The caller is vLLM's scheduler: a busy loop costs it at most the lookup's
            # deadline again (it was half a second more, ten times the default).
            return loop.run(self.alocate(keys, timeout), 2 * timeout)
        except Exception:
            return None

    async def alocate(self, keys: Sequence[ChunkKey], timeout_s: float) -> PeerLocation | None:
        """The same, awaited on the engine's loop. Never raises."""
        conn = self._conn
        if conn is None or not self.registered or not keys:
            return None
        try:
            reply = await conn.request(
                proto.P2PLookup(
                    conn.next_rid(), [k.to_str() for k in keys], self.engine.instance_id
                ),
                proto.P2PLookupReply,
                deadline_s=timeout_s,
            )
        except (ControllerError, ControllerUnavailable):
            return None
        except Exception:
            return None
        if reply.count <= 0 or not reply.endpoint:
            return None
        return PeerLocation(
            reply.instance_id, reply.rank, reply.endpoint, min(reply.count, len(keys))
        )


def start_controller_client(
    engine: KVEngine, config: EngineControllerConfig | None = None
) -> ControllerClient:
    """Start the client on the engine's loop (it registers in the background), make it
    the engine's peer locator, and stop it when the engine closes. KVEngine calls it
    when `engine.controller.enabled`; config overrides that section (an engine
    attached to a controller after it was built)."""
    client = ControllerClient(engine, config)
    engine.loop.run(client.start(), 10.0)
    engine.controller_client = client
    engine.peer_locator = client
    engine.add_close_hook(client.close)
    return client


def wait_registered(client: ControllerClient, timeout: float) -> bool:
    """Poll until the client registered (tests, CLI); True when it did in time."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if client.registered:
            return True
        time.sleep(0.01)
    return client.registered


def _compress(engine: KVEngine, cmd: proto.Command) -> CompressResult:
    # On a thread, the keys' parsing included: a command may name 65k of them.
    keys = [ChunkKey.from_str(k) for k in cmd.keys] or None
    return rewrite_chunks(engine, keys, cmd.method, cmd.tier, deadline_s=cmd.deadline_s or None)

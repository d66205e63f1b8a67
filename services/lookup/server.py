"""The lookup-server: "how much of this prompt is cached, and where", for schedulers
and routers (protocol: common/protocol/lookup_service.py).

One asyncio process with one ZMQ ROUTER. One task reads the socket and decodes each
frame with one reused decoder; every valid request runs as its own task (it waits on
workers or the controller), bounded by MAX_INFLIGHT, and always gets a reply.

- Scheduler-facing `Lookup`: the instance's workers and their lookup endpoints come
  from the controller's worker list (re-read at most every `registry_refresh_s`, or
  at once for an instance not known yet); each rank is asked at once with a deadline
  (workers.py), the answer is the minimum over ranks, and the ranks pin what they
  counted. An answer of 0 releases the pins of the ranks that did count.
- Router-facing `BestInstances`: the prompt's chunk hashes (computed here with the
  configured chunk size and hash) are ranked per instance against the registry.

The registry is read from the server's own copy (index.py, kept by follower.py from
the controller's pushed changes) while that copy is in sync, and from the controller
(`PrefixCounts`, `ListWorkers`) otherwise: see follower.py for the staleness rule.
Replies say which (`source`), and `lookup_controller_fallbacks_total` counts the
requests that had to ask. While the controller does not answer, lookups and releases
go on with the last worker list known (the workers' counts are the answer). With
`metrics_port`, `/metrics` and `/health` are served (common/observability/http.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import Any

import structlog
import zmq
import zmq.asyncio

from kvmesh.common.config import LookupConfig
from kvmesh.common.keys import KeyNamespace
from kvmesh.common.observability import Metrics, get_logger
from kvmesh.common.observability.http import ProbeServer
from kvmesh.common.protocol import controller as cproto
from kvmesh.common.protocol import lookup as wire
from kvmesh.common.protocol import lookup_service as proto
from kvmesh.common.protocol.lookup_service import ErrorCode
from kvmesh.common.tokendb import ChunkedTokenDatabase
from kvmesh.common.transport.controller_client import (
    ControllerConnection,
    ControllerError,
    ControllerUnavailable,
)
from kvmesh.common.transport.curve import CurveGuard, CurveKeys
from kvmesh.common.transport.frames import FrameReader
from kvmesh.common.transport.router_loop import bind_tcp
from kvmesh.common.transport.tcp_address import bind_host_async
from kvmesh.services.lookup import workers as worker_pool
from kvmesh.services.lookup.follower import IndexFollower
from kvmesh.services.lookup.workers import WorkerPool

log = get_logger(__name__)

MAX_INFLIGHT = 1024
MAX_MESSAGE_BYTES = 64 << 20
# Request bytes held by the requests in flight: past it a request is answered "busy"
# (16 lookups of the largest prompt), so the task bound is not 1024 x 16 MiB.
MAX_INFLIGHT_BYTES = 256 << 20
# Per client: what the loop has not read yet stays in the client's socket (TCP pushes
# back), not here.
RCV_HWM = 32
# Prompts longer than this are hashed on a thread: a 4M-token prompt costs ~50 ms.
HASH_ON_LOOP_TOKENS = 16_384
# While the controller does not answer, it is asked again at most this often (by one
# request; the others are answered without it at once).
CONTROLLER_RETRY_S = 0.5
OPS = ("hello", "lookup", "release", "best", "invalid")
# How often the registered workers are looked at for engines not asked their chunk size yet.
CHUNK_CHECK_S = 5.0
# Engines asked per round at most: the check shares the worker pool with the requests,
# and a round past its room would close the sockets they wait on.
CHUNK_CHECK_BATCH = 64
# An engine that does not answer is asked again after CHUNK_CHECK_S, then twice as long
# each time, up to this.
CHUNK_CHECK_BACKOFF_MAX_S = 300.0
# What an instance's worker list is read for; WorkerInfo (controller) or IndexWorker.
Worker = cproto.WorkerInfo | cproto.IndexWorker


class Unavailable(Exception):
    """The controller did not answer: the request gets UNAVAILABLE."""


class Refused(Exception):
    """The controller refused the request itself: retrying cannot help (BAD_MESSAGE)."""


class LookupService:
    """Build with a config, `await start()`, then `await wait_closed()` or `stop()`."""

    def __init__(
        self,
        config: LookupConfig,
        *,
        name: str = "kvmesh-lookup",
        curve: CurveKeys | None = None,
    ) -> None:
        self.config = config
        self.curve = curve
        self.guard: CurveGuard | None = None
        self.name = name
        self.port = 0
        self.metrics = m = Metrics({"service": "lookup"})
        self._requests = m.counter(
            "lookup_requests_total", "Requests, by op and outcome (ok or the error code)",
            ["op", "outcome"],
        )  # fmt: skip
        seconds = m.histogram("lookup_request_seconds", "Time to answer a request", ["op"])
        self._seconds = {op: seconds.labels(op=op) for op in OPS}
        fallbacks = m.counter(
            "lookup_controller_fallbacks_total",
            "Registry reads that asked the controller (index off or not in sync, or an "
            "instance the index lacks), by op",
            ["op"],
        )
        from_index = m.counter(
            "lookup_index_answers_total", "Registry reads answered from the index, by op", ["op"]
        )
        last_known = m.counter(
            "lookup_last_known_workers_total",
            "Worker lists taken from the last one known because the controller did not "
            "answer (lookups and releases still ask the workers), by op",
            ["op"],
        )
        self._fallbacks = {op: fallbacks.labels(op=op) for op in OPS}
        self._from_index = {op: from_index.labels(op=op) for op in OPS}
        self._last_known = {op: last_known.labels(op=op) for op in ("lookup", "release")}
        counters = (*self._fallbacks.values(), *self._from_index.values())
        for c in (*counters, *self._last_known.values()):
            c.inc(0)
        self.started = time.monotonic()
        self.http: ProbeServer | None = None
        self.follower: IndexFollower | None = None
        if config.index:
            self.follower = IndexFollower(
                config.controller_url,
                m,
                ping_s=config.index_ping_s,
                max_staleness_s=config.index_max_staleness_s,
                request_timeout_s=config.controller_timeout_s,
                snapshot_timeout_s=config.index_snapshot_timeout_s,
                name=f"{name}-index",
                curve=curve,
            )
        self._ctx = zmq.asyncio.Context()
        self._sock: zmq.asyncio.Socket | None = None
        self._controller = ControllerConnection(
            config.controller_url, timeout_s=config.controller_timeout_s, client=name, curve=curve
        )
        self._hello_done = False
        self._pool = WorkerPool(curve)
        # (worker id, lookup endpoint) of the engines that said their chunk size.
        self._chunk_checked: set[tuple[str, str]] = set()
        # Those that did not answer yet → (when to ask again, the wait before that).
        self._chunk_retry: dict[tuple[str, str], tuple[float, float]] = {}
        self._chunk_mismatch = m.counter(
            "lookup_chunk_size_mismatch_total",
            "Workers whose engines chunk prompts otherwise than lookup.chunk_size (their "
            "chunks never match the hashes best_instances computes)",
        )
        self._chunk_mismatch.inc(0)
        self._tasks: list[asyncio.Task] = []
        self._inflight: set[asyncio.Task] = set()
        self._inflight_bytes = 0
        self._closed = asyncio.Event()
        self._stopping = False
        self._workers: dict[str, list[Worker]] = {}
        self._workers_at = 0.0
        # The one ListWorkers in flight (concurrent requests wait on it) and when the
        # last one was started.
        self._listing: asyncio.Task | None = None
        self._listed_at = float("-inf")
        # When an ask found the controller not answering (None: the last one got an
        # answer), and whether one asks it again now.
        self._controller_failed_at: float | None = None
        self._probing = False
        ns = KeyNamespace(model="-", kv_layout="-", dtype="-", world_size=1, rank=0)
        self._tokendb = ChunkedTokenDatabase(
            ns, chunk_size=config.chunk_size, hash_algorithm=config.hash_algorithm
        )
        self._handlers: dict[type, Callable[[Any], Awaitable[proto.Reply]]] = {
            proto.Hello: self._hello,
            proto.Lookup: self._lookup,
            proto.Release: self._release,
            proto.BestInstances: self._best,
        }

    # -- lifecycle ----------------------------------------------------------------------
    async def start(self) -> None:
        sock = self._ctx.socket(zmq.ROUTER)
        sock.linger = 0
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        sock.setsockopt(zmq.RCVHWM, RCV_HWM)
        self.guard = CurveGuard(self._ctx, self.curve, self.metrics, "lookup")
        self.guard.serve(sock)
        self.port = bind_tcp(sock, await bind_host_async(self.config.host), self.config.port)
        self._sock = sock
        await self._controller.connect(hello=False)
        if self.follower is not None:
            await self.follower.start()
        if self.config.metrics_port:
            self.http = ProbeServer(self.metrics, self.health_report, self.config.host)
            await self.http.start(self.config.metrics_port)
        self._tasks = [
            asyncio.create_task(self._serve(), name="lookup-serve"),
            asyncio.create_task(self._check_chunk_sizes(), name="lookup-chunk-check"),
        ]
        log.info(
            "lookup-server ready",
            port=self.port,
            metrics_port=self.http.port if self.http else None,
            controller=self.config.controller_url,
        )

    async def stop(self) -> None:
        """Cancel tasks, then close the sockets, then the context."""
        if self._stopping:
            return
        self._stopping = True
        if self.http is not None:
            await self.http.stop()
        tasks = [*self._tasks, *self._inflight, *([self._listing] if self._listing else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._controller.close()
        if self.follower is not None:
            await self.follower.stop()
        await self._pool.close()
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None
        if self.guard is not None:
            await asyncio.to_thread(self.guard.close)
        # destroy, not term: after a failed start a socket may be left open, and
        # term() would wait for it on the loop for ever.
        self._ctx.destroy(linger=0)
        log.info("lookup-server stopped")
        self._closed.set()

    async def wait_closed(self) -> None:
        await self._closed.wait()

    def health_report(self) -> dict[str, Any]:
        report: dict[str, Any] = {
            "status": "ok",
            "uptime_s": round(time.monotonic() - self.started, 3),
            "protocol_version": proto.PROTOCOL_VERSION,
            "index": {"enabled": self.follower is not None},
        }
        f = self.follower
        if f is not None:
            index = f.index
            report["index"] |= {
                "in_sync": f.in_sync(),
                "staleness_s": f.staleness_s(),
                "epoch": f.epoch,
                "seq": f.seq,
                "chunks": index.chunks if index else 0,
                "workers": len(index.workers) if index else 0,
            }
        return report

    # -- the ROUTER loop ----------------------------------------------------------------
    async def _serve(self) -> None:
        assert self._sock is not None
        reader = FrameReader(self._sock, 2)
        while True:
            frames, dropped = await reader.recv()
            if len(frames) < 2:
                continue  # nothing to answer to
            peer = frames[0].bytes
            if dropped:
                err = proto.error_reply(0, ErrorCode.BAD_MESSAGE, "one frame expected")
                await self._send(peer, err, "invalid")
                continue
            try:
                msg = proto.decode_request(frames[1].buffer)
            except proto.MalformedMessage as exc:
                await self._send(peer, exc.reply, "invalid")
                continue
            size = len(frames[1].buffer)
            if (
                len(self._inflight) >= MAX_INFLIGHT
                or self._inflight_bytes + size > MAX_INFLIGHT_BYTES
            ):
                busy = proto.error_reply(msg.rid, ErrorCode.SHUTTING_DOWN, "busy")
                await self._send(peer, busy, msg.__struct_config__.tag)
                continue
            task = asyncio.create_task(self._handle(peer, msg))
            self._inflight.add(task)
            self._inflight_bytes += size
            task.add_done_callback(lambda t, n=size: self._done(t, n))

    def _done(self, task: asyncio.Task, size: int) -> None:
        self._inflight.discard(task)
        self._inflight_bytes -= size

    async def _handle(self, peer: bytes, msg: Any) -> None:
        op = msg.__struct_config__.tag
        t0 = time.perf_counter()
        try:
            reply = await self._handlers[type(msg)](msg)
        except Unavailable as exc:
            reply = proto.error_reply(msg.rid, ErrorCode.UNAVAILABLE, str(exc))
        except Refused as exc:
            reply = proto.error_reply(msg.rid, ErrorCode.BAD_MESSAGE, str(exc))
        except Exception as exc:  # a bug: answer, log, keep serving
            log.exception("lookup request failed", op=op)
            reply = proto.error_reply(msg.rid, ErrorCode.INTERNAL, repr(exc))
        except asyncio.CancelledError:
            if _cancelled_itself():
                raise  # stop()
            # A future cancelled under the request (a socket closed under a send): the
            # client still gets an answer.
            log.exception("lookup request cancelled from under it", op=op)
            reply = proto.error_reply(msg.rid, ErrorCode.INTERNAL, "cancelled from under it")
        self._seconds[op].observe(time.perf_counter() - t0)
        await self._send(peer, reply, op)

    async def _send(self, peer: bytes, reply: proto.Reply, op: str) -> None:
        outcome = "ok"
        if isinstance(reply, proto.ErrorReply):
            try:
                outcome = ErrorCode(reply.code).name.lower()
            except ValueError:
                outcome = str(reply.code)
        self._requests.labels(op=op, outcome=outcome).inc()
        sock = self._sock
        if sock is None:
            return
        try:
            await sock.send_multipart([peer, proto.encode(reply)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # the client is gone or far behind
            log.debug("reply not sent", error=str(exc))

    # -- the controller -----------------------------------------------------------------
    def _controller_down(self) -> bool:
        return self._controller_failed_at is not None

    def _may_ask_controller(self, now: float) -> bool:
        """Up; or down, no ask of it in flight and none failed for CONTROLLER_RETRY_S:
        one request probes it then, the others do not each wait out
        controller_timeout_s meanwhile."""
        failed = self._controller_failed_at
        return failed is None or (not self._probing and now - failed >= CONTROLLER_RETRY_S)

    async def _ask_controller(self, build: Callable[[int], Any], expect: type) -> Any:
        if not self._may_ask_controller(time.monotonic()):
            raise Unavailable("controller did not answer just now")
        probe = self._controller_down()
        self._probing |= probe
        try:
            reply = await self._ask_controller_once(build, expect)
        except Unavailable:
            self._controller_failed_at = time.monotonic()
            raise
        except Refused:
            self._controller_failed_at = None  # it answered
            raise
        finally:
            if probe:
                self._probing = False
        self._controller_failed_at = None
        return reply

    async def _ask_controller_once(self, build: Callable[[int], Any], expect: type) -> Any:
        conn = self._controller
        for _ in range(2):
            try:
                if not self._hello_done:
                    await conn.hello()
                    self._hello_done = True
                return await conn.request(build(conn.next_rid()), expect)
            except ControllerError as exc:
                if exc.code == cproto.ErrorCode.BAD_REQUEST:
                    raise Refused(f"controller refused: {exc}") from None
                if exc.code != cproto.ErrorCode.NO_HELLO:
                    raise Unavailable(f"controller refused: {exc}") from None
                self._hello_done = False  # it restarted: say hello again, once
            except ControllerUnavailable as exc:
                self._hello_done = False
                raise Unavailable(f"controller did not answer: {exc}") from None
        raise Unavailable("controller keeps asking for a hello")

    async def _instance_workers(self, instance_id: str, op: str) -> list[Worker]:
        index = self.follower.synced_index() if self.follower is not None else None
        if index is not None:
            workers = list(index.instance_workers(instance_id))
            if _complete(workers):
                self._from_index[op].inc()
                return workers
        now = time.monotonic()
        stale = now - self._workers_at > self.config.registry_refresh_s
        # An instance not seen yet may have just registered (or registered its lookup
        # endpoint, or another rank): re-read at once, but not more than every 50 ms,
        # so unknown ids cannot hammer the controller. With the index in sync, only an
        # instance it lacks gets here (a registration may be a push behind), and the
        # controller's list must be newer than the index to overrule it.
        unknown = not _complete(self._workers.get(instance_id, [])) or (
            index is not None and self._workers_at < self.follower.last_index()[1]
        )
        if not (stale or (unknown and (self._listing is not None or now - self._listed_at > 0.05))):
            return self._workers.get(instance_id, [])
        if self._listing is None and self._may_ask_controller(now):
            # One read for every request that finds the list stale meanwhile.
            self._listed_at = now
            self._listing = asyncio.create_task(self._list_workers())
            self._listing.add_done_callback(self._listed)
        # The workers answer lookups and releases themselves, so while the controller
        # does not answer the last list known serves: a worker gone since times out as
        # a rank holding nothing, one joined since is not asked (a shorter hit), and an
        # endpoint another worker took over refuses (each request names its worker).
        known = self._last_known_workers(instance_id) if self._controller_down() else []
        if not known:
            if self._listing is None:
                raise Unavailable("controller did not answer just now")
            self._fallbacks[op].inc()
            try:
                await asyncio.shield(self._listing)
                return self._workers.get(instance_id, [])
            except Unavailable:
                known = self._last_known_workers(instance_id)
                if not known:
                    raise
        self._last_known[op].inc()
        return known

    def _last_known_workers(self, instance_id: str) -> list[Worker]:
        """The instance's workers in the newer of the last controller list and the
        index (in sync or not)."""
        index, confirmed = (
            self.follower.last_index() if self.follower is not None else (None, float("-inf"))
        )
        if index is not None and confirmed >= self._workers_at:
            return list(index.instance_workers(instance_id))
        return self._workers.get(instance_id, [])

    async def _list_workers(self) -> None:
        reply = await self._ask_controller(cproto.ListWorkers, cproto.ListWorkersReply)
        grouped: dict[str, list[Worker]] = {}
        for w in reply.workers:
            grouped.setdefault(w.instance_id, []).append(w)
        self._workers, self._workers_at = grouped, time.monotonic()

    async def _check_chunk_sizes(self) -> None:
        """Ask each registered engine (once) for its chunk size, and say so loudly when
        it is not lookup.chunk_size: best_instances would hash prompts into chunks that
        engine never stores, and find nothing of it. Registration carries no chunk size
        (nor hash algorithm, which nothing sends); the engine's lookup Hello does."""
        while True:
            await asyncio.sleep(CHUNK_CHECK_S)
            try:
                await self._check_new_workers()
            except (Unavailable, Refused):
                pass
            except Exception:  # a bug: the check must not end, nor take the service down
                log.exception("worker chunk size check failed")
            except asyncio.CancelledError:
                if _cancelled_itself():
                    raise  # stop()
                log.exception("worker chunk size check cancelled from under it")

    async def _check_new_workers(self) -> None:
        """Hello the next batch of registered engines not asked yet, or due again."""
        workers = await self._registered_workers()
        current = {(w.worker_id, w.lookup_endpoint) for w in workers if w.lookup_endpoint}
        self._chunk_checked &= current  # workers gone are not kept for ever
        retry = self._chunk_retry = {k: v for k, v in self._chunk_retry.items() if k in current}
        now = time.monotonic()
        never = (float("-inf"), 0.0)
        due = [
            w
            for w in workers
            if w.lookup_endpoint
            and (key := (w.worker_id, w.lookup_endpoint)) not in self._chunk_checked
            and retry.get(key, never)[0] <= now
        ]
        if not due:
            return
        due.sort(key=lambda w: retry.get((w.worker_id, w.lookup_endpoint), never)[0])
        batch = due[: min(CHUNK_CHECK_BATCH, worker_pool.MAX_ENDPOINTS)]
        endpoints = [w.lookup_endpoint for w in batch]
        hellos = await self._pool.ask(endpoints, self._hello_worker, self.config.worker_timeout_s)
        now = time.monotonic()
        for w, hello in zip(batch, hellos, strict=True):
            key = (w.worker_id, w.lookup_endpoint)
            if not isinstance(hello, wire.HelloReply):
                self._chunk_not_answered(w, now, "no answer" if hello is None else repr(hello))
                continue
            if (hello.instance_id, hello.rank) != (w.instance_id, w.rank):
                # Another engine serves that endpoint now (the list is behind, or the
                # endpoint was reused): its chunk size says nothing of this worker.
                got = f"answered as {hello.instance_id}/{hello.rank}"
                self._chunk_not_answered(w, now, got)
                continue
            self._chunk_checked.add(key)
            if key in retry:
                log.info("worker answered its chunk size check", worker=w.worker_id)
                del retry[key]
            if hello.chunk_size != self.config.chunk_size:
                self._chunk_mismatch.inc()
                log.error(
                    "worker chunk size differs from lookup.chunk_size: best_instances "
                    "finds none of its chunks; set lookup.chunk_size (and "
                    "hash_algorithm) as the engines' engine.chunk_size",
                    worker=w.worker_id,
                    engine_chunk_size=hello.chunk_size,
                    lookup_chunk_size=self.config.chunk_size,
                )

    async def _registered_workers(self) -> list[Worker]:
        """The index's workers while it is in sync (no controller round trip); else the
        controller's list, less the workers it only knows from its snapshot (their
        engines may be long gone: they are asked once they register again)."""
        index = self.follower.synced_index() if self.follower is not None else None
        if index is not None:
            return [w.info for w in list(index.workers.values())]
        reply = await self._ask_controller(cproto.ListWorkers, cproto.ListWorkersReply)
        return [w for w in reply.workers if not w.restored]

    def _chunk_not_answered(self, w: Worker, now: float, why: str) -> None:
        """Ask it again later, each time later (its socket is closed meanwhile); logged
        the first time only."""
        key = (w.worker_id, w.lookup_endpoint)
        last = self._chunk_retry.get(key)
        wait = CHUNK_CHECK_S if last is None else min(2 * last[1], CHUNK_CHECK_BACKOFF_MAX_S)
        self._chunk_retry[key] = (now + wait, wait)
        self._pool.discard(w.lookup_endpoint)
        if last is None:
            log.warning(
                "worker did not answer the chunk size check; asked again less and less often",
                worker=w.worker_id,
                endpoint=w.lookup_endpoint,
                error=why,
                max_wait_s=CHUNK_CHECK_BACKOFF_MAX_S,
            )

    def _hello_worker(self, rid: int, _deadline: float, _i: int) -> Any:
        return wire.Hello(rid, wire.PROTOCOL_VERSION, self.name)

    def _listed(self, task: asyncio.Task) -> None:
        self._listing = None
        if not task.cancelled():
            task.exception()  # its waiters got it; none left must not log it as lost

    async def _prefix_counts(
        self, hashes: list[bytes], op: str, instance_id: str = ""
    ) -> tuple[list[cproto.InstancePrefix], str]:
        """Per instance, the leading chunks of hashes it holds; and where that came from."""
        index = self.follower.synced_index() if self.follower is not None else None
        if index is not None:
            self._from_index[op].inc()
            found = index.prefix_counts(hashes, instance_id) if hashes else []
            return [cproto.InstancePrefix(*c) for c in found], "index"
        if not hashes:
            return [], "controller"
        if not self._may_ask_controller(time.monotonic()):
            raise Unavailable("controller did not answer just now")
        self._fallbacks[op].inc()
        reply = await self._ask_controller(
            lambda rid: cproto.PrefixCounts(rid, hashes, instance_id), cproto.PrefixCountsReply
        )
        return reply.instances, "controller"

    async def _hashes(self, tokens: bytes) -> list[bytes]:
        if len(tokens) <= HASH_ON_LOOP_TOKENS * wire.TOKEN_BYTES:
            return self._chunk_hashes(tokens)
        return await asyncio.to_thread(self._chunk_hashes, tokens)

    def _chunk_hashes(self, tokens: bytes) -> list[bytes]:
        """The hashes of the prompt's first MAX_HASHES chunks: a prefix count needs no
        more, and the controller takes no more."""
        limit = proto.MAX_HASHES * self.config.chunk_size * wire.TOKEN_BYTES
        return self._tokendb.chunk_hashes(wire.decode_tokens(memoryview(tokens)[:limit]))

    # -- handlers -----------------------------------------------------------------------
    async def _hello(self, msg: proto.Hello) -> proto.Reply:
        return proto.HelloReply(msg.rid, proto.PROTOCOL_VERSION, self.name, self.config.chunk_size)

    async def _lookup(self, msg: proto.Lookup) -> proto.Reply:
        lookup_id = msg.lookup_id or f"ls-{msg.rid}"
        # The same id goes to the workers (they pin under it): bound here, it tags
        # this process's lines for the lookup as theirs tag their own.
        with structlog.contextvars.bound_contextvars(lookup_id=lookup_id):
            reply = await self._lookup_in(msg, lookup_id)
            if isinstance(reply, proto.LookupReply):
                log.debug(
                    "lookup answered", instance=msg.instance_id, hit_tokens=reply.hit_tokens,
                    per_rank=reply.per_rank, pin=msg.pin, source=reply.source,
                )  # fmt: skip
            return reply

    async def _lookup_in(self, msg: proto.Lookup, lookup_id: str) -> proto.Reply:
        workers = await self._instance_workers(msg.instance_id, "lookup")
        if not workers:
            return proto.error_reply(
                msg.rid, ErrorCode.UNKNOWN_INSTANCE, f"no worker of {msg.instance_id!r} registered"
            )
        size = self.config.chunk_size
        if msg.hashes or not msg.tokens:
            counts, source = await self._prefix_counts(msg.hashes, "lookup", msg.instance_id)
            c = counts[0] if counts else None
            hit = c.chunks * size if c else 0
            return proto.LookupReply(msg.rid, hit, [], c.l1_chunks * size if c else 0, source)
        world = max(w.world_size for w in workers)
        ranks = {w.rank: w.lookup_endpoint for w in workers if 0 <= w.rank < world}
        if len(ranks) < world:
            # A rank not registered holds nothing: the answer is 0 without asking any,
            # and a registered world_size (any number) costs nothing per rank.
            log.debug("lookup of an instance missing ranks", ranks=len(ranks), world=world)
            return proto.LookupReply(msg.rid, 0, [], 0, "workers")
        endpoints = [ranks[r] for r in range(world)]

        def make(rid: int, deadline: float, rank: int) -> wire.LookupPrefix:
            return wire.LookupPrefix(
                rid, wire.PROTOCOL_VERSION, lookup_id, msg.tokens, msg.pin, msg.tenant,
                deadline, msg.instance_id, rank,
            )  # fmt: skip

        asked = self._pool.ask(endpoints, make, self.config.worker_timeout_s)
        l1 = self._l1_tokens(msg) if not msg.tenant else _none()
        replies, l1_tokens = await asyncio.gather(asked, l1)
        per_rank = [r.hit_tokens if isinstance(r, wire.LookupPrefixReply) else -1 for r in replies]
        hit = min(per_rank) if per_rank and min(per_rank) >= 0 else 0
        if msg.pin and hit == 0 and any(h != 0 for h in per_rank):
            # Some rank lacks the prefix: the others' pins would hold memory for nothing.
            # A rank that did not answer (-1) may have pinned after its deadline.
            log.debug("lookup pins released: not every rank holds the prefix")
            # In the background: the answer does not wait for a rank that is down or
            # behind (a release may wait a second for room in its queue).
            task = asyncio.create_task(self._release_on(endpoints, lookup_id))
            self._inflight.add(task)
            task.add_done_callback(self._inflight.discard)
        if l1_tokens >= 0:
            l1_tokens = min(l1_tokens, hit)
        return proto.LookupReply(msg.rid, hit, per_rank, l1_tokens, "workers")

    async def _l1_tokens(self, msg: proto.Lookup) -> int:
        """The registry's view of the L1 part of the prefix; -1 when not known."""
        try:
            hashes = await self._hashes(msg.tokens)
            counts, _ = await self._prefix_counts(hashes, "lookup", msg.instance_id)
        except (Unavailable, Refused):
            return -1
        return counts[0].l1_chunks * self.config.chunk_size if counts else 0

    async def _release_on(self, endpoints: list[str], lookup_id: str) -> int:
        def make(rid: int) -> wire.ReleaseLookup:
            return wire.ReleaseLookup(rid, wire.PROTOCOL_VERSION, lookup_id)

        return await self._pool.send_all(endpoints, make)

    async def _release(self, msg: proto.Release) -> proto.Reply:
        workers = await self._instance_workers(msg.instance_id, "release")
        if not workers:
            return proto.error_reply(
                msg.rid, ErrorCode.UNKNOWN_INSTANCE, f"no worker of {msg.instance_id!r} registered"
            )
        sent = await self._release_on([w.lookup_endpoint for w in workers], msg.lookup_id)
        log.debug("lookup released", lookup_id=msg.lookup_id, instance=msg.instance_id)
        return proto.ReleaseReply(msg.rid, sent)

    async def _best(self, msg: proto.BestInstances) -> proto.Reply:
        hashes = msg.hashes or await self._hashes(msg.tokens)
        size = self.config.chunk_size
        counts, source = await self._prefix_counts(hashes, "best")
        found = [
            proto.InstanceHit(c.instance_id, c.chunks * size, c.l1_chunks * size, c.world_size)
            for c in counts
        ]
        return proto.BestInstancesReply(msg.rid, found[: msg.limit] if msg.limit else found, source)


async def _none() -> int:
    return -1


def _cancelled_itself() -> bool:
    """Whether the running task was cancelled (stop()), not a future it awaited."""
    task = asyncio.current_task()
    return task is None or task.cancelling() > 0


def _complete(workers: list[Worker]) -> bool:
    """Every rank of the instance, each with its lookup endpoint (a worker registers
    it once its lookup server is up)."""
    if not workers or not all(w.lookup_endpoint for w in workers):
        return False
    world = max(w.world_size for w in workers)
    return len({w.rank for w in workers if 0 <= w.rank < world}) == world


@contextlib.asynccontextmanager
async def running(config: LookupConfig):
    """A started LookupService, stopped on exit (tests, embedding)."""
    service = LookupService(config)
    await service.start()
    try:
        yield service
    finally:
        await service.stop()

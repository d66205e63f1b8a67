"""Serves the lookup protocol (kvmesh.common.protocol.lookup) for one worker engine.

In vLLM the scheduler that asks "how much of this prompt is cached?" lives in another
process than the engines that hold the cache, so each engine answers on its own ZMQ
ROUTER socket (ipc by default, tcp when `engine.lookup_endpoint` says so). The server
is one asyncio task on the engine's event loop thread; each lookup runs on one
helper thread, so that a remote tier's existence check (itself on the loop) can run.
Anything malformed gets an `ErrorReply`; nothing a
client sends stops the server. `attach_lookup_server` ties its life to the engine's:
`engine.close()` stops it and removes its ipc socket file.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import socket
import stat
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog
import torch
import zmq
import zmq.asyncio

from kvmesh.common.observability import get_logger
from kvmesh.common.protocol import lookup as proto
from kvmesh.common.protocol import wire
from kvmesh.common.transport.curve import CurveGuard
from kvmesh.common.transport.frames import FrameReader
from kvmesh.common.transport.tcp_address import bind

if TYPE_CHECKING:
    from kvmesh.services.worker.engine import KVEngine

log = get_logger(__name__)

MAX_FRAMES = 2  # routing id and the request
# Requests read ahead per peer: lookups are served one at a time, and what waits beyond
# this stays in the peer's process (TCP and ipc push back; its send times out there).
RCV_HWM = 8


class LookupServerError(RuntimeError):
    """The server could not start (endpoint in use, bad endpoint, bind failure)."""


class LookupServer:
    """The lookup endpoint of one engine; `start()` binds, `stop()` unbinds."""

    def __init__(self, engine: KVEngine, endpoint: str) -> None:
        self.engine = engine
        self.endpoint = endpoint
        self._task: asyncio.Task[None] | None = None
        self._done: concurrent.futures.Future[None] | None = None
        self._ipc_path: Path | None = None
        metrics = engine.stats.metrics
        requests = metrics.counter(
            "lookup_server_requests_total", "Lookup-protocol requests served", ["kind"]
        )
        self._requests = {
            kind: requests.labels(kind=kind) for kind in ("hello", "lookup", "release")
        }
        self._errors = metrics.counter(
            "lookup_server_errors_total", "Lookup-protocol error replies", ["code"]
        )
        self._handlers: dict[type, Callable[[Any], proto.Reply]] = {
            proto.Hello: self._hello,
            proto.LookupPrefix: self._lookup,
            proto.ReleaseLookup: self._release,
        }

    # -- life cycle ---------------------------------------------------------------------
    def start(self, timeout: float = 10.0) -> str:
        """Bind and start serving on the engine's loop; returns the bound endpoint.

        Raises LookupServerError if the endpoint cannot be bound (another live server
        holds the ipc path, a tcp port is taken, ...).
        """
        if self._done is not None:
            raise RuntimeError("lookup server already started")
        bound: concurrent.futures.Future[str] = concurrent.futures.Future()
        self._done = self.engine.loop.submit(self._main(bound))
        try:
            self.endpoint = bound.result(timeout)
        except concurrent.futures.TimeoutError:
            self.stop()
            msg = f"lookup server did not bind {self.endpoint} in {timeout}s"
            raise LookupServerError(msg) from None
        except LookupServerError:
            self._done = None
            raise
        log.info(
            "lookup server listening",
            endpoint=self.endpoint,
            instance=self.engine.instance_id,
            rank=self.engine.rank,
        )
        return self.endpoint

    def stop(self, timeout: float = 5.0) -> None:
        """Cancel the serving task and wait until its socket is closed; idempotent."""
        done, self._done = self._done, None
        if done is None or done.done():
            return
        loop = self.engine.loop
        if loop.running:
            loop.call_soon(self._cancel)
            if loop.in_loop_thread():
                return  # cannot wait for ourselves; the task ends at its next await
            try:
                done.result(timeout)
            except concurrent.futures.CancelledError:
                pass
            except concurrent.futures.TimeoutError:
                log.error("lookup server did not stop in time", endpoint=self.endpoint)

    def _cancel(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _main(self, bound: concurrent.futures.Future[str]) -> None:
        self._task = asyncio.current_task()
        ctx = zmq.asyncio.Context()
        sock = ctx.socket(zmq.ROUTER)
        sock.linger = 0
        # Inside the engine's process (vLLM's): a peer's giant frame must not be
        # buffered whole, nor many of them.
        sock.setsockopt(zmq.MAXMSGSIZE, proto.MAX_MESSAGE_BYTES)
        sock.setsockopt(zmq.RCVHWM, RCV_HWM)
        # CURVE on tcp only: an ipc endpoint is guarded by its directory's mode (0700).
        curve = self.engine.curve if self.endpoint.startswith("tcp://") else None
        guard = CurveGuard(ctx, curve, self.engine.stats.metrics, "worker")
        guard.serve(sock)
        try:
            try:
                endpoint = self._bind(sock)
            except (zmq.ZMQError, OSError, LookupServerError) as exc:
                bound.set_exception(
                    exc
                    if isinstance(exc, LookupServerError)
                    else LookupServerError(f"cannot bind lookup endpoint {self.endpoint}: {exc}")
                )
                return
            bound.set_result(endpoint)
            try:
                await self._serve(sock)
            except Exception:
                # Lookups go unanswered from here on: schedulers count misses.
                log.exception("lookup server failed", endpoint=endpoint)
        finally:
            sock.close(0)
            await asyncio.to_thread(guard.close)
            ctx.term()
            self._remove_ipc_file()

    def _bind(self, sock: zmq.asyncio.Socket) -> str:
        if self.endpoint.startswith("ipc://"):
            path = Path(self.endpoint[len("ipc://") :])
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            # Only the built-in name is checked: a directory the operator named (in
            # $KVMESH_IPC_DIR or the endpoint) is theirs, and may be shared on purpose
            # (a sticky 1777 one, a group's). Below it, everything is the owner's.
            builtin = proto.builtin_ipc_dir()
            parent = Path(os.path.normpath(path.parent))  # "/tmp/kvmesh-0/../kvmesh-0"
            if parent == builtin or builtin in parent.parents:
                _make_private(builtin)
            if _live_unix_socket(path):
                # ZMQ would silently unlink it and steal the address.
                raise LookupServerError(
                    f"lookup endpoint {self.endpoint} is served by another live process "
                    "(two engines with one instance id and rank?)"
                )
            sock.bind(self.endpoint)
            self._ipc_path = path
            return self.endpoint
        bind(sock, self.endpoint)
        return sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def _remove_ipc_file(self) -> None:
        if self._ipc_path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._ipc_path)
            self._ipc_path = None

    # -- serving ------------------------------------------------------------------------
    async def _serve(self, sock: zmq.asyncio.Socket) -> None:
        loop = asyncio.get_running_loop()
        pool = concurrent.futures.ThreadPoolExecutor(1, "kvmesh-lookup")
        try:
            await self._serve_with(sock, loop, pool)
        finally:
            # No wait: a lookup in flight may be waiting on this loop (its own deadline
            # ends it).
            pool.shutdown(wait=False, cancel_futures=True)

    async def _serve_with(
        self,
        sock: zmq.asyncio.Socket,
        loop: asyncio.AbstractEventLoop,
        pool: concurrent.futures.Executor,
    ) -> None:
        reader = FrameReader(sock, MAX_FRAMES)
        while True:
            frames, dropped = await reader.recv()
            if len(frames) < 2:
                continue  # no routing id and message: nothing to answer
            if dropped:
                problem = f"expected 1 frame, got {len(frames) + dropped - 1}"
                rid = wire.rid_at_head(frames[1].buffer)
                reply = proto.error_reply(rid, proto.ErrorCode.BAD_MESSAGE, problem)
            else:
                # Off the loop: a lookup may ask the remote tier, whose calls run on this
                # very loop (the engine's) and would otherwise be skipped or deadlock.
                reply = await loop.run_in_executor(pool, self.handle, [f.bytes for f in frames[1:]])
            if isinstance(reply, proto.ErrorReply):
                self._errors.labels(code=proto.codec.code_name(reply.code)).inc()
            try:
                await sock.send_multipart([frames[0].bytes, proto.encode(reply)])
            except zmq.ZMQError as exc:  # the client went away meanwhile
                log.debug("lookup reply not sent", error=str(exc))

    def handle(self, frames: list[bytes]) -> proto.Reply:
        """The reply to one request's frames (without the routing id)."""
        try:
            msg = proto.decode_request(frames)
        except proto.MalformedMessage as exc:
            return exc.reply
        try:
            return self._handlers[type(msg)](msg)
        except Exception as exc:
            if getattr(self.engine, "_closed", False):
                return proto.error_reply(msg.rid, proto.ErrorCode.SHUTTING_DOWN, str(exc))
            log.exception("lookup request failed", request=type(msg).__name__)
            return proto.error_reply(msg.rid, proto.ErrorCode.INTERNAL, repr(exc))

    def _hello(self, msg: proto.Hello) -> proto.Reply:
        self._requests["hello"].inc()
        e = self.engine
        return proto.HelloReply(
            msg.rid, proto.PROTOCOL_VERSION, e.instance_id, e.rank, e.world_size,
            e.config.chunk_size,
        )  # fmt: skip

    def _lookup(self, msg: proto.LookupPrefix) -> proto.Reply:
        self._requests["lookup"].inc()
        e = self.engine
        if (msg.instance_id and msg.instance_id != e.instance_id) or (
            msg.rank >= 0 and msg.rank != e.rank
        ):
            return proto.error_reply(
                msg.rid,
                proto.ErrorCode.WRONG_WORKER,
                f"this is {e.instance_id!r} rank {e.rank}, not {msg.instance_id!r} rank {msg.rank}",
            )
        if msg.deadline and time.time() > msg.deadline:
            # The asker has given up: counting now would only pin chunks for nobody.
            return proto.error_reply(
                msg.rid, proto.ErrorCode.DEADLINE_EXCEEDED, "deadline passed before lookup"
            )
        ids = proto.decode_tokens(msg.tokens)
        tokens = torch.frombuffer(ids, dtype=torch.uint32) if len(ids) else []
        # The lookup id is the scheduler's request id (or the lookup-server's): bound,
        # it tags every line logged for this lookup, here and in the asking process.
        with structlog.contextvars.bound_contextvars(lookup_id=msg.lookup_id):
            try:
                hits = self.engine.lookup(tokens, msg.lookup_id, msg.pin, tenant=msg.tenant)
            except (ValueError, TypeError) as exc:
                log.info("lookup refused", error=str(exc))
                return proto.error_reply(msg.rid, proto.ErrorCode.BAD_TOKENS, str(exc))
            log.debug(
                "lookup served", tokens=len(ids), hit_tokens=hits, pinned=msg.pin and hits > 0
            )
        return proto.LookupPrefixReply(msg.rid, hits)

    def _release(self, msg: proto.ReleaseLookup) -> proto.Reply:
        self._requests["release"].inc()
        released = msg.lookup_id in self.engine.pins
        self.engine.release_lookup(msg.lookup_id)
        log.debug("lookup released", lookup_id=msg.lookup_id, held_pins=released)
        return proto.ReleaseLookupReply(msg.rid, released)


def _make_private(directory: Path) -> None:
    """Check that the default ipc directory is this user's own and make it 0700.

    Its name is predictable (/tmp/kvmesh-<uid>), so another local user could create
    it first: mkdir(exist_ok=True) would then accept a directory in which that user
    can replace our socket with theirs, and the scheduler would send its lookups (the
    prompts' token ids) there. A directory of ours that is too open is closed; one
    that is not ours (or a link that is not ours) is refused.
    """
    uid = os.geteuid()
    st = os.lstat(directory)
    if stat.S_ISLNK(st.st_mode) and st.st_uid == uid:
        st = os.stat(directory)  # our own link: judge what it points to
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid:
        raise LookupServerError(
            f"ipc directory {directory} is not a directory owned by this user (uid {uid}; "
            f"it is uid {st.st_uid}'s): another user could take over the lookup socket. "
            "Remove it, or set KVMESH_IPC_DIR to a directory only this user can change"
        )
    if stat.S_IMODE(st.st_mode) & 0o077:
        log.warning(
            "ipc directory was open to other users: made 0700",
            directory=str(directory),
            mode=oct(stat.S_IMODE(st.st_mode)),
        )
        os.chmod(directory, 0o700)


def _live_unix_socket(path: Path) -> bool:
    """Whether a process accepts connections on the Unix socket at path."""
    if not path.exists():
        return False
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(0.5)
    try:
        probe.connect(str(path))
    except OSError:
        return False
    else:
        return True
    finally:
        probe.close()


def attach_lookup_server(engine: KVEngine, endpoint: str | None = None) -> LookupServer:
    """Start the lookup server of engine at endpoint (default: from its config) and
    make `engine.close()` stop it."""
    if endpoint is None:
        endpoint = proto.engine_endpoint(
            engine.config.lookup_endpoint, engine.instance_id, engine.rank
        )
    server = LookupServer(engine, endpoint)
    # The controller client registers this (again, if it registered before).
    engine.lookup_endpoint = server.start()
    engine.add_close_hook(server.stop)
    return server

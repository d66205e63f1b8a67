"""The NIXL TransferChannel: the reader pulls chunks straight from the peer's L1 pool.

Each engine has one NIXL agent with its L1 pool registered once; it serves peers
(they read from the pool) and reads from them (into the pool). A read is: `Hello`
once per peer (its agent metadata → `add_remote_agent`), `PinChunks` (the peer holds
a reference on each chunk and says where it is), READ transfers of every chunk (one
for all, or ~2 MiB ranges back to back when the reader hashes as they land), then
`ReleaseChunks`. Metadata travels over the peer's ZMQ endpoint: NIXL opens no
listener of its own.

UCX settings (see RECIPES): `UCX_TLS=shm` and `ucx_error_handling_mode=none` make
same-host DRAM reads run at memcpy speed; the environment is read when the agent is
created, so it is set (unless the user set it) before that. Across hosts set
`UCX_TLS` yourself (e.g. `tcp` or `rc`). Over shared memory alone the agent has no
progress thread (see `_new_agent`).

NIXL calls are blocking: they run on one thread of the channel's own, never on the
event loop, and every wait has a deadline. A peer that answers `Hello` without an
agent (it runs the ZMQ channel) is read over ZMQ instead.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from kvmesh.common.memory import MemoryObj
from kvmesh.common.observability import get_logger
from kvmesh.common.protocol import p2p as proto
from kvmesh.common.transport.channel import (
    AllocFn,
    Landed,
    LandedFn,
    Piece,
    check_hello,
    peer_frame_bound,
)
from kvmesh.common.transport.channel_zmq import ZmqChannel
from kvmesh.common.transport.chunk_regions import layer_regions
from kvmesh.common.transport.peer_conn import (
    DEFAULT_IDLE_S,
    PeerConnection,
    PeerConnections,
    PeerError,
    StuckTransfer,
)

if TYPE_CHECKING:
    from kvmesh.common.transport.curve import CurveKeys

log = get_logger(__name__)

UCX_DEFAULTS = {"UCX_TLS": "shm"}
# A read with on_landed moves in transfers of about this many bytes (big chunks cut
# into ranges), so that the check of one overlaps the copy of the next and finds its
# bytes still in cache; a transfer costs ~5 us to set up.
PIPELINE_BYTES = 2 << 20
# UCX transports within one host; the reader or writer itself copies, one-sided.
_LOCAL_TLS = frozenset({"shm", "sm", "posix", "sysv", "cma", "knem", "xpmem", "self"})


def local_only(ucx_tls: str) -> bool:
    """Whether UCX_TLS names only same-host shared-memory transports (no "^" negation,
    no network): then a transfer completes inside the initiator's own calls."""
    names = [t.strip() for t in ucx_tls.split(",") if t.strip()]
    return bool(names) and all(t in _LOCAL_TLS for t in names)


def _new_agent(name: str) -> Any:
    for var, value in UCX_DEFAULTS.items():
        os.environ.setdefault(var, value)
    from nixl_cu13._api import nixl_agent, nixl_agent_config

    # NIXL's progress thread polls without pause (nixl_agent sets its delay to 0): a
    # core per process, even idle. Over shared memory the initiator copies within
    # transfer() and the target takes no part, so nothing needs it; over a network
    # transport the target must progress, so it stays.
    prog = not local_only(os.environ.get("UCX_TLS", ""))
    agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=prog, backends=[]))
    # With UCX_TLS=shm the default error mode fails agent creation (NIXL_ERR_BACKEND).
    agent.create_backend("UCX", {"ucx_error_handling_mode": "none"})
    return agent


class NixlChannel:
    name = "nixl"

    def __init__(
        self,
        name: str,
        regions: Sequence[tuple[int, int]],
        *,
        curve: CurveKeys | None = None,
        idle_s: float = DEFAULT_IDLE_S,
    ) -> None:
        self.agent_name = f"kvmesh-{name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.agent = _new_agent(self.agent_name)
        self._regs = [
            self.agent.register_memory(self.agent.get_reg_descs([(a, n, 0, "")], "DRAM"))
            for a, n in regions
        ]
        self._conns = PeerConnections(
            curve, peer_frame_bound(regions), idle_s, on_idle=self._idle_peer
        )
        self._zmq = ZmqChannel(self._conns)
        # Peer endpoint → its agent's name ("" = it speaks ZMQ only), as last hello'd.
        self._agents: dict[str, str] = {}
        # Endpoints whose agent a failure put in doubt: hello'd again before next use.
        self._doubted: set[str] = set()
        # The Hello in flight to each endpoint: requests that find the peer restarted
        # together (every read and push after a restart) share one.
        self._hellos: dict[str, asyncio.Future[str]] = {}
        # Agents with a transfer NIXL would not release: never removed (it may still
        # copy, and NIXL would have to tear down what it copies with).
        self._stuck: set[str] = set()
        self._pool = concurrent.futures.ThreadPoolExecutor(1, "kvmesh-nixl")
        # Runs the reader's on_landed while the next group of a read is copied.
        self._checker = concurrent.futures.ThreadPoolExecutor(1, "kvmesh-nixl-check")
        self._metadata: bytes = self.agent.get_agent_metadata()
        self.retired = 0  # peers' agents unloaded (replaced or idle): a count of removals queued

    def hello_fields(self) -> tuple[str, bytes]:
        return self.agent_name, self._metadata

    async def _peer_agent(self, endpoint: str, timeout_s: float, want: str | None = None) -> str:
        """The name of the agent serving endpoint, loaded (Hello once per connection).
        want: the agent a reply of the peer's named, its addresses being in that
        agent's memory (None: no reply yet). Another one known means the peer restarted
        behind the endpoint (the connection reconnects by itself): Hello again, and
        AgentChanged if even then another agent answers. A reply naming none (a peer
        serving ZMQ only, or one older than the field) where an agent is known is
        checked by a Hello too, and trusted only if that agent or none answers (at the
        first contact, whichever answers: as before the field existed)."""
        conn = self._conns.get(endpoint)
        known = self._agents.get(endpoint)
        if (
            conn.hello is not None
            and known is not None
            and endpoint not in self._doubted
            and (want is None or want == known)
        ):
            return known
        hello = self._hellos.get(endpoint)
        if hello is None:
            hello = self._hellos[endpoint] = asyncio.ensure_future(
                self._hello(conn, endpoint, timeout_s)
            )
            hello.add_done_callback(lambda t: self._hello_done(endpoint, t))
        # Shielded: a cancel here must not leave an agent loaded and never recorded (it
        # would never be unloaded), nor fail the others waiting on the same Hello.
        try:
            async with asyncio.timeout(timeout_s):
                name = await asyncio.shield(hello)
        except TimeoutError:  # a Hello begun with a longer deadline than ours
            raise PeerError(
                f"{endpoint} did not answer Hello within {timeout_s:.3f}s",
                conn=conn,
                timed_out=True,
            ) from None
        unnamed_ok = want == "" and (not name or known is None or name == known)
        if want is not None and name != want and not unnamed_ok:
            raise AgentChanged(f"{endpoint} is served by agent {name!r} now, not {want!r}")
        return name

    def _hello_done(self, endpoint: str, hello: asyncio.Future[str]) -> None:
        if self._hellos.get(endpoint) is hello:
            del self._hellos[endpoint]
        if not hello.cancelled():
            hello.exception()  # read: it may have no waiter left

    async def _hello(self, conn: PeerConnection, endpoint: str, timeout_s: float) -> str:
        msg = proto.Hello(conn.next_rid(), proto.PROTOCOL_VERSION, self.agent_name)
        hello = check_hello((await conn.request(msg, timeout_s))[0])
        name = ""
        if hello.agent:
            loop = asyncio.get_running_loop()
            added = await loop.run_in_executor(
                self._pool, self.agent.add_remote_agent, hello.agent_metadata
            )
            name = added.decode() if isinstance(added, bytes) else str(added)
        conn.hello = hello
        # Read now: another request may have hello'd (and retired the old) meanwhile.
        before = self._agents.get(endpoint)
        self._agents[endpoint] = name
        self._doubted.discard(endpoint)
        if before and before != name:
            self._retire(endpoint, before, "replaced")
        return name

    def _idle_peer(self, endpoint: str) -> None:
        """Its connection was closed unused: a peer gone for good (a pod replaced under
        another address) leaves no agent loaded; one still there is hello'd again."""
        name = self._agents.pop(endpoint, None)
        self._doubted.discard(endpoint)
        if name:
            self._retire(endpoint, name, "idle")

    def _retire(self, endpoint: str, old: str, why: str) -> None:
        """Unload a peer's agent: its process was replaced behind endpoint, or the
        endpoint went unused (one per peer restart would stay loaded for good). On the
        NIXL thread, after every transfer queued before; one queued after that names
        it fails (NIXL_ERR_NOT_FOUND) as it would have against the dead process."""
        if old in self._agents.values() or old in self._stuck:
            return
        log.info("NIXL peer agent unloaded", endpoint=endpoint, agent=old, why=why)
        self.retired += 1
        with contextlib.suppress(RuntimeError):  # the channel is closing: nothing to free
            self._pool.submit(self._remove_agent, old)

    def _remove_agent(self, name: str) -> None:
        if self.agent is None or name in self._stuck:
            return
        try:
            self.agent.remove_remote_agent(name)
        except Exception as exc:  # a leak of one agent's metadata, nothing else
            log.warning("NIXL remote agent not removed", agent=name, error=repr(exc))

    async def read(
        self,
        endpoint: str,
        keys: Sequence[str],
        alloc: AllocFn,
        timeout_s: float,
        on_landed: LandedFn | None = None,
    ) -> list[Landed]:
        try:
            return await self._read(endpoint, keys, alloc, timeout_s, on_landed)
        except PeerError as exc:
            self._forget(endpoint, exc)
            raise

    def _forget(self, endpoint: str, exc: PeerError) -> None:
        """After a failure: the peer may have restarted behind the same endpoint, so
        hello again next time. A peer that refused one request (an ErrorReply) is
        alive and its connection kept, with the other requests waiting on it."""
        if isinstance(exc, AgentChanged):  # the connection is fine, the agent known
            return
        if exc.code is None and self._conns.drop(endpoint, exc.conn):
            self._doubted.add(endpoint)

    async def call(
        self, endpoint: str, make: Callable[[int], proto.Request], timeout_s: float
    ) -> proto.Reply:
        return await self._zmq.call(endpoint, make, timeout_s)

    async def write(
        self,
        endpoint: str,
        alloc_id: int,
        layer: int,
        pieces: Sequence[Piece],
        timeout_s: float,
        *,
        agent: str | None = None,
    ) -> None:
        await self.write_groups(
            endpoint, alloc_id, layer, [pieces], timeout_s, lambda _: None, agent=agent
        )

    async def write_groups(
        self,
        endpoint: str,
        alloc_id: int,
        layer: int,
        groups: Sequence[Sequence[Piece]],
        timeout_s: float,
        on_written: Callable[[int], None],
        *,
        agent: str | None = None,
    ) -> None:
        try:
            await self._write_groups(
                endpoint, alloc_id, layer, groups, timeout_s, on_written, agent
            )
        except PeerError as exc:
            # A decoder that does not name its agent in its allocations (an older
            # version) may have restarted behind the endpoint: the next push hellos
            # again. The connection stays, with the other pushes waiting on it.
            if exc.code is None and not isinstance(exc, AgentChanged):
                self._doubted.add(endpoint)
            raise

    async def _write_groups(
        self,
        endpoint: str,
        alloc_id: int,
        layer: int,
        groups: Sequence[Sequence[Piece]],
        timeout_s: float,
        on_written: Callable[[int], None],
        agent: str | None,
    ) -> None:
        deadline = time.monotonic() + timeout_s
        peer = await self._peer_agent(endpoint, timeout_s, agent)
        if not peer:
            await self._zmq.write_groups(
                endpoint, alloc_id, layer, groups, deadline - time.monotonic(), on_written
            )
            return
        regions = []
        for pieces in groups:
            local, remote = [], []
            for _, obj, addr in pieces:
                for off, n in layer_regions(obj, layer):
                    local.append((obj.data_ptr + off, n, 0))
                    remote.append((addr + off, n, 0))
            regions.append((local, remote))
        loop = asyncio.get_running_loop()
        stop = threading.Event()  # cancelled: no group starts, none is reported

        def report(i: int) -> None:
            if not stop.is_set():
                on_written(i)

        def write_all() -> None:
            # One executor job for every group: the next WRITE starts the moment the
            # last one ends, with no hop through the loop in between.
            for i, (local, remote) in enumerate(regions):
                if stop.is_set():
                    return
                self._transfer(peer, local, remote, deadline, "WRITE")
                loop.call_soon_threadsafe(report, i)

        job = loop.run_in_executor(self._pool, write_all)
        try:
            await asyncio.shield(job)
        except asyncio.CancelledError:
            # A cancel does not stop the WRITE in flight on its thread, into the peer's
            # receive buffers: the caller frees them (CancelChunks) once this raises, so
            # it raises only after that WRITE has ended (by its deadline at the latest).
            stop.set()
            while not job.done():
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.wait([job])
            failure = None if job.cancelled() else job.exception()
            if isinstance(failure, StuckTransfer):
                # Still cancelled, but the caller must not free the buffers it may
                # yet write into.
                raise asyncio.CancelledError() from failure
            raise

    async def _read(
        self,
        endpoint: str,
        keys: Sequence[str],
        alloc: AllocFn,
        timeout_s: float,
        on_landed: LandedFn | None,
    ) -> list[Landed]:
        deadline = time.monotonic() + timeout_s
        peer = await self._peer_agent(endpoint, timeout_s)
        if not peer:
            return await self._zmq.read(endpoint, keys, alloc, deadline - time.monotonic())
        conn = self._conns.get(endpoint)
        msg = proto.PinChunks(
            conn.next_rid(), proto.PROTOCOL_VERSION, list(keys), time.time() + timeout_s
        )
        reply, _ = await conn.request(msg, max(deadline - time.monotonic(), 1e-3))
        if not isinstance(reply, proto.PinChunksReply):
            self._conns.drop(endpoint)
            raise PeerError(f"unexpected reply to pin: {type(reply).__name__}")
        landed: list[Landed] = []
        job: asyncio.Future[None] | None = None
        try:
            if reply.agent and reply.agent != peer:
                # Restarted since our hello: its pages are in another agent's memory.
                left = max(deadline - time.monotonic(), 1e-3)
                peer = await self._peer_agent(endpoint, left, reply.agent)
            for meta in reply.chunks:
                obj = alloc(meta)
                if obj is None:
                    break
                landed.append((meta, obj))
                if obj.nbytes != meta.nbytes:
                    raise PeerError(f"buffer of {obj.nbytes} bytes for {meta.nbytes}")
            loop = asyncio.get_running_loop()
            if landed and on_landed is not None:
                job = loop.run_in_executor(
                    self._pool, self._read_overlapped, peer, landed, on_landed, deadline
                )
            elif landed:
                local = [(obj.data_ptr, meta.nbytes, 0) for meta, obj in landed]
                remote = [(meta.addr, meta.nbytes, 0) for meta, _ in landed]
                job = loop.run_in_executor(
                    self._pool, self._transfer, peer, local, remote, deadline
                )
            if job is not None:
                await asyncio.shield(job)
        except BaseException:
            if job is None or job.done():
                _let_go(conn, reply.lease, landed, job)
            else:
                # Cancelled: the READ runs on, on its thread, into our buffers from the
                # peer's pages. Both are let go only once it has ended.
                job.add_done_callback(lambda _: _let_go(conn, reply.lease, landed, job))
            raise
        conn.send_nowait(proto.ReleaseChunks(conn.next_rid(), proto.PROTOCOL_VERSION, reply.lease))
        return landed

    def _transfer(
        self,
        peer: str,
        local: list[tuple[int, int, int]],
        remote: list[tuple[int, int, int]],
        deadline: float,
        op: str = "READ",
    ) -> None:
        """One READ (or WRITE) of every region, polled to completion or the deadline
        (off-loop)."""
        handle, state = self._start(peer, local, remote, op)
        state = self._poll(handle, state, deadline)
        self._release(handle, peer, op)
        if state != "DONE":
            raise PeerError(f"NIXL {op} with {peer} {_failure(state)}")

    def _read_overlapped(
        self, peer: str, landed: list[Landed], on_landed: LandedFn, deadline: float
    ) -> None:
        """READ landed in groups of about PIPELINE_BYTES (a big chunk is cut into
        ranges); each group's ranges go to on_landed on the check thread as soon as the
        group is DONE (off-loop). Over shared memory a transfer copies within
        transfer(), so this thread copies group i+1 while the check thread hashes group
        i, on the other core, while it is still in cache; over a network every group is
        in flight at once and each is handed over as it completes."""
        started: list[Any] = []
        pending: list[tuple[Any, str, list[_Range]]] = []
        checks: list[concurrent.futures.Future[None]] = []
        try:
            for group in _groups(_ranges(landed, PIPELINE_BYTES), PIPELINE_BYTES):
                local = [(obj.data_ptr + off, n, 0) for _, obj, off, n in group]
                remote = [(meta.addr + off, n, 0) for meta, _, off, n in group]
                handle, state = self._start(peer, local, remote, "READ")
                started.append(handle)
                if state == "DONE":
                    checks.append(self._checker.submit(_each, on_landed, group))
                else:
                    pending.append((handle, state, group))
            for handle, state, group in pending:
                state = self._poll(handle, state, deadline)
                if state != "DONE":
                    raise PeerError(f"NIXL READ with {peer} {_failure(state)}")
                checks.append(self._checker.submit(_each, on_landed, group))
        finally:
            # The checks read the buffers, which the caller frees after an error.
            concurrent.futures.wait(checks)
            stuck: Exception | None = None
            for handle in started:
                try:
                    self._release(handle, peer, "READ")
                except StuckTransfer as exc:
                    stuck = exc
            if stuck is not None:
                raise stuck

    def _start(
        self,
        peer: str,
        local: list[tuple[int, int, int]],
        remote: list[tuple[int, int, int]],
        op: str,
    ) -> tuple[Any, str]:
        agent = self.agent
        try:
            handle = agent.initialize_xfer(
                op,
                agent.get_xfer_descs(local, "DRAM"),
                agent.get_xfer_descs(remote, "DRAM"),
                peer,
                b"",
            )
        except Exception as exc:  # NIXL raises its own types (nixlBackendError, ...)
            raise PeerError(f"NIXL {op} with {peer} did not start: {exc!r}") from None
        try:
            return handle, agent.transfer(handle)
        except Exception as exc:
            self._release(handle, peer, op)
            raise PeerError(f"NIXL {op} with {peer} did not start: {exc!r}") from None

    def _poll(self, handle: Any, state: str, deadline: float) -> str:
        """The transfer's state once DONE, ERR or past the deadline."""
        spins = 0
        while state not in ("DONE", "ERR"):
            if time.monotonic() > deadline:
                break
            spins += 1
            # Small reads end within microseconds; past that, give the CPU back.
            if spins > 200:
                time.sleep(20e-6)
            state = self.agent.check_xfer_state(handle)
        return state

    def _release(self, handle: Any, peer: str, op: str) -> None:
        try:
            self.agent.release_xfer_handle(handle)
        except Exception as exc:
            # Still running: the landing buffers may yet be written, so they are
            # never handed back to the pool (a leak, not wrong KV).
            self._stuck.add(peer)
            log.error("NIXL transfer could not be released", peer=peer, error=repr(exc))
            raise StuckTransfer(f"NIXL {op} with {peer} stuck: {exc!r}") from None

    async def aclose(self) -> None:
        self._conns.close()
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._pool, self._deregister)
        self._pool.shutdown(wait=False)
        self._checker.shutdown(wait=False)
        # Only the agent's destruction stops its UCX progress thread, which otherwise
        # keeps a core busy for the rest of the process.
        self.agent = None

    def _deregister(self) -> None:
        for reg in self._regs:
            try:
                self.agent.deregister_memory(reg)
            except Exception as exc:
                log.warning("NIXL deregister failed", error=repr(exc))
        self._regs = []


class AgentChanged(PeerError):
    """The endpoint answers as another agent than the one whose addresses a reply gave:
    nothing is transferred. The connection is sound and the new agent known."""


def _let_go(
    conn: PeerConnection, lease: int, landed: list[Landed], job: asyncio.Future[None] | None
) -> None:
    """After a read that failed or was cancelled, once its transfer job (if any) has
    ended: its buffers back to the pool, and the peer's lease released."""
    stuck = job is not None and not job.cancelled() and isinstance(job.exception(), StuckTransfer)
    if not stuck:  # else NIXL may still write them: kept (a leak, not wrong KV)
        for _, obj in landed:
            obj.ref_down()
    conn.send_nowait(proto.ReleaseChunks(conn.next_rid(), proto.PROTOCOL_VERSION, lease))


def _failure(state: str) -> str:
    return "failed" if state == "ERR" else "timed out"


# (chunk, its buffer, byte offset, length): one piece of a READ.
_Range = tuple[proto.ChunkMeta, MemoryObj, int, int]


def _ranges(landed: list[Landed], most: int) -> list[_Range]:
    """Each chunk of landed cut into consecutive ranges of at most `most` bytes."""
    out: list[_Range] = []
    for meta, obj in landed:
        for off in range(0, meta.nbytes, most):
            out.append((meta, obj, off, min(most, meta.nbytes - off)))
    return out


def _groups(ranges: list[_Range], min_bytes: int) -> list[list[_Range]]:
    """ranges in order, cut into runs of at least min_bytes (the last may be less)."""
    groups: list[list[_Range]] = []
    group: list[_Range] = []
    size = 0
    for item in ranges:
        group.append(item)
        size += item[3]
        if size >= min_bytes:
            groups.append(group)
            group, size = [], 0
    if group:
        groups.append(group)
    return groups


def _each(on_landed: LandedFn, group: list[_Range]) -> None:
    for meta, obj, off, n in group:
        try:
            on_landed(meta, obj, off, n)
        except Exception as exc:  # the caller's bug must not hide the transfer's result
            log.warning("on_landed failed", key=meta.key, error=repr(exc))

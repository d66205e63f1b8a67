"""The NIXL TransferChannel: the reader pulls chunks straight from the peer's L1 pool.

Each engine has one NIXL agent with its L1 pool registered once; it serves peers
(they read from the pool) and reads from them (into the pool). A read is: `Hello`
once per peer (its agent metadata → `add_remote_agent`), `PinChunks` (the peer holds
a reference on each chunk and says where it is), one READ transfer of every chunk,
then `ReleaseChunks`. Metadata travels over the peer's ZMQ endpoint: NIXL opens no
listener of its own.

UCX settings (see RECIPES): `UCX_TLS=shm` and `ucx_error_handling_mode=none` make
same-host DRAM reads run at memcpy speed; the environment is read when the agent is
created, so it is set (unless the user set it) before that. Across hosts set
`UCX_TLS` yourself (e.g. `tcp` or `rc`).

NIXL calls are blocking: they run on one thread of the channel's own, never on the
event loop, and every wait has a deadline. A peer that answers `Hello` without an
agent (it runs the ZMQ channel) is read over ZMQ instead.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import time
import uuid
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from kvmesh.common.observability import get_logger
from kvmesh.common.protocol import p2p as proto
from kvmesh.common.transport.channel import AllocFn, Landed, Piece, check_hello
from kvmesh.common.transport.channel_zmq import ZmqChannel
from kvmesh.common.transport.chunk_regions import layer_regions
from kvmesh.common.transport.peer_conn import PeerConnections, PeerError

if TYPE_CHECKING:
    from kvmesh.common.transport.curve import CurveKeys

log = get_logger(__name__)

UCX_DEFAULTS = {"UCX_TLS": "shm"}


def _new_agent(name: str) -> Any:
    for var, value in UCX_DEFAULTS.items():
        os.environ.setdefault(var, value)
    from nixl_cu13._api import nixl_agent, nixl_agent_config

    agent = nixl_agent(name, nixl_agent_config(backends=[]))
    # With UCX_TLS=shm the default error mode fails agent creation (NIXL_ERR_BACKEND).
    agent.create_backend("UCX", {"ucx_error_handling_mode": "none"})
    return agent


class NixlChannel:
    name = "nixl"

    def __init__(
        self, name: str, regions: Sequence[tuple[int, int]], *, curve: CurveKeys | None = None
    ) -> None:
        self.agent_name = f"kvmesh-{name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.agent = _new_agent(self.agent_name)
        self._regs = [
            self.agent.register_memory(self.agent.get_reg_descs([(a, n, 0, "")], "DRAM"))
            for a, n in regions
        ]
        self._conns = PeerConnections(curve)
        self._zmq = ZmqChannel(self._conns)
        # Peer endpoint → its agent's name ("" = it speaks ZMQ only).
        self._agents: dict[str, str] = {}
        self._pool = concurrent.futures.ThreadPoolExecutor(1, "kvmesh-nixl")
        self._metadata: bytes = self.agent.get_agent_metadata()

    def hello_fields(self) -> tuple[str, bytes]:
        return self.agent_name, self._metadata

    async def _peer_agent(self, endpoint: str, timeout_s: float) -> str:
        conn = self._conns.get(endpoint)
        if conn.hello is not None:  # same connection: same peer process
            return self._agents[endpoint]
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
        self._agents[endpoint] = name
        return name

    async def read(
        self, endpoint: str, keys: Sequence[str], alloc: AllocFn, timeout_s: float
    ) -> list[Landed]:
        try:
            return await self._read(endpoint, keys, alloc, timeout_s)
        except PeerError:
            # The peer may have restarted behind the same endpoint: hello again next time.
            self._conns.drop(endpoint)
            self._agents.pop(endpoint, None)
            raise

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
    ) -> None:
        deadline = time.monotonic() + timeout_s
        try:
            peer = await self._peer_agent(endpoint, timeout_s)
        except PeerError:
            self._conns.drop(endpoint)
            self._agents.pop(endpoint, None)
            raise
        if not peer:
            await self._zmq.write(endpoint, alloc_id, layer, pieces, deadline - time.monotonic())
            return
        local, remote = [], []
        for _, obj, addr in pieces:
            for off, n in layer_regions(obj, layer):
                local.append((obj.data_ptr + off, n, 0))
                remote.append((addr + off, n, 0))
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(
            self._pool, self._transfer, peer, local, remote, deadline, "WRITE"
        )

    async def _read(
        self, endpoint: str, keys: Sequence[str], alloc: AllocFn, timeout_s: float
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
        try:
            for meta in reply.chunks:
                obj = alloc(meta)
                if obj is None:
                    break
                landed.append((meta, obj))
                if obj.nbytes != meta.nbytes:
                    raise PeerError(f"buffer of {obj.nbytes} bytes for {meta.nbytes}")
            if landed:
                local = [(obj.data_ptr, meta.nbytes, 0) for meta, obj in landed]
                remote = [(meta.addr, meta.nbytes, 0) for meta, _ in landed]
                loop = asyncio.get_running_loop()
                await loop.run_in_executor(
                    self._pool, self._transfer, peer, local, remote, deadline
                )
        except BaseException as exc:
            if not isinstance(exc, _StuckTransfer):
                for _, obj in landed:
                    obj.ref_down()
            raise
        finally:
            conn.send_nowait(
                proto.ReleaseChunks(conn.next_rid(), proto.PROTOCOL_VERSION, reply.lease)
            )
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
        agent = self.agent
        try:
            handle = agent.initialize_xfer(
                op,
                agent.get_xfer_descs(local, "DRAM"),
                agent.get_xfer_descs(remote, "DRAM"),
                peer,
                b"",
            )
            state = agent.transfer(handle)
        except Exception as exc:  # NIXL raises its own types (nixlBackendError, ...)
            raise PeerError(f"NIXL {op} with {peer} did not start: {exc!r}") from None
        spins = 0
        while state not in ("DONE", "ERR"):
            if time.monotonic() > deadline:
                break
            spins += 1
            # Small reads end within microseconds; past that, give the CPU back.
            if spins > 200:
                time.sleep(20e-6)
            state = agent.check_xfer_state(handle)
        try:
            agent.release_xfer_handle(handle)
        except Exception as exc:
            # Still running: the landing buffers may yet be written, so they are
            # never handed back to the pool (a leak, not wrong KV).
            log.error("NIXL transfer could not be released", peer=peer, error=repr(exc))
            raise _StuckTransfer(f"NIXL {op} with {peer} stuck: {exc!r}") from None
        if state != "DONE":
            what = "failed" if state == "ERR" else "timed out"
            raise PeerError(f"NIXL {op} with {peer} {what}")

    async def aclose(self) -> None:
        self._conns.close()
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._pool, self._deregister)
        self._pool.shutdown(wait=False)
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


class _StuckTransfer(PeerError):
    """A transfer NIXL would not release: its buffers stay referenced forever."""

"""An asyncio client of the lookup-server (common/protocol/lookup_service.py), for
the CLI, the bridge and tests: in common/ because services never import each other.
(Not services/worker/lookup_client.py, which asks a worker's own lookup endpoint.)

One DEALER; one reader task resolves waiting requests by rid. Every request has a
deadline: the client's `timeout_s`, or a shorter one per call (the bridge asks within
tens of milliseconds). Errors: `LookupServiceError` (the server said no: carries the
code) and `LookupServiceUnavailable` (no reply within the deadline, or no connection).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Iterable
from typing import Any

import zmq
import zmq.asyncio

from kvmesh.common.protocol import lookup as wire
from kvmesh.common.protocol import lookup_service as proto
from kvmesh.common.transport.curve import CurveKeys, apply_client
from kvmesh.common.transport.tcp_address import connect


class LookupServiceError(Exception):
    def __init__(self, code: int, message: str) -> None:
        super().__init__(f"{message} (code {code})")
        self.code = code


class LookupServiceUnavailable(Exception):
    """No reply within the deadline."""


class LookupServiceClient:
    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 5.0,
        name: str = "kvmesh",
        curve: CurveKeys | None = None,
    ) -> None:
        self.url = url
        self.curve = curve
        self.timeout_s = timeout_s
        self.name = name
        self._ctx = zmq.asyncio.Context()
        self._sock: zmq.asyncio.Socket | None = None
        self._rids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._reader: asyncio.Task | None = None

    async def __aenter__(self) -> LookupServiceClient:
        sock = self._ctx.socket(zmq.DEALER)
        sock.linger = 0
        # Queue nothing for a server that is not connected: a request sent while it is
        # down times out here instead of reaching it, stale, once it is back.
        sock.immediate = True
        try:
            apply_client(sock, self.curve, self.url)
            connect(sock, self.url)
        except Exception:  # a malformed URL: no socket left for term() to wait on
            sock.close(0)
            raise
        self._sock = sock
        self._reader = asyncio.create_task(self._read())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None
        self._ctx.destroy(linger=0)  # term() would wait for a socket left open anywhere

    async def _read(self) -> None:
        assert self._sock is not None
        while True:
            raw = await self._sock.recv()
            try:
                reply = proto.decode_reply(raw)
            except proto.MalformedMessage:
                continue
            fut = self._pending.get(reply.rid)
            if fut is not None and not fut.done():
                fut.set_result(reply)

    async def request(self, msg: Any, expect: type, timeout_s: float | None = None) -> Any:
        """Send msg (its rid from next_rid()); its reply within timeout_s (default: the
        client's), or raise."""
        assert self._sock is not None, "use `async with`"
        fut = asyncio.get_running_loop().create_future()
        self._pending[msg.rid] = fut
        try:
            async with asyncio.timeout(self.timeout_s if timeout_s is None else timeout_s):
                await self._sock.send(proto.encode(msg))
                reply = await fut
        except TimeoutError:
            raise LookupServiceUnavailable(f"no reply from {self.url}") from None
        finally:
            self._pending.pop(msg.rid, None)
        if isinstance(reply, proto.ErrorReply):
            raise LookupServiceError(reply.code, reply.message)
        if not isinstance(reply, expect):
            raise LookupServiceError(int(proto.ErrorCode.BAD_MESSAGE), f"unexpected {reply!r}")
        return reply

    def next_rid(self) -> int:
        return next(self._rids)

    async def hello(self) -> proto.HelloReply:
        msg = proto.Hello(self.next_rid(), proto.PROTOCOL_VERSION, self.name)
        return await self.request(msg, proto.HelloReply)

    async def lookup(
        self,
        instance_id: str,
        tokens: Iterable[int] | None = None,
        *,
        hashes: list[bytes] | None = None,
        lookup_id: str = "",
        pin: bool = False,
        tenant: str = "",
    ) -> proto.LookupReply:
        encoded = wire.encode_tokens(tokens) if tokens is not None else b""
        msg = proto.Lookup(
            self.next_rid(), proto.PROTOCOL_VERSION, instance_id, lookup_id, encoded,
            list(hashes or []), pin, tenant,
        )  # fmt: skip
        return await self.request(msg, proto.LookupReply)

    async def release(self, instance_id: str, lookup_id: str) -> proto.ReleaseReply:
        msg = proto.Release(self.next_rid(), proto.PROTOCOL_VERSION, instance_id, lookup_id)
        return await self.request(msg, proto.ReleaseReply)

    async def best_instances(
        self,
        tokens: Iterable[int] | None = None,
        *,
        hashes: list[bytes] | None = None,
        limit: int = 0,
        timeout_s: float | None = None,
    ) -> list[proto.InstanceHit]:
        """Instances by cached prefix length, longest first (those holding none of it
        may be left out)."""
        encoded = wire.encode_tokens(tokens) if tokens is not None else b""
        msg = proto.BestInstances(
            self.next_rid(), proto.PROTOCOL_VERSION, encoded, list(hashes or []), limit
        )
        return (await self.request(msg, proto.BestInstancesReply, timeout_s)).instances

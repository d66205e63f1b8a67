"""An asyncio connection to the controller: one DEALER, replies matched by request id.

Used by the worker's controller client (services/worker/controller_client.py) and the
admin CLI. One task owns the receiving side; it resolves waiters by rid and hands the
controller's pushes (`Resync`, `Command`) to `on_push`. Every request has a deadline.
Errors: `ControllerError` (the controller said no: carries the code), and
`ControllerUnavailable` (no answer within the deadline).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Callable
from typing import Any, TypeVar

import zmq
import zmq.asyncio

from kvmesh.common.protocol import controller as proto
from kvmesh.common.transport.curve import CurveKeys, apply_client
from kvmesh.common.transport.tcp_address import connect

T = TypeVar("T")


class ControllerError(Exception):
    def __init__(self, code: int, message: str) -> None:
        super().__init__(f"{message} (code {code})")
        self.code = code


class ControllerUnavailable(Exception):
    """No reply within the deadline (controller down, unreachable or overloaded)."""


class ControllerConnection:
    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 1.0,
        client: str = "kvmesh",
        on_push: Callable[[Any], None] | None = None,
        curve: CurveKeys | None = None,
    ) -> None:
        self.url = url
        self.curve = curve
        self.timeout_s = timeout_s
        self.client = client
        self.on_push = on_push
        self._ctx = zmq.asyncio.Context()
        self._sock: zmq.asyncio.Socket | None = None
        self._rids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._reader: asyncio.Task | None = None

    async def connect(self, hello: bool = True) -> None:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 10_000)
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        try:
            apply_client(sock, self.curve, self.url)
            connect(sock, self.url)
        except Exception:
            # A malformed URL raises here: the socket is not ours yet, so close() would
            # not close it and the context's term() would wait for it forever.
            sock.close(linger=0)
            raise
        self._sock = sock
        self._reader = asyncio.create_task(self._read_forever(), name="controller-conn-reader")
        if hello:
            await self.hello()

    async def hello(self) -> proto.HelloReply:
        return await self.request(
            proto.Hello(self.next_rid(), proto.PROTOCOL_VERSION, self.client), proto.HelloReply
        )

    def next_rid(self) -> int:
        return next(self._rids)

    async def close(self) -> None:
        """Cancel the reader, then close the socket, then the context (never blocks)."""
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
            self._reader = None
        for fut in self._pending.values():
            fut.cancel()
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
        # destroy, not term: term() waits for every socket of the context, so one left
        # open anywhere would hang the event loop here.
        self._ctx.destroy(linger=0)

    def send(self, msg: Any) -> bool:
        """Send without waiting for a reply (KV events, command replies); False when the
        socket's queue is full or it is closed: the caller counts that as lost."""
        if self._sock is None:
            return False
        try:
            self._sock.send(proto.encode(msg), zmq.NOBLOCK)
            return True
        except zmq.ZMQError:
            return False

    async def request(self, msg: Any, expect: type[T], deadline_s: float | None = None) -> T:
        """Send msg (its rid from next_rid()) and wait for its reply of type expect."""
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending[msg.rid] = fut
        try:
            if not self.send(msg):
                raise ControllerUnavailable("send queue full or connection closed")
            async with asyncio.timeout(self.timeout_s if deadline_s is None else deadline_s):
                reply = await fut
        except TimeoutError:
            raise ControllerUnavailable(f"no reply from {self.url}") from None
        finally:
            self._pending.pop(msg.rid, None)
        if isinstance(reply, proto.ErrorReply):
            raise ControllerError(reply.code, reply.message)
        if not isinstance(reply, expect):
            raise ControllerError(int(proto.ErrorCode.BAD_MESSAGE), f"unexpected {reply!r}"[:200])
        return reply

    async def _read_forever(self) -> None:
        assert self._sock is not None
        while True:
            raw = await self._sock.recv()
            try:
                msg = proto.decode_reply(raw)
            except proto.MalformedMessage:
                continue  # nothing to answer a controller's garbage with; skip it
            if isinstance(msg, proto.Resync | proto.Command):
                if self.on_push is not None:
                    self.on_push(msg)
                continue
            fut = self._pending.get(msg.rid)
            if fut is not None and not fut.done():
                fut.set_result(msg)

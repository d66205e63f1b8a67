"""A ZMQ ROUTER served from the event loop's selector: receive, decode, dispatch, and
an error reply for whatever does not decode.

Plain ZMQ sockets read from the loop's selector rather than zmq.asyncio: no future or
task per message, which is what lets one core serve hundreds of thousands of messages
a second (the cache-server and the controller).

Nothing a client sends stops the loop: a header that does not decode gets the
protocol's ErrorReply and counts as op "invalid"; an exception from a dispatch or a
spawned handler is logged and counted as INTERNAL (a spawned one is also answered),
and serving goes on. A message of fewer than two frames has no routing id and header
to answer to and is dropped.

Messages are read a frame at a time, at most FRAME_BUDGET frames a loop turn: ZMQ bounds
each frame's size (MAXMSGSIZE) but not how many frames a message has, and a message of a
million empty frames (2 MB on the wire) would otherwise hold the loop for seconds before
any check. Frames past a message's `max_frames` are read and dropped, a budget a turn,
and the message is answered BAD_MESSAGE.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Protocol

import zmq

from kvmesh.common.observability import get_logger
from kvmesh.common.protocol.wire import Codec, MalformedMessage
from kvmesh.common.transport.tcp_address import bind_host, set_family

log = get_logger(__name__)

FRAME_BUDGET = 8192  # frames read per loop turn, ~2 µs each
HWM = 100_000
DEFAULT_MAX_FRAMES = 16

# A spawned handler's answer: the reply and the value frames that follow it.
Answer = tuple[Any, Sequence[Any]]


class _Counter(Protocol):
    def inc(self, amount: float = 1) -> None: ...


class RouterStats(Protocol):
    """What the loop counts in: requests by op, error replies by the protocol's code."""

    requests: Mapping[str, _Counter]
    errors: Mapping[Any, _Counter]


class RouterLoop:
    """One ROUTER socket, served on the running loop from `start()` to `close()`.

    `dispatch(peer, msg, values)` is called, on the loop, with each request whose header
    decoded and the frames that followed it; it answers with `send`, or hands slow work
    to `spawn`. During the call, `header_nbytes` is the size of msg's frame as received:
    what msg is worth in bytes, known without encoding it again.
    """

    def __init__(
        self,
        ctx: zmq.Context,
        codec: Codec,
        dispatch: Callable[[bytes, Any, list[zmq.Frame]], None],
        stats: RouterStats,
    ) -> None:
        self.codec = codec
        self.port = 0
        self.monitor: zmq.Socket | None = None
        self.inflight: set[asyncio.Task] = set()
        self.header_nbytes = 0
        self._ctx = ctx
        self._dispatch = dispatch
        self._stats = stats
        self._sock: zmq.Socket | None = None
        self._max_frames = DEFAULT_MAX_FRAMES
        # The message being read (it may span turns): its frames, whether more follow,
        # and how many past max_frames were dropped.
        self._partial: list[zmq.Frame] | None = None
        self._more = False
        self._dropped = 0
        # A send made outside _on_readable (a timer's push, a task's answer) reads the
        # socket's pending commands, and with them the FD's edge: requests that arrived
        # meanwhile would sit unread until another connection woke the socket (a
        # controller thawed from a pause served nobody for 10 s and more). Such a send
        # schedules one more read; several share it.
        self._reading = False
        self._reread = False
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(
        self,
        host: str,
        port: int,
        *,
        max_message_bytes: int,
        max_frames: int = DEFAULT_MAX_FRAMES,
        monitor_events: int = 0,
        secure: Callable[[zmq.Socket], None] | None = None,
        send_hwm: int = HWM,
    ) -> int:
        """Bind host:port (port 0: any free one) and serve; returns the port.

        A frame over max_message_bytes closes its sender's connection (ZMQ's
        MAXMSGSIZE); a message of more than max_frames frames (routing id and header
        included) is answered BAD_MESSAGE. With monitor_events, `monitor` receives
        those socket events; it is set up before the bind, so it sees every connection.
        `secure(sock)` runs before the bind too (CURVE: common/transport/curve.py).
        send_hwm bounds the messages queued for each connection (beyond, sends to it are
        dropped).
        """
        self._max_frames = max(2, max_frames)
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, send_hwm)
        sock.setsockopt(zmq.RCVHWM, HWM)
        sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
        if secure is not None:
            secure(sock)
        if monitor_events:
            self.monitor = sock.get_monitor_socket(monitor_events)
        try:
            self.port = bind_tcp(sock, host, port)
        except BaseException:
            if self.monitor is not None:
                self.monitor.close(linger=0)
                self.monitor = None
            raise
        self._sock = sock
        loop = self._loop = asyncio.get_running_loop()
        loop.add_reader(sock.getsockopt(zmq.FD), self._on_readable)
        loop.call_soon(self._on_readable)
        return self.port

    def close(self) -> None:
        """Stop reading and close the socket and its monitor; later sends are dropped.
        Whoever reads the monitor stops reading it first."""
        sock, monitor = self._sock, self.monitor
        self._sock = self.monitor = None
        if sock is not None:
            asyncio.get_running_loop().remove_reader(sock.getsockopt(zmq.FD))
            if monitor is not None:
                sock.disable_monitor()
            sock.close(linger=0)
        if monitor is not None:
            monitor.close(linger=0)

    def send(self, peer: bytes, msg: Any, values: Sequence[Any] = ()) -> bool:
        """Send one message and its value frames to a peer; False when it could not go out."""
        sock = self._sock
        if sock is None:
            return False
        try:
            # ROUTER never blocks: a message for a gone (or far behind) peer is dropped.
            sock.send_multipart([peer, self.codec.encode(msg), *values], zmq.NOBLOCK, copy=False)
            return True
        except zmq.ZMQError as exc:
            log.debug("message not sent", error=str(exc))
            return False
        finally:
            if not self._reading and not self._reread and self._loop is not None:
                self._reread = True
                self._loop.call_soon(self._read_again)

    def spawn(
        self, peer: bytes, msg: Any, handler: Callable[..., Awaitable[Answer]], *args: Any
    ) -> None:
        """Answer msg with what `handler(*args)` returns, from a task (in `inflight`);
        a reply of None: the handler answered itself."""
        task = asyncio.get_running_loop().create_task(self._answer(peer, msg, handler, args))
        self.inflight.add(task)
        task.add_done_callback(self.inflight.discard)

    async def _answer(
        self, peer: bytes, msg: Any, handler: Callable[..., Awaitable[Answer]], args: tuple
    ) -> None:
        try:
            reply, values = await handler(*args)
        except Exception as exc:  # a bug: answer, log, keep serving
            log.exception("handler failed", op=msg.__struct_config__.tag)
            internal = self.codec.codes.INTERNAL
            self._stats.errors[internal].inc()
            reply, values = self.codec.error_reply(msg.rid, internal, repr(exc)), ()
        if reply is not None:
            self.send(peer, reply, values)

    def _read_again(self) -> None:
        self._reread = False
        self._on_readable()

    def _on_readable(self) -> None:
        """Serve what the socket holds (ZMQ's FD is edge-triggered, so drain it), at most
        FRAME_BUDGET frames per turn so timers and other callbacks still run."""
        if self._sock is None:
            return
        self._reading = True
        try:
            self._drain(self._sock)
        finally:
            self._reading = False

    def _drain(self, sock: zmq.Socket) -> None:
        budget = FRAME_BUDGET
        while budget > 0:
            if self._partial is None:
                if not sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                    return
                try:
                    first = sock.recv(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    return
                self._partial, self._more, self._dropped = [first], first.more, 0
                budget -= 1
            frames = self._partial
            # The rest of a message is there once its first frame is (ZMQ delivers a
            # message whole).
            while self._more and budget > 0:
                budget -= 1
                if len(frames) < self._max_frames:
                    frame = sock.recv(zmq.NOBLOCK, copy=False)
                    frames.append(frame)
                    self._more = frame.more
                else:
                    self._more = sock.recv(zmq.NOBLOCK, copy=False).more  # dropped
                    self._dropped += 1
            if self._more:
                break  # the rest next turn
            self._partial = None
            if len(frames) < 2:
                continue  # nothing to answer to
            try:
                if self._dropped:
                    self._too_many(frames)
                else:
                    self._receive(frames)
            except Exception:  # a bug must not stop serving everyone else
                log.exception("request dispatch failed")
                self._stats.errors[self.codec.codes.INTERNAL].inc()
        asyncio.get_running_loop().call_soon(self._on_readable)

    def _too_many(self, frames: list[zmq.Frame]) -> None:
        peer = frames[0].bytes
        self._stats.requests["invalid"].inc()
        try:
            rid = self.codec.decode_request(frames[1].buffer).rid
        except MalformedMessage as exc:
            self._stats.errors[self.codec.codes(exc.reply.code)].inc()
            self.send(peer, exc.reply)
            return
        code = self.codec.codes.BAD_MESSAGE
        self._stats.errors[code].inc()
        values = len(frames) - 2 + self._dropped
        text = f"{values} value frames in one message; at most {self._max_frames - 2}"
        self.send(peer, self.codec.error_reply(rid, code, text))

    def _receive(self, frames: list[zmq.Frame]) -> None:
        peer = frames[0].bytes
        try:
            msg = self.codec.decode_request(frames[1].buffer)
        except MalformedMessage as exc:
            self._stats.requests["invalid"].inc()
            self._stats.errors[self.codec.codes(exc.reply.code)].inc()
            self.send(peer, exc.reply)
            return
        self.header_nbytes = len(frames[1])
        self._dispatch(peer, msg, frames[2:])


def bind_tcp(sock: zmq.Socket, host: str, port: int) -> int:
    """Bind sock on tcp host:port (port 0: any free one); the port bound. A failed bind
    closes sock: no caller keeps it, and its context's term() would wait for it.

    A host name is resolved here, blocking (tcp_address.bind_host): a caller on an event
    loop passes `await bind_host_async(host)` instead, an address this binds as it is."""
    try:
        endpoint = f"tcp://{bind_host(host)}"
        set_family(sock, f"{endpoint}:{port}")
        if port:
            sock.bind(f"{endpoint}:{port}")
            return port
        return sock.bind_to_random_port(endpoint)
    except BaseException:
        sock.close(linger=0)
        raise

"""The scheduler side of the lookup protocol: ask every rank of an instance at once.

vLLM's scheduler calls the connector synchronously, so this client is synchronous
too: one DEALER socket per rank, requests sent to all ranks at once, replies
collected with one poll loop until the deadline. The answer is the minimum over the
ranks (a prefix is usable only if every rank holds its share of it), and anything
short of an answer from every rank (a dead or slow rank, an error reply) counts as
0 hits: the cache never delays or fails inference.

Sockets use ZMQ_IMMEDIATE, so a request is never queued for an engine that is not
connected; a late reply (to a request the client gave up on) is recognised by its
request id and dropped.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import zmq

from kvmesh.common.observability import get_logger
from kvmesh.common.protocol import lookup as proto
from kvmesh.common.transport.curve import CurveKeys, apply_client
from kvmesh.common.transport.tcp_address import connect

log = get_logger(__name__)

DEFAULT_TIMEOUT_S = 0.5


@dataclass(frozen=True)
class LookupResult:
    """Each rank's answer: hit tokens, or None with the reason in `errors`."""

    per_rank: list[int | None]
    errors: list[str | None]

    @property
    def hit_tokens(self) -> int:
        """The prefix every rank holds: the minimum, 0 if any rank did not answer."""
        if not self.per_rank or any(h is None for h in self.per_rank):
            return 0
        return min(h for h in self.per_rank if h is not None)


class LookupClient:
    """Looks up prompts on the engines at `endpoints` (index = rank); thread-safe."""

    def __init__(
        self,
        endpoints: Sequence[str],
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        client_name: str = "",
        curve: CurveKeys | None = None,
    ) -> None:
        if not endpoints:
            raise ValueError("a lookup client needs at least one endpoint")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.endpoints = list(endpoints)
        self.timeout_s = timeout_s
        self._client_name = client_name
        self._rids = itertools.count(1)
        self._lock = threading.Lock()
        self._ctx = zmq.Context()
        self._socks: list[zmq.Socket] = []
        for endpoint in self.endpoints:
            sock = self._ctx.socket(zmq.DEALER)
            sock.linger = 0
            sock.setsockopt(zmq.IMMEDIATE, 1)
            sock.setsockopt(zmq.RECONNECT_IVL, 100)
            sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
            sock.sndhwm = sock.rcvhwm = 1000
            apply_client(sock, curve, endpoint)
            connect(sock, endpoint)
            self._socks.append(sock)
        self._closed = False

    @classmethod
    def for_instance(
        cls,
        instance_id: str,
        world_size: int,
        configured_endpoint: str = "",
        **kwargs: object,
    ) -> LookupClient:
        """A client of every rank of instance_id, at the endpoints its engines bind."""
        endpoints = [
            proto.engine_endpoint(configured_endpoint, instance_id, rank)
            for rank in range(world_size)
        ]
        return cls(endpoints, **kwargs)  # type: ignore[arg-type]

    # -- requests -----------------------------------------------------------------------
    def lookup(
        self,
        tokens: Iterable[int],
        lookup_id: str,
        *,
        pin: bool = True,
        tenant: str = "",
        timeout_s: float | None = None,
    ) -> int:
        """Tokens of the prefix every rank holds; 0 on any error or at the deadline.

        With pin, each rank keeps what it counted until the retrieve for lookup_id,
        `release(lookup_id)`, or its pin timeout; when the answer is 0 the pins are
        released at once, since nothing will be loaded.
        """
        result = self.lookup_all(tokens, lookup_id, pin=pin, tenant=tenant, timeout_s=timeout_s)
        hits = result.hit_tokens
        if pin and hits == 0 and any(h != 0 for h in result.per_rank):
            self.release(lookup_id)
        return hits

    def lookup_all(
        self,
        tokens: Iterable[int],
        lookup_id: str,
        *,
        pin: bool = True,
        tenant: str = "",
        timeout_s: float | None = None,
    ) -> LookupResult:
        """Each rank's answer to one lookup."""
        encoded = proto.encode_tokens(tokens)
        timeout = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.time() + timeout

        def make(rid: int) -> proto.LookupPrefix:
            return proto.LookupPrefix(
                rid, proto.PROTOCOL_VERSION, lookup_id, encoded, pin, tenant, deadline
            )

        replies = self._ask_all(make, timeout)
        per_rank: list[int | None] = []
        errors: list[str | None] = []
        for rank, reply in enumerate(replies):
            if isinstance(reply, proto.LookupPrefixReply):
                per_rank.append(reply.hit_tokens)
                errors.append(None)
                continue
            per_rank.append(None)
            if reply is None:
                errors.append(f"no reply within {timeout}s")
            elif isinstance(reply, proto.ErrorReply):
                errors.append(f"error {reply.code}: {reply.message}")
            else:
                errors.append(f"unexpected reply {type(reply).__name__}")
            log.debug("lookup missed a rank", rank=rank, error=errors[-1], lookup_id=lookup_id)
        return LookupResult(per_rank, errors)

    def release(self, lookup_id: str) -> None:
        """Drop lookup_id's pins on every rank; fire and forget (never blocks)."""
        with self._lock:
            if self._closed:
                return
            payload = proto.encode(
                proto.ReleaseLookup(next(self._rids), proto.PROTOCOL_VERSION, lookup_id)
            )
            for sock in self._socks:
                # Not connected: the engine's pin timeout releases them.
                with contextlib.suppress(zmq.Again):
                    sock.send(payload, zmq.NOBLOCK)

    def hello(self, timeout_s: float | None = None) -> list[proto.Reply | None]:
        """Each rank's HelloReply (or ErrorReply, or None without an answer)."""
        timeout = self.timeout_s if timeout_s is None else timeout_s

        def make(rid: int) -> proto.Hello:
            return proto.Hello(rid, proto.PROTOCOL_VERSION, self._client_name)

        return self._ask_all(make, timeout)

    # -- machinery ----------------------------------------------------------------------
    def _ask_all(
        self, make: Callable[[int], proto.LookupPrefix | proto.Hello], timeout: float
    ) -> list[proto.Reply | None]:
        """Send one request to every rank, then collect replies until all came or the
        deadline passed; ranks not yet connected are sent to as soon as they are."""
        with self._lock:
            if self._closed:
                raise RuntimeError("lookup client is closed")
            end = time.monotonic() + timeout
            rid = next(self._rids)
            payload = proto.encode(make(rid))
            replies: list[proto.Reply | None] = [None] * len(self._socks)
            index = {sock: i for i, sock in enumerate(self._socks)}
            to_send = set(self._socks)
            to_recv: set[zmq.Socket] = set()
            for sock in list(to_send):
                if self._try_send(sock, payload):
                    to_send.discard(sock)
                    to_recv.add(sock)
            while to_send or to_recv:
                left_ms = (end - time.monotonic()) * 1000
                if left_ms <= 0:
                    break
                poller = zmq.Poller()
                for sock in to_send:
                    poller.register(sock, zmq.POLLOUT)
                for sock in to_recv:
                    poller.register(sock, zmq.POLLIN)
                for sock, event in poller.poll(left_ms):
                    if event & zmq.POLLOUT and sock in to_send and self._try_send(sock, payload):
                        to_send.discard(sock)
                        to_recv.add(sock)
                    if event & zmq.POLLIN and sock in to_recv:
                        reply = self._drain(sock, rid)
                        if reply is not None:
                            replies[index[sock]] = reply
                            to_recv.discard(sock)
            return replies

    @staticmethod
    def _try_send(sock: zmq.Socket, payload: bytes) -> bool:
        try:
            sock.send(payload, zmq.NOBLOCK)
        except zmq.Again:
            return False
        return True

    @staticmethod
    def _drain(sock: zmq.Socket, rid: int) -> proto.Reply | None:
        """Read what is queued on sock; the reply to rid if it is there (older replies
        and undecodable frames are dropped)."""
        while True:
            try:
                frame = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return None
            try:
                reply = proto.decode_reply(frame)
            except proto.MalformedMessage as exc:
                log.warning("undecodable lookup reply dropped", error=str(exc))
                continue
            if reply.rid == rid:
                return reply

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for sock in self._socks:
                sock.close(0)
            self._ctx.term()

    def __enter__(self) -> LookupClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

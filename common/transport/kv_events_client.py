"""A subscriber of the controller's KV-event feed that never hands over a stream with a
silent hole: it finds gaps by seq, fills them from the replay socket, and says so when
it cannot (common/protocol/kv_events.py has the frames and rules).

    async with KvEventsSubscriber("tcp://ctl:7650", "tcp://ctl:7651", namespaces=[ns]) as sub:
        async for item in sub:
            if isinstance(item, Lost):  ...   # resync what item.topics covers
            else: use(item.seq, item.topic, item.payload)

`GapTracker` is the bookkeeping alone (no sockets): per topic the newest seq handed
over; a message whose `prev_seq` is newer than that was preceded by one not received.
A message at or below it (a replayed one arriving again from the PUB) is dropped.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Self

import msgspec
import zmq
import zmq.asyncio

from kvmesh.common.protocol import kv_events as kv
from kvmesh.common.transport.curve import CurveKeys, apply_client
from kvmesh.common.transport.tcp_address import connect

RCVHWM = 100_000


@dataclass(frozen=True, slots=True)
class Delivery:
    seq: int
    topic: str
    payload: kv.Payload
    replayed: bool = False  # came from the replay socket, not the PUB


@dataclass(frozen=True, slots=True)
class Lost:
    """Messages that could not be recovered: what the subscriber knew of `topics` (all
    of them when empty) is void; resync it."""

    reason: str
    epoch: str
    topics: tuple[str, ...] = ()
    after_seq: int = 0  # the lost ones lie after this seq...
    before_seq: int = 0  # ...and before this one (0: unknown)


Item = Delivery | Lost


class ReplayError(Exception):
    """The replay socket answered an error (code: kv_events.ErrorCode) or nothing."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


class GapTracker:
    """Which messages were handed over, per topic, in the current epoch."""

    def __init__(self, since: int | None = None) -> None:
        self.epoch = ""
        # Seqs at or below the floor are not wanted on a topic not seen yet: None until
        # the first message, which then sets it just below itself.
        self.floor = since
        self.last: dict[str, int] = {}

    def expected(self, topic: str) -> int:
        """The newest seq of topic handed over (or the floor)."""
        return self.last.get(topic, self.floor or 0)

    def new_epoch(self, epoch: str, floor: int | None) -> bool:
        """Start tracking epoch (the first one, or a new one); True when one was
        tracked before, so what was known of it is void."""
        changed = bool(self.epoch) and epoch != self.epoch
        self.epoch, self.floor = epoch, floor
        self.last.clear()
        return changed

    def handed(self, seq: int, topic: str) -> None:
        self.last[topic] = seq


class KvEventsSubscriber:
    """SUB on `events_url`, DEALER on `replay_url` ("" = no replay: gaps become Lost)."""

    def __init__(
        self,
        events_url: str,
        replay_url: str = "",
        *,
        namespaces: Sequence[str] = (),
        since: int | None = None,
        curve: CurveKeys | None = None,
        replay_timeout_s: float = 5.0,
    ) -> None:
        bad = [ns for ns in namespaces if not kv.is_topic(ns)]
        if bad:
            raise ValueError(f"namespace ids are 16 lower-case hex digits, got {bad[0]!r}")
        if since is not None and since < 0:
            raise ValueError("since must be >= 0")
        self.events_url = events_url
        self.replay_url = replay_url
        self.namespaces = tuple(namespaces)
        self.since = since
        self.curve = curve
        self.replay_timeout_s = replay_timeout_s
        self.tracker = GapTracker(since)
        self.malformed = 0  # PUB messages that did not decode (skipped)
        self.replays = 0
        self._ctx = zmq.asyncio.Context()
        self._sub: zmq.asyncio.Socket | None = None
        self._dealer: zmq.asyncio.Socket | None = None
        self._rid = 0
        self._pending: list[Item] = []

    # -- lifecycle ----------------------------------------------------------------------
    async def connect(self) -> None:
        """Subscribe; with `since`, first replay what came after it."""
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, RCVHWM)
        try:
            apply_client(sub, self.curve, self.events_url)
            for ns in self.namespaces or ("",):
                sub.setsockopt(zmq.SUBSCRIBE, ns.encode())
            connect(sub, self.events_url)
        except Exception:  # a malformed URL: no socket left for term() to wait on
            sub.close(linger=0)
            raise
        self._sub = sub
        if self.since is not None:
            # Subscribed first: what is published while the replay runs arrives on the
            # PUB too, and the tracker drops the copies.
            self._pending += await self._catch_up(self.since, self.namespaces, "")

    async def close(self) -> None:
        for sock in (self._sub, self._dealer):
            if sock is not None:
                sock.close(linger=0)
        self._sub = self._dealer = None
        self._ctx.destroy(linger=0)  # term() would wait for a socket left open anywhere

    async def __aenter__(self) -> Self:
        await self.connect()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    # -- receiving ----------------------------------------------------------------------
    def __aiter__(self) -> AsyncIterator[Item]:
        return self._items()

    async def _items(self) -> AsyncIterator[Item]:
        while True:
            while self._pending:
                yield self._pending.pop(0)
            assert self._sub is not None, "connect() first"
            frames = await self._sub.recv_multipart()
            self._pending += await self.accept(frames)

    async def accept(self, frames: Sequence[bytes]) -> list[Item]:
        """What one PUB message gives, in order: replayed messages it showed missing
        (or Lost), then itself; [] for a copy already handed over or a malformed one."""
        try:
            if len(frames) != 3:
                raise ValueError(f"{len(frames)} frames")
            topic = bytes(frames[0]).decode("ascii")
            seq = kv.decode_seq(frames[1])
            payload = kv.decode_payload(frames[2])
        except (ValueError, msgspec.DecodeError):
            self.malformed += 1
            return []
        tr = self.tracker
        out: list[Item] = []
        if payload.epoch != tr.epoch:
            if tr.new_epoch(payload.epoch, 0 if tr.epoch else tr.floor):
                out.append(Lost("controller epoch changed", payload.epoch))
            if tr.floor is None:
                tr.floor = seq - 1  # the first message: nothing before it is ours
        expected = tr.expected(topic)
        if seq <= expected:
            return out
        if payload.prev_seq > expected:
            out += await self._fill(topic, expected, payload.prev_seq)
        if seq > tr.expected(topic):
            tr.handed(seq, topic)
            out.append(Delivery(seq, topic, payload))
        return out

    async def _fill(self, topic: str, after: int, prev: int) -> list[Item]:
        """The messages of topic between after and the one whose prev_seq is prev."""
        tr = self.tracker
        if not self.replay_url:
            return [Lost("gap and no replay socket", tr.epoch, (topic,), after, prev + 1)]
        return await self._catch_up(after, (topic,), tr.epoch, before=prev + 1)

    async def _catch_up(
        self, since: int, topics: Iterable[str], epoch: str, before: int = 0
    ) -> list[Item]:
        tr = self.tracker
        topics = tuple(topics)
        try:
            entries, reply_epoch, last_seq = await self.replay(since, topics, epoch)
        except ReplayError as exc:
            return [Lost(str(exc), tr.epoch or epoch, topics, since, before)]
        out: list[Item] = []
        if reply_epoch != tr.epoch:
            tr.new_epoch(reply_epoch, since)
        for seq, topic, payload in entries:
            if before and seq >= before:
                break  # the message that showed the gap, and later ones, come on the PUB
            prev = tr.expected(topic)
            if seq > prev:
                tr.handed(seq, topic)
                if payload is None:  # not decodable (a newer kind?): a hole, said so
                    out.append(Lost("undecodable", tr.epoch, (topic,), prev, seq + 1))
                else:
                    out.append(Delivery(seq, topic, payload, replayed=True))
        if not epoch:  # the start-up replay: later messages of other topics are new
            tr.floor = max(tr.floor or 0, last_seq)
        return out

    # -- the replay socket --------------------------------------------------------------
    async def replay(
        self, since: int, topics: Sequence[str] = (), epoch: str = ""
    ) -> tuple[list[tuple[int, str, kv.Payload | None]], str, int]:
        """(messages after since, the epoch, the newest seq published) from the replay
        socket (payload None: it did not decode); ReplayError for its error reply or no
        answer in replay_timeout_s."""
        if not self.replay_url:
            raise ReplayError(0, "no replay socket")
        dealer = self._replay_socket()
        self._rid += 1
        rid = self._rid
        self.replays += 1
        req = kv.Replay(rid, kv.PROTOCOL_VERSION, since, list(topics), epoch)
        await dealer.send(kv.encode(req))
        out: list[tuple[int, str, kv.Payload | None]] = []
        deadline = time.monotonic() + self.replay_timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not await dealer.poll(left * 1000):
                self._drop_replay_socket()  # a late answer must not meet the next request
                raise ReplayError(0, f"replay: no answer in {self.replay_timeout_s:g}s")
            try:
                reply = kv.decode_reply(await dealer.recv())
            except kv.MalformedMessage as exc:
                raise ReplayError(exc.reply.code, f"replay: {exc}") from None
            if reply.rid != rid:
                continue  # an answer to an earlier request that timed out
            if isinstance(reply, kv.ErrorReply):
                raise ReplayError(reply.code, reply.message)
            if isinstance(reply, kv.ReplayEnd):
                return out, reply.epoch, reply.last_seq
            for e in reply.entries:
                try:
                    out.append((e.seq, e.topic, kv.decode_payload(e.payload)))
                except (ValueError, msgspec.DecodeError):
                    self.malformed += 1
                    out.append((e.seq, e.topic, None))

    def _replay_socket(self) -> zmq.asyncio.Socket:
        if self._dealer is None:
            dealer = self._ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            try:
                apply_client(dealer, self.curve, self.replay_url)
                connect(dealer, self.replay_url)
            except Exception:
                dealer.close(linger=0)
                raise
            self._dealer = dealer
        return self._dealer

    def _drop_replay_socket(self) -> None:
        if self._dealer is not None:
            self._dealer.close(linger=0)
            self._dealer = None

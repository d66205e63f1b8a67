"""Admin fan-out: send one command to many workers, gather per-worker results, each
worker under its own deadline, and keep recent results for `CheckFinish`."""

from __future__ import annotations

import asyncio
import itertools
import secrets
from collections import OrderedDict
from collections.abc import Callable

from kvmesh.common.protocol import controller as proto
from kvmesh.services.controller.registry import WorkerEntry

KEEP_EVENTS = 1000


class AdminFanout:
    def __init__(
        self,
        push: Callable[[bytes, proto.Command], bool],
        timeout_s: float,
        peer_of: Callable[[str], bytes | None] = lambda _worker_id: None,
    ) -> None:
        self._push = push
        self.timeout_s = timeout_s
        self._peer_of = peer_of  # a worker's current connection (it changes on reconnect)
        # From a random start each run: a late reply to a command of an earlier run
        # (a fetch may take an hour) then matches no command of this one.
        self._rids = itertools.count(secrets.randbits(62) + 1)
        # rid → (the peer and worker the command went to, its waiter)
        self._pending: dict[int, tuple[bytes, str, asyncio.Future[proto.CommandReply]]] = {}
        # event id → (done, results); the oldest are forgotten past KEEP_EVENTS.
        self.events: OrderedDict[str, tuple[bool, list[proto.WorkerResult]]] = OrderedDict()

    def on_reply(self, peer: bytes, msg: proto.CommandReply) -> bool:
        """Hand a worker's CommandReply to its waiter; False when none waits (late), or
        when it names another worker than the command went to or comes from a
        connection that is not that worker's (a Move would otherwise remove chunks on
        someone else's word). The worker's connection then or now: a long fetch may
        end after the worker reconnected."""
        pending = self._pending.get(msg.rid)
        if pending is None:
            return False
        to_peer, worker_id, fut = pending
        if worker_id != msg.worker_id or fut.done():
            return False
        if peer != to_peer and peer != self._peer_of(worker_id):
            return False
        fut.set_result(msg)
        return True

    async def run(
        self,
        event_id: str,
        op: str,
        targets: list[WorkerEntry],
        tier: str,
        keys: list[str],
        *,
        method: str = "",
        timeout_s: float = 0.0,
    ) -> list[proto.WorkerResult]:
        """The same command to every target; one result each."""
        self.remember(event_id, False, [])
        replies = await asyncio.gather(
            *(
                self.ask(w, event_id, op, tier=tier, keys=keys, method=method, timeout_s=timeout_s)
                for w in targets
            )
        )
        results = [result_of(r) for r in replies]
        self.remember(event_id, True, results)
        return results

    async def ask(
        self,
        worker: WorkerEntry,
        event_id: str,
        op: str,
        *,
        tier: str = "",
        keys: list[str] | None = None,
        source: str = "",
        timeout_s: float = 0.0,
        method: str = "",
    ) -> proto.CommandReply:
        """One command to one worker and its reply within timeout_s (0: the default);
        not reaching the worker, or no reply in time, is a reply with ok=False."""
        timeout_s = timeout_s or self.timeout_s
        if worker.peer is None:
            return _failed(worker, "not connected")
        rid = next(self._rids)
        fut: asyncio.Future[proto.CommandReply] = asyncio.get_running_loop().create_future()
        self._pending[rid] = (worker.peer, worker.worker_id, fut)
        # The worker is told a shorter deadline, so its answer (a partial result
        # included) arrives before we stop waiting for it.
        worker_deadline = timeout_s - min(0.5, timeout_s / 4)
        cmd = proto.Command(rid, event_id, op, tier, keys or [], source, worker_deadline, method)
        try:
            if not self._push(worker.peer, cmd):
                return _failed(worker, "send failed")
            async with asyncio.timeout(timeout_s):
                return await fut
        except TimeoutError:
            return _failed(worker, "timeout")
        finally:
            self._pending.pop(rid, None)

    def remember(self, event_id: str, done: bool, results: list[proto.WorkerResult]) -> None:
        self.events[event_id] = (done, results)
        self.events.move_to_end(event_id)
        while len(self.events) > KEEP_EVENTS:
            self.events.popitem(last=False)


def result_of(reply: proto.CommandReply) -> proto.WorkerResult:
    return proto.WorkerResult(reply.worker_id, reply.ok, reply.count, reply.error, reply.detail)


def _failed(worker: WorkerEntry, error: str) -> proto.CommandReply:
    return proto.CommandReply(0, worker.worker_id, False, error=error)

"""Admin fan-out: send one command to many workers, gather per-worker results, each
worker under its own deadline, and keep recent results for `CheckFinish`."""

from __future__ import annotations

import asyncio
import itertools
from collections import OrderedDict
from collections.abc import Callable

from kvmesh.common.protocol import controller as proto
from kvmesh.services.controller.registry import WorkerEntry

KEEP_EVENTS = 1000


class AdminFanout:
    def __init__(self, push: Callable[[bytes, proto.Command], bool], timeout_s: float) -> None:
        self._push = push
        self.timeout_s = timeout_s
        self._rids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[proto.CommandReply]] = {}
        # event id → (done, results); the oldest are forgotten past KEEP_EVENTS.
        self.events: OrderedDict[str, tuple[bool, list[proto.WorkerResult]]] = OrderedDict()

    def on_reply(self, msg: proto.CommandReply) -> bool:
        """Hand a worker's CommandReply to its waiter; False when none waits (late)."""
        fut = self._pending.get(msg.rid)
        if fut is None or fut.done():
            return False
        fut.set_result(msg)
        return True

    async def run(
        self, event_id: str, op: str, targets: list[WorkerEntry], tier: str, keys: list[str]
    ) -> list[proto.WorkerResult]:
        self._remember(event_id, False, [])
        results = await asyncio.gather(*(self._one(w, event_id, op, tier, keys) for w in targets))
        self._remember(event_id, True, list(results))
        return list(results)

    async def _one(
        self, worker: WorkerEntry, event_id: str, op: str, tier: str, keys: list[str]
    ) -> proto.WorkerResult:
        if worker.peer is None:
            return proto.WorkerResult(worker.worker_id, False, error="not connected")
        rid = next(self._rids)
        fut: asyncio.Future[proto.CommandReply] = asyncio.get_running_loop().create_future()
        self._pending[rid] = fut
        try:
            if not self._push(worker.peer, proto.Command(rid, event_id, op, tier, keys)):
                return proto.WorkerResult(worker.worker_id, False, error="send failed")
            async with asyncio.timeout(self.timeout_s):
                r = await fut
            return proto.WorkerResult(worker.worker_id, r.ok, r.count, r.error, r.detail)
        except TimeoutError:
            return proto.WorkerResult(worker.worker_id, False, error="timeout")
        finally:
            self._pending.pop(rid, None)

    def _remember(self, event_id: str, done: bool, results: list[proto.WorkerResult]) -> None:
        self.events[event_id] = (done, results)
        self.events.move_to_end(event_id)
        while len(self.events) > KEEP_EVENTS:
            self.events.popitem(last=False)

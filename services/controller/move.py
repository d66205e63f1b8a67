"""`Move`: copy or move chunks from one instance to another, rank by rank.

Chunk keys carry their rank and namespace, so rank r of the destination can only use
what rank r of the source holds, and only when both registered the same namespaces.
Per rank, the destination's worker fetches the chunks straight from the source
worker's P2P endpoint (the bytes never pass through the controller) and names the
chunks it then holds; a move removes exactly those from the source, so a chunk that
did not arrive (dead peer, bad checksum, deadline) is never lost.

Whatever is wrong with the request as a whole (unknown instance, other world size or
namespaces, a key of no source rank) is refused before any worker is asked. What goes
wrong at one rank (no worker for it, a source without P2P, a timeout) is that rank's
`WorkerResult`.
"""

from __future__ import annotations

import asyncio

from kvmesh.common.keys import ChunkKey
from kvmesh.common.protocol import controller as proto
from kvmesh.services.controller.admin import AdminFanout, result_of
from kvmesh.services.controller.registry import Registry, WorkerEntry

MAX_MOVE_KEYS = proto.MAX_EVENTS_PER_BATCH
MAX_TIMEOUT_S = 3600.0


class MoveRefused(Exception):
    """The request cannot run as a whole: nothing was asked of any worker."""


class RankPlan:
    __slots__ = ("dst", "dst_id", "keys", "src", "src_id")

    def __init__(
        self, rank: int, msg: proto.Move, src: WorkerEntry | None, dst: WorkerEntry | None
    ) -> None:
        self.src, self.dst = src, dst
        self.src_id, self.dst_id = f"{msg.src_instance}/{rank}", f"{msg.dst_instance}/{rank}"
        self.keys: list[str] | None = None  # None: everything the source holds in L1


def plan(registry: Registry, msg: proto.Move) -> list[RankPlan]:
    """The per-rank work of msg; raises MoveRefused."""
    src, dst = msg.src_instance, msg.dst_instance
    if not src or not dst:
        raise MoveRefused("src_instance and dst_instance are required")
    if src == dst:
        raise MoveRefused(f"source and destination are both {src!r}")
    if not 0 <= msg.timeout_s <= MAX_TIMEOUT_S:
        raise MoveRefused(f"timeout_s: 0 (the default) to {MAX_TIMEOUT_S:g}")
    if len(msg.keys) > MAX_MOVE_KEYS:
        raise MoveRefused(f"at most {MAX_MOVE_KEYS} keys (none: every chunk)")
    srcs, dsts = _ranks(registry, src), _ranks(registry, dst)
    size, dst_size = _world_size(srcs), _world_size(dsts)
    if dst_size != size:
        raise MoveRefused(
            f"{src} has world size {size}, {dst} {dst_size}: chunks are keyed by rank, "
            "so only instances of one world size share them"
        )
    for rank in sorted(srcs.keys() & dsts.keys()):
        a, b = srcs[rank], dsts[rank]
        if sorted(a.namespaces) != sorted(b.namespaces):
            raise MoveRefused(
                f"rank {rank}: {a.worker_id} and {b.worker_id} store other namespaces "
                f"({a.namespaces} vs {b.namespaces}: model, KV layout, dtype or tenant "
                "salt differ), so they cannot share chunks"
            )
    plans = {r: RankPlan(r, msg, srcs.get(r), dsts.get(r)) for r in range(size)}
    if msg.keys:
        rank_of = {ns: e.rank for e in srcs.values() for ns in e.namespaces}
        for p in plans.values():
            p.keys = []
        for key in msg.keys:
            try:
                ns = ChunkKey.from_str(key).namespace_id
            except ValueError:
                raise MoveRefused(f"not a chunk key: {key[:60]!r}") from None
            rank = rank_of.get(ns)
            if rank is None:
                raise MoveRefused(
                    f"key {key}: its namespace is not one {src} registered (a tenant's "
                    "chunks move with the rest when no keys are given)"
                )
            keys = plans[rank].keys
            assert keys is not None
            keys.append(key)
        return [p for p in plans.values() if p.keys]
    return list(plans.values())


async def run(
    fanout: AdminFanout, msg: proto.Move, plans: list[RankPlan]
) -> list[proto.WorkerResult]:
    """Run the plans (ranks in parallel); the results are remembered under the event id."""
    fanout.remember(msg.event_id, False, [])
    per_rank = await asyncio.gather(*(_rank(fanout, msg, p) for p in plans))
    results = [r for rank in per_rank for r in rank]
    fanout.remember(msg.event_id, True, results)
    return results


async def _rank(fanout: AdminFanout, msg: proto.Move, p: RankPlan) -> list[proto.WorkerResult]:
    def failed(error: str) -> list[proto.WorkerResult]:
        return [proto.WorkerResult(p.dst_id, False, error=error)]

    if p.dst is None:
        return failed(f"{msg.dst_instance} has no worker for this rank")
    if p.src is None:
        return failed(f"{msg.src_instance} has no worker for this rank ({p.src_id})")
    if not p.src.p2p_endpoint:
        return failed(f"{p.src_id} serves no P2P endpoint (engine.p2p disabled there)")
    if p.src.peer is None:
        return failed(f"{p.src_id} is not connected (known from the snapshot only)")
    keys = p.keys
    if keys is None:
        listed = await fanout.ask(p.src, msg.event_id, "keys")
        if not listed.ok:
            return failed(f"listing the chunks of {p.src_id}: {listed.error}")
        keys = listed.keys
    if not keys:
        fetched = proto.CommandReply(0, p.dst_id, True)
    else:
        fetched = await fanout.ask(
            p.dst,
            msg.event_id,
            "fetch",
            keys=keys,
            source=p.src.p2p_endpoint,
            timeout_s=msg.timeout_s,
        )
    results = [result_of(fetched)]
    if msg.copy:
        return results
    asked = set(keys)
    confirmed = [k for k in fetched.keys if k in asked]
    if confirmed:
        results.append(result_of(await fanout.ask(p.src, msg.event_id, "remove", keys=confirmed)))
    else:
        results.append(proto.WorkerResult(p.src_id, True, 0, detail={"removed": 0, "kept": 0}))
    return results


def _ranks(registry: Registry, instance: str) -> dict[int, WorkerEntry]:
    out = {e.rank: e for e in registry.workers.values() if e.instance_id == instance}
    if not out:
        raise MoveRefused(f"unknown instance {instance!r}: no worker of it is registered")
    return out


def _world_size(workers: dict[int, WorkerEntry]) -> int:
    return max(e.world_size for e in workers.values())

"""The worker's side of the controller's `Move` (copy and move of chunks between
instances): list what L1 holds, fetch chunks from a peer's L1 into ours, remove chunks
that another worker now holds.

A fetch lands chunks through the P2P tier (`P2PTier.fetch`: key, size and xxh3 checked;
a chunk that fails is dropped, never inserted) and stores them through the storage
manager, so they reach our lower tiers and the controller learns of them from our KV
events like any stored chunk. Its reply names only the chunks L1 still holds when the
fetch ends: a move removes from the source exactly those, so a chunk our L1 evicted
meanwhile (a copy larger than L1) stays on the source. The reads count in the P2P
tier's metrics (`p2p_gets_total`, `p2p_received_bytes_total`) like its own gets.

Everything runs on the engine's loop; file work (removal from the disk tier) goes to a
thread.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, cast

import msgspec

from kvmesh.common.keys import ChunkKey
from kvmesh.common.observability import get_logger
from kvmesh.common.transport.channel import PeerError
from kvmesh.services.worker.tiers.p2p import P2PTier

if TYPE_CHECKING:
    from kvmesh.services.worker.engine import KVEngine

log = get_logger(__name__)

# Chunks per peer read: bounds what the peer pins (NIXL) or sends in one reply (ZMQ)
# and what one failed read loses.
FETCH_BATCH = 64
# A move removes only from the worker's own tiers: the remote tier is shared between
# instances, so the destination's copy lives there too.
OWN_TIERS = ("l1", "disk")


class CopyRefused(Exception):
    """The fetch cannot start here (no P2P tier, the source is this worker)."""


class Fetched(msgspec.Struct, frozen=True, kw_only=True):
    requested: int
    copied: int  # landed, verified and inserted by this fetch
    present: int  # already in L1 before it
    failed: int  # not held at the end: missing at the peer, bad, evicted, or past the deadline
    held: list[str]  # of the requested keys, those L1 holds now
    error: str = ""  # why the fetch stopped early ("" when it did not)


def l1_keys(engine: KVEngine) -> list[str]:
    """Every chunk key L1 holds: what a peer can fetch from us."""
    held = engine.storage.l1.keys()  # a copy, taken under the tier's lock
    return [k.to_str() for k in held]


async def fetch(engine: KVEngine, source: str, key_strs: list[str], deadline_s: float) -> Fetched:
    """Read key_strs from the P2P endpoint source into L1 within deadline_s (0: the
    P2P tier's own read timeout per batch). Raises CopyRefused."""
    tier = _p2p_tier(engine)
    if source and source == engine.p2p_endpoint:
        raise CopyRefused("the source is this worker")
    unique = list(dict.fromkeys(key_strs))
    keys = _parse(unique)  # a malformed key is never held: it counts as failed
    l1, storage = engine.storage.l1, engine.storage
    wanted = [k for k in keys if not l1.contains(k)]
    present = len(keys) - len(wanted)
    batches = -(-len(wanted) // FETCH_BATCH)
    end = time.monotonic() + (deadline_s or tier.config.timeout_s * batches)
    copied, error = 0, ""
    for i in range(0, len(wanted), FETCH_BATCH):
        left = end - time.monotonic()
        if left <= 0:
            error = f"deadline: {len(wanted) - i} chunks not fetched"
            break
        try:
            good = await tier.fetch(source, wanted[i : i + FETCH_BATCH], l1, left)
        except PeerError as exc:
            error = f"peer {source}: {exc}"
            break
        for key, obj in good.items():
            storage.put(key, obj)  # takes over our reference, inserted or not
            copied += 1
    held = [k.to_str() for k in keys if l1.contains(k)]
    if error:
        log.info("fetch from peer stopped", peer=source, error=error, copied=copied)
    return Fetched(
        requested=len(unique),
        copied=copied,
        present=present,
        failed=len(unique) - len(held),
        held=held,
        error=error,
    )


async def remove(engine: KVEngine, key_strs: list[str]) -> tuple[int, int]:
    """Remove the chunks from this worker's own tiers (pinned L1 chunks stay);
    (chunks removed, chunks kept)."""
    keys = _parse(dict.fromkeys(key_strs))
    storage = engine.storage
    tiers = [t.name for t in storage.tiers if t.name in OWN_TIERS]

    def work() -> tuple[int, int]:
        removed = sum(1 for k in keys if sum(storage.remove(k, t) for t in tiers))
        return removed, sum(1 for k in keys if storage.l1.contains(k))

    return await asyncio.to_thread(work)


def _parse(key_strs: Iterable[str]) -> list[ChunkKey]:
    keys = []
    for s in key_strs:
        try:
            keys.append(ChunkKey.from_str(s))
        except ValueError:
            continue
    return keys


def _p2p_tier(engine: KVEngine) -> P2PTier:
    try:
        return cast(P2PTier, engine.storage.tier("p2p"))
    except KeyError:
        raise CopyRefused(
            "engine.p2p is not enabled on this worker: it has no channel to fetch with"
        ) from None

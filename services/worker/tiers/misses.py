"""Why a tier could not give a chunk it was asked for: `kvmesh_chunk_misses_total`.

A retrieve (or prefetch) asks the tiers for chunks in order; each tier that is asked
for a chunk and cannot give it counts one miss with a reason:

- `not_stored`: the tier does not hold it and does not remember evicting it.
- `evicted`: the tier held it and evicted it. Remote tier: this worker stored or saw
  it in the remote store, which no longer has it. P2P: the peer the controller named
  no longer has it.
- `timeout`: a deadline passed (remote and P2P `timeout_s`, the engine's I/O deadline).
- `checksum`: the bytes read failed verification (checksum, key, shape or length)
  and were dropped.
- `remote_down`: the remote store or the peer is down or refused the connection.
- `error`: anything else (an I/O error, no L1 buffer to read into, a bad reply).

"evicted" needs a memory of what went away: a bounded `RecentKeys` per tier
(common/recent_keys.py), so a chunk evicted longer ago than it reaches is reported as
`not_stored`.

Lookups (the scheduler's "how much is cached?") count nothing here: they repeat every
scheduler step for a waiting request, which would count one absence many times.
"""

from __future__ import annotations

from enum import StrEnum

from kvmesh.common.keys import ChunkKey
from kvmesh.common.observability import Metrics
from kvmesh.common.recent_keys import RecentKeys


class MissReason(StrEnum):
    NOT_STORED = "not_stored"
    EVICTED = "evicted"
    TIMEOUT = "timeout"
    CHECKSUM = "checksum"
    REMOTE_DOWN = "remote_down"
    ERROR = "error"


class TierMisses:
    """The miss counters of one tier, plus its memory of evicted keys.

    The counters live in the registry handed in (the engine's, so they carry its
    `instance` and `rank` labels), or in one of their own.
    """

    def __init__(self, tier: str, metrics: Metrics | None = None) -> None:
        self.tier = tier
        self.metrics = m = metrics if metrics is not None else Metrics()
        misses = m.counter(
            "chunk_misses_total",
            "Chunks a tier was asked for and could not give, by tier and reason",
            ["tier", "reason"],
        )
        self._misses = {r: misses.labels(tier=tier, reason=r.value) for r in MissReason}
        for counter in self._misses.values():
            counter.inc(0)  # every reason exported from the start: a dashboard sees 0
        self.evicted: RecentKeys[ChunkKey] = RecentKeys()

    def inc(self, reason: MissReason, n: int = 1) -> None:
        if n:
            self._misses[reason].inc(n)

    def absent(self, key: ChunkKey) -> MissReason:
        """The reason for a chunk the tier does not hold: evicted if it remembers
        evicting it, else not stored."""
        return MissReason.EVICTED if key in self.evicted else MissReason.NOT_STORED

    def count_absent(self, key: ChunkKey) -> None:
        self.inc(self.absent(key))

    def value(self, reason: MissReason | str) -> float:
        """The counter's current value (tests, status output)."""
        found = self.metrics.value(
            "chunk_misses_total", {"tier": self.tier, "reason": MissReason(reason).value}
        )
        return found or 0.0

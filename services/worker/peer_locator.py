"""Who holds a prefix in their L1: the contract between the P2P tier (which reads
chunks from peers) and whatever can answer (the controller client; a fixed table in
tests). Kept apart so neither side imports the other."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import msgspec

from kvmesh.common.keys import ChunkKey


class PeerLocation(msgspec.Struct, frozen=True):
    """The peer holding the longest run of the asked keys, from the first."""

    instance_id: str
    rank: int
    endpoint: str  # the peer's P2P endpoint (tcp://host:port), as it registered it
    count: int  # how many leading keys it holds


class PeerLocator(Protocol):
    def locate(self, keys: Sequence[ChunkKey], timeout: float) -> PeerLocation | None:
        """The best peer for keys (never this engine itself), or None: no peer holds
        the first key, or no answer within timeout. Must not raise."""
        ...

"""Rewriting chunks already stored in a tier through another codec: `engine.compress`,
`engine.decompress`, and the controller's `compress` command.

Only the tiers that keep chunk bytes in a codec's form take part: the disk tier and
the remote one (L1 holds raw pages, which vLLM's buffers are copied from, and the P2P
tier reads other engines' L1). Each chunk is read and verified, encoded with the new
codec, and replaced whole (tiers/disk.py `rewrite`, tiers/remote.py `arewrite`), so a
reader never sees a chunk half old and half new. New chunks keep going through the
tier's configured `compression`; this converts what is already there.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import msgspec

from kvmesh.common.codecs import make_codec
from kvmesh.common.keys import ChunkKey
from kvmesh.common.observability import get_logger

if TYPE_CHECKING:  # the engine imports this module
    from kvmesh.services.worker.engine import KVEngine

log = get_logger(__name__)

TIERS = ("disk", "remote")
OUTCOMES = ("rewritten", "unchanged", "absent", "failed")


class CompressResult(msgspec.Struct, kw_only=True):
    """What a compress or decompress did in one tier."""

    tier: str
    method: str
    asked: int = 0  # chunks named (or held, for "all")
    rewritten: int = 0
    unchanged: int = 0  # already stored so, or the codec did not pay off
    absent: int = 0  # not in the tier (or removed meanwhile)
    failed: int = 0  # unreadable (a corrupt chunk is dropped) or not written
    timed_out: bool = False  # the deadline passed before every chunk was tried

    def add(self, outcome: str) -> None:
        setattr(self, outcome, getattr(self, outcome) + 1)

    @property
    def tried(self) -> int:
        return sum(getattr(self, k) for k in OUTCOMES)

    @property
    def detail(self) -> dict[str, int]:
        return {"asked": self.asked, **{k: getattr(self, k) for k in OUTCOMES}}


def rewrite_chunks(
    engine: KVEngine,
    keys: Sequence[ChunkKey] | None,
    method: str,
    tier: str,
    *,
    params: dict | None = None,
    deadline_s: float | None = None,
) -> CompressResult:
    """Rewrite keys (None: every chunk the tier holds for this engine) in tier through
    method's codec. Blocking: call it from a thread, never from the engine's loop."""
    if tier not in TIERS:
        raise ValueError(f"tier must be one of {', '.join(TIERS)} (got {tier!r})")
    codec = make_codec(method, params)  # ValueError naming the known ones
    storage = engine.storage
    try:
        target = storage.tier(tier)
    except KeyError:
        raise ValueError(f"this engine has no {tier} tier (it is not enabled)") from None
    if tier == "remote" and codec is not None and not target.connector.compresses:
        raise ValueError(
            f"{target.connector.scheme}:// keeps chunks in the disk tier's format: "
            "compress them where they are written from (the disk tier)"
        )
    if keys is None:
        keys = target.keys() if tier == "disk" else target.known_keys()
    result = CompressResult(tier=tier, method=method, asked=len(keys))
    end = None if deadline_s is None else time.monotonic() + deadline_s
    allocator = storage.l1
    loop = engine.loop
    for key in keys:
        if end is not None and time.monotonic() > end:
            result.timed_out = True
            break
        if tier == "disk":
            outcome = target.rewrite(key, codec, allocator)
        else:
            left = None if end is None else max(0.1, end - time.monotonic())
            try:
                outcome = loop.run(target.arewrite(key, codec, allocator), left)
            except TimeoutError:
                outcome = "failed"
        result.add(outcome)
    log.info(
        "chunks rewritten",
        tier=tier,
        method=method,
        **result.detail,
        timed_out=result.timed_out,
    )
    return result

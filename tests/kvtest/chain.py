"""The documented chunk-hash chain, written out without kvmesh's own code: what the
token database's keys are checked against."""

from __future__ import annotations

import struct

import xxhash

SEED = xxhash.xxh3_128_digest(b"kvmesh/chunk-chain/v1")


def expected_chain(tokens: list[int], size: int, unfull: bool = False) -> list[bytes]:
    """xxh3-128 over each chunk's uint32 little-endian ids, chained from SEED; a
    partial last chunk only with unfull."""
    prev, out = SEED, []
    for start in range(0, len(tokens), size):
        chunk = tokens[start : start + size]
        if len(chunk) < size and not unfull:
            break
        prev = xxhash.xxh3_128_digest(prev + struct.pack(f"<{len(chunk)}I", *chunk))
        out.append(prev)
    return out

"""Chunk-holder bitmaps, shared by the controller's registry and the lookup-servers'
copies of it (services/controller/registry.py, services/lookup/index.py).

A chunk is a 60-bit int, `(low 64 bits of its hash ^ namespace id) & CHUNK_INT_MASK`,
and `holders[chunk]` a bitmask with TIER_BITS bits per worker slot (l1, disk, remote,
other): "who holds this in L1" is a mask test, and a prompt's cached prefix a walk over
its chunk hashes until a worker's bits run out. Both sides must agree bit for bit, since
the lookup-server answers from pushes of the registry's ints: hence one module.
"""

from __future__ import annotations

import contextlib
import sys
from array import array
from collections.abc import Callable, Iterable, Mapping, Sequence

from kvmesh.common.keys import KEY_STRING
from kvmesh.common.protocol.controller import CHUNK_INT_MASK

try:  # the C packer (common/csrc/chunk_ints.c), built with the package when it can be
    from kvmesh.common import _chunk_ints  # type: ignore[attr-defined]
except ImportError:
    _chunk_ints = None

_PACKED_IN_C = (list, tuple, set, frozenset)


def native_packer_available() -> bool:
    """Whether the C helper that packs (and folds keys to) chunk ints was built and loads."""
    return _chunk_ints is not None


# Chunks per step where the controller and the lookup-servers walk a worker's chunks
# between serving requests (parsing, packing, applying or clearing): 5-20 ms a step.
WALK_STEP = 8192
TIER_BITS = 4
TIER_INDEX = {"l1": 0, "disk": 1, "remote": 2}
OTHER_TIER = 3
SLOT_MASK = (1 << TIER_BITS) - 1

# One prefix-count row: (instance id, world size, ranks known, chunks, l1 chunks).
PrefixRow = tuple[str, int, int, int, int]


def tier_bit(slot: int, tier: str) -> int:
    return 1 << (slot * TIER_BITS + TIER_INDEX.get(tier, OTHER_TIER))


def slot_bits(slot: int) -> int:
    return SLOT_MASK << (slot * TIER_BITS)


def chunk_int_py(key: str) -> int:
    """The chunk int of a chunk key string ("<16 hex ns>-<32 hex hash>", lower case, as
    ChunkKey.to_str writes it): the low 64 bits of the hash XOR the namespace, masked
    to 60 bits; ValueError when it is not one. `chunk_int` is the C build of it when
    there is one (~60 ns a key against ~0.6 µs)."""
    if not isinstance(key, str) or KEY_STRING.fullmatch(key) is None:
        raise ValueError(f"not a chunk key: {key!r:.60}")
    return (int(key[33:], 16) ^ int(key[:16], 16)) & CHUNK_INT_MASK


def chunk_ints_py(keys: list[str]) -> tuple[list[int], int]:
    """(the chunk ints of the chunk key strings among keys, how many were not one);
    `chunk_ints` is the C build of it when there is one."""
    ints = []
    for key in keys:
        with contextlib.suppress(ValueError):
            ints.append(chunk_int_py(key))
    return ints, len(keys) - len(ints)


# Bound to the C functions themselves: no Python frame per call on the hot paths.
chunk_int: Callable[[str], int] = _chunk_ints.fold_key if _chunk_ints else chunk_int_py
chunk_ints: Callable[[list[str]], tuple[list[int], int]] = (
    _chunk_ints.fold_keys if _chunk_ints else chunk_ints_py
)


def pack_ints(ints: Iterable[int]) -> bytes:
    """Chunk ints as little-endian uint64s (the snapshot's and the wire's layout).

    A set of a million takes ~0.1 s in C against ~0.36 s through array("Q"), which
    converts each multi-digit int byte by byte; both raise the same errors."""
    if _chunk_ints is not None and type(ints) in _PACKED_IN_C:
        return _chunk_ints.pack_u64(ints)
    arr = array("Q", ints)  # type: ignore[call-overload]
    if sys.byteorder != "little":
        arr.byteswap()
    return arr.tobytes()


def unpack_ints(raw: bytes) -> array:
    """The wire's little-endian uint64 chunk ints."""
    arr = array("Q")
    arr.frombytes(raw)
    if sys.byteorder != "little":
        arr.byteswap()
    return arr


def leading_run(
    holders: Mapping[int, int], tails: Sequence[int], ns: int, slot: int
) -> tuple[int, int]:
    """How many leading chunks the worker in `slot` holds in any tier, and in L1."""
    any_bits, l1_bit = slot_bits(slot), tier_bit(slot, "l1")
    n = n_l1 = 0
    in_l1 = True
    for tail in tails:
        m = holders.get((tail ^ ns) & CHUNK_INT_MASK, 0)
        if not m & any_bits:
            break
        n += 1
        if in_l1 and m & l1_bit:
            n_l1 += 1
        else:
            in_l1 = False
    return n, n_l1


def prefix_counts(
    holders: Mapping[int, int],
    hashes: Sequence[bytes],
    workers: Iterable[tuple[str, int, int, Sequence[int]]],
) -> list[PrefixRow]:
    """Per instance, most chunks first: the leading run of `hashes` that every rank
    holds, in any tier and in L1. `workers` are (instance id, world size, slot,
    namespace ints); an instance missing a rank holds nothing."""
    tails = [int.from_bytes(h[8:16], "big") for h in hashes]
    runs: dict[str, list[tuple[int, int]]] = {}
    sizes: dict[str, int] = {}
    for instance, world_size, slot, namespaces in workers:
        sizes[instance] = max(sizes.get(instance, 0), world_size)
        best = max((leading_run(holders, tails, ns, slot) for ns in namespaces), default=(0, 0))
        runs.setdefault(instance, []).append(best)
    out = []
    for instance, found in runs.items():
        full = len(found) >= sizes[instance]
        chunks = min(r[0] for r in found) if full else 0
        l1_chunks = min(r[1] for r in found) if full else 0
        out.append((instance, sizes[instance], len(found), chunks, l1_chunks))
    out.sort(key=lambda t: (-t[3], -t[4], t[0]))
    return out

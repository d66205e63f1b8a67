"""Audit of chunk keys and token hashing: inputs whose keys came out wrong or that
crashed the process, and properties over random prompts that must hold on every path.

The defects fixed (each test below fails without its fix):
- a negated int tensor view (torch keeps the un-negated ids in memory) was hashed as
  the ids in memory, not the ones it holds: another prompt's key;
- a tensor with no storage (ZeroTensor, data pointer 0) was read at address 0: SIGSEGV;
- copy.copy of a KeyNamespace lost its id, so its key() raised AttributeError;
- a chunk_size beyond a C ssize_t was accepted, then every hash through the C helper
  raised OverflowError while the Python path hashed;
- a set, frozenset or mapping of ids was hashed in iteration order (a set also drops
  repeats): a key for other tokens than the prompt's.
"""

from __future__ import annotations

import collections
import copy
import random
import struct
import subprocess
import sys

import msgspec
import numpy as np
import pytest
import torch
import xxhash
from kvtest.chain import SEED, expected_chain

from kvmesh.common import tokendb
from kvmesh.common.keys import KeyNamespace
from kvmesh.common.tokendb import ChunkedTokenDatabase, SegmentTokenDatabase

NS = KeyNamespace(model="audit", kv_layout="KV_2LTD", dtype="bfloat16", world_size=2, rank=1)


def python_chain(db: ChunkedTokenDatabase, tokens: object) -> list[bytes]:
    """The pure-Python path, whatever the C helper would take."""
    view = tokendb._token_view(tokens)  # type: ignore[arg-type]
    return db._chain(view, len(view) // tokendb.TOKEN_BYTES)


def outcome(fn, *args: object) -> object:
    try:
        return fn(*args)
    except (ValueError, TypeError) as e:
        return type(e)


# --- negated views: the ids a tensor holds, not the bytes in its memory ----------------


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.int16])
def test_a_negated_tensor_view_is_hashed_by_the_ids_it_holds(dtype: torch.dtype) -> None:
    held = [5, 7_000, 3, 9]
    view = torch._neg_view(torch.tensor([-t for t in held], dtype=dtype))
    assert view.is_neg() and view.tolist() == held
    db = ChunkedTokenDatabase(NS, chunk_size=2, save_unfull_chunk=True)
    expected = expected_chain(held, 2, True)
    assert db.chunk_hashes(view) == expected  # the C helper's path for int64/int32
    assert python_chain(db, view) == expected
    assert tokendb.tokens_to_bytes(view) == struct.pack("<4I", *held)


def test_a_negated_view_of_valid_ids_is_refused_like_negative_ids() -> None:
    view = torch._neg_view(torch.tensor([1, 2, 3], dtype=torch.int32))  # holds -1, -2, -3
    db = ChunkedTokenDatabase(NS, chunk_size=2)
    with pytest.raises(ValueError, match="token ids"):
        db.chunk_hashes(view)
    with pytest.raises(ValueError, match="token ids"):
        python_chain(db, view)


# --- a tensor with no storage: a clear error, not a read at address 0 ----------------

_NO_STORAGE_CHILD = """
import torch
from kvmesh.common import tokendb
from kvmesh.common.keys import KeyNamespace
ns = KeyNamespace(model="audit", kv_layout="KV_2LTD", dtype="bfloat16", world_size=1, rank=0)
db = tokendb.ChunkedTokenDatabase(ns, chunk_size=2, save_unfull_chunk=True)
calls = [
    ("native", lambda t: db.chunk_hashes(t)),
    ("python", lambda t: db._chain(tokendb._token_view(t), 3)),
    ("bytes", tokendb.tokens_to_bytes),
]
for dtype in (torch.int64, torch.int32):
    for name, call in calls:
        try:
            call(torch._efficientzerotensor(3, dtype=dtype))
            print(name, dtype, "no error")
        except ValueError as e:
            print(name, dtype, "ValueError", e)
if tokendb._chain_hash is not None:
    try:
        tokendb._chain_hash.chain_memory(0, 3, "i64", 2, True, db._seed)
        print("chain_memory no error")
    except ValueError as e:
        print("chain_memory ValueError", e)
print("done")
"""


def test_a_tensor_without_storage_is_refused_not_read() -> None:
    # In a child: without the fix the read at address 0 kills the process.
    done = subprocess.run(
        [sys.executable, "-c", _NO_STORAGE_CHILD], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    lines = done.stdout.splitlines()
    assert lines[-1] == "done"
    assert len(lines) == 1 + 6 + (1 if tokendb.native_chain_available() else 0)
    for line in lines[:-1]:
        assert "ValueError" in line and "no allocated storage" in line, line


def test_an_empty_tensor_still_hashes_to_nothing() -> None:
    db = ChunkedTokenDatabase(NS, chunk_size=2, save_unfull_chunk=True)
    for t in (torch.empty(0, dtype=torch.int64), torch._efficientzerotensor(0, dtype=torch.int64)):
        assert db.chunk_hashes(t) == [] and tokendb.tokens_to_bytes(t) == b""


# --- KeyNamespace copies ---------------------------------------------------------------


def test_a_copied_namespace_keeps_its_id_and_keys() -> None:
    h = bytes(range(16))
    for dup in (copy.copy(NS), copy.deepcopy(NS)):
        assert dup == NS and dup.ns_id == NS.ns_id and dup.digest() == NS.digest()
        assert dup.key(h) == NS.key(h)
        assert dup.with_rank(0).ns_id == NS.with_rank(0).ns_id != NS.ns_id


# --- chunk_size bounds: one answer on both paths -----------------------------------------


@pytest.mark.parametrize("size", [sys.maxsize + 1, 2**70])
def test_a_chunk_size_beyond_what_the_helper_takes_is_refused_up_front(size: int) -> None:
    with pytest.raises(ValueError, match="chunk_size"):
        ChunkedTokenDatabase(NS, chunk_size=size)


@pytest.mark.parametrize("unfull", [False, True])
def test_the_largest_chunk_size_hashes_alike_on_both_paths(unfull: bool) -> None:
    db = ChunkedTokenDatabase(NS, chunk_size=sys.maxsize, save_unfull_chunk=unfull)
    tokens = [7, 8, 9]
    expected = [xxhash.xxh3_128_digest(SEED + struct.pack("<3I", *tokens))] if unfull else []
    assert db.chunk_hashes(tokens) == db.chunk_hashes(torch.tensor(tokens)) == expected
    assert python_chain(db, tokens) == expected


# --- unordered containers have no prompt to hash -------------------------------------------


@pytest.mark.parametrize(
    "tokens",
    [{3, 1, 2}, frozenset({1, 2}), {1: 0, 2: 0}, collections.Counter([1, 1, 2])],
    ids=lambda t: type(t).__name__,
)
def test_unordered_containers_of_ids_are_refused(tokens: object) -> None:
    db = ChunkedTokenDatabase(NS, chunk_size=1, save_unfull_chunk=True)
    with pytest.raises(TypeError, match="sequence of ints"):
        db.chunk_hashes(tokens)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="sequence of ints"):
        SegmentTokenDatabase(NS, [0]).chunk_hashes(tokens)  # type: ignore[arg-type]


# --- properties over random prompts (guards, not fixes) ---------------------------------


def _inputs(tokens: list[int]) -> dict[str, object]:
    """Every spelling of one prompt that either path takes."""
    out: dict[str, object] = {
        "list": tokens,
        "tuple": tuple(tokens),
        "numpy_u32": np.array(tokens, dtype=np.uint32),
        "numpy_i64": np.array(tokens, dtype=np.int64),
        "numpy_scalars": [np.uint32(t) for t in tokens],
        "int64": torch.tensor(tokens, dtype=torch.int64),
        "uint32": torch.tensor(tokens, dtype=torch.int64).to(torch.uint32),
        "int64_strided": torch.tensor([x for t in tokens for x in (t, 1)], dtype=torch.int64)[::2],
    }
    if all(t < 2**31 for t in tokens):
        out["int32"] = torch.tensor(tokens, dtype=torch.int32)
    return out


def test_random_prompts_key_alike_on_every_input_and_path() -> None:
    rng = random.Random(2611)
    for _ in range(60):
        n = rng.choice([0, 1, 2, rng.randrange(5001)])
        size = rng.choice([1, 3, 16, 256, rng.randrange(1, 700)])
        unfull = rng.random() < 0.5
        top = rng.choice([2**16, 2**31, 2**32])
        tokens = [rng.randrange(top) for _ in range(n)]
        db = ChunkedTokenDatabase(NS, chunk_size=size, save_unfull_chunk=unfull)
        expected = expected_chain(tokens, size, unfull)
        for name, given in _inputs(tokens).items():
            assert db.chunk_hashes(given) == expected, (name, n, size, unfull)
            assert python_chain(db, given) == expected, (name, n, size, unfull)
        spans = [(s, e) for s, e, _ in db.process_tokens(tokens)]
        assert spans == [(i * size, min((i + 1) * size, n)) for i in range(len(expected))]


@pytest.mark.parametrize("bad", [2**32, 2**32 + 5, 2**33, 2**63 - 1, -1, -(2**31)])
def test_an_id_out_of_range_never_wraps_to_another_id(bad: int) -> None:
    # Without a range check, 2**32 + 5 would key like 5 and -1 like 2**32 - 1.
    db = ChunkedTokenDatabase(NS, chunk_size=4, save_unfull_chunk=False)
    for pos in (0, 5, 9):  # the first chunk, a later one, the unkeyed tail
        tokens = [11] * 10
        tokens[pos] = bad
        kinds: list[object] = [tokens, tuple(tokens), np.array(tokens, dtype=np.int64)]
        kinds += [[np.int64(t) for t in tokens], torch.tensor(tokens, dtype=torch.int64)]
        if -(2**31) <= bad < 0:
            kinds.append(torch.tensor(tokens, dtype=torch.int32))
        for given in kinds:
            assert outcome(db.chunk_hashes, given) is ValueError, (type(given), pos)
            assert outcome(python_chain, db, given) is ValueError, (type(given), pos)


def test_every_earlier_token_and_every_namespace_field_changes_a_key() -> None:
    rng = random.Random(7)
    tokens = [rng.randrange(2**32) for _ in range(64)]
    db = ChunkedTokenDatabase(NS, chunk_size=16)
    base = [k for _, _, k in db.process_tokens(tokens)]
    for pos in range(64):
        changed = list(tokens)
        changed[pos] ^= 1 << rng.randrange(32)
        keys = [k for _, _, k in db.process_tokens(changed)]
        first = pos // 16
        assert keys[:first] == base[:first]
        assert all(a != b for a, b in zip(keys[first:], base[first:], strict=True))
    fields = {"model": "audit2", "kv_layout": "KV_MLA", "dtype": "float16", "tenant": "t"}
    others = [KeyNamespace(**{**msgspec.structs.asdict(NS), k: v}) for k, v in fields.items()]
    others += [NS.with_rank(0), KeyNamespace(**{**msgspec.structs.asdict(NS), "world_size": 4})]
    ids = {NS.ns_id} | {o.ns_id for o in others}
    assert len(ids) == 1 + len(others)
    for other in others:
        keys = [k for _, _, k in ChunkedTokenDatabase(other, chunk_size=16).process_tokens(tokens)]
        assert not set(keys) & set(base)


# --- RecentKeys under threads (a guard) -------------------------------------------------


def test_recent_keys_stay_bounded_and_consistent_under_threads() -> None:
    import threading

    from kvmesh.common.recent_keys import RecentKeys

    memory: RecentKeys[int] = RecentKeys(100)
    errors: list[BaseException] = []

    def churn(base: int) -> None:
        try:
            for i in range(20_000):
                memory.add(base + i % 300)
                if i % 7 == 0:
                    memory.discard(base + (i - 1) % 300)
                assert len(memory) <= 100
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=churn, args=(k * 1000,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors and not any(t.is_alive() for t in threads)
    snap = memory.snapshot()
    assert len(snap) == len(set(snap)) == len(memory) <= 100
    assert all(k in memory for k in snap)

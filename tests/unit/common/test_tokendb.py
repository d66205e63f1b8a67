"""kvmesh.common.tokendb: chained chunk hashes, masks, segments, stable bytes."""

from __future__ import annotations

import array
import json
import os
import struct
import subprocess
import sys

import pytest
import torch
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvtest.chain import expected_chain

from kvmesh.common import tokendb
from kvmesh.common.keys import ChunkKey, KeyNamespace
from kvmesh.common.tokendb import (
    MAX_TOKEN,
    ChunkedTokenDatabase,
    SegmentTokenDatabase,
    TokenDatabase,
    tokens_to_bytes,
)

NS = KeyNamespace(model="tiny-llama", kv_layout="LBHNC", dtype="float16", world_size=1, rank=0)
CS = 4  # small chunks keep the property tests fast and exercise many boundaries

token_lists = st.lists(st.integers(0, MAX_TOKEN), max_size=40)
small_tokens = st.lists(st.integers(0, 2**31 - 1), max_size=40)  # fit int32 tensors
hyp = settings(deadline=None, max_examples=80, suppress_health_check=[HealthCheck.too_slow])


def db(**kwargs: object) -> ChunkedTokenDatabase:
    kwargs.setdefault("chunk_size", CS)
    return ChunkedTokenDatabase(NS, **kwargs)  # type: ignore[arg-type]


def keys(database: TokenDatabase, tokens: object, mask: torch.Tensor | None = None) -> list:
    return [k for _, _, k in database.process_tokens(tokens, mask)]  # type: ignore[arg-type]


def mask_of(n_false: int, n: int) -> torch.Tensor:
    return torch.tensor([False] * n_false + [True] * (n - n_false), dtype=torch.bool)


# --- the hashing scheme, spelled out independently of the module -------------------


@hyp
@given(token_lists, st.booleans())
def test_hashes_follow_the_documented_chain(tokens: list[int], unfull: bool) -> None:
    assert db(save_unfull_chunk=unfull).chunk_hashes(tokens) == expected_chain(tokens, CS, unfull)


def test_keys_are_pinned() -> None:
    # Changing these orphans every stored chunk: this fails if the scheme drifts.
    got = [k.to_str() for k in keys(ChunkedTokenDatabase(NS), list(range(512)))]
    assert got == [
        "29222192afde4f20-e76624462c2723761184efd4d5d29a75",
        "29222192afde4f20-3e72d902190df17b96abd26dd68c17e3",
    ]


def test_chunk_boundaries_and_namespace() -> None:
    chunks = list(db().process_tokens(list(range(10))))
    assert [(s, e) for s, e, _ in chunks] == [(0, 4), (4, 8)]
    assert all(isinstance(k, ChunkKey) and k.namespace_id == NS.ns_id for _, _, k in chunks)
    assert [k.chunk_hash for _, _, k in chunks] == db().chunk_hashes(list(range(10)))


def test_unfull_chunk_on_and_off() -> None:
    tokens = list(range(10))
    off = list(db().process_tokens(tokens))
    on = list(db(save_unfull_chunk=True).process_tokens(tokens))
    assert [(s, e) for s, e, _ in on] == [(0, 4), (4, 8), (8, 10)]
    assert on[:2] == off
    # The partial chunk's key differs from the full chunk the same place would get.
    assert on[2][2] != keys(db(), [*tokens, 10, 11])[2]
    # A length that is a multiple of the chunk size has no partial chunk either way.
    assert len(db(save_unfull_chunk=True).chunk_hashes(list(range(8)))) == 2


@pytest.mark.parametrize("n", [0, 1, 3])
def test_fewer_tokens_than_a_chunk(n: int) -> None:
    assert keys(db(), list(range(n))) == []
    assert len(keys(db(save_unfull_chunk=True), list(range(n)))) == (1 if n else 0)


@hyp
@given(token_lists, st.integers(0, 40), st.booleans())
def test_a_prefix_of_tokens_gives_a_prefix_of_keys(
    tokens: list[int], cut: int, unfull: bool
) -> None:
    database = db(save_unfull_chunk=unfull)
    full = keys(database, tokens)
    part = keys(database, tokens[:cut])
    if unfull and cut % CS and cut < len(tokens):
        part = part[:-1]  # a partial chunk of the prefix is not a chunk of the whole
    assert full[: len(part)] == part


@hyp
@given(st.lists(st.integers(0, MAX_TOKEN), min_size=1, max_size=40), st.data())
def test_changing_one_token_changes_its_chunk_and_all_later_ones(
    tokens: list[int], data: st.DataObject
) -> None:
    i = data.draw(st.integers(0, len(tokens) - 1))
    changed = list(tokens)
    changed[i] = data.draw(st.integers(0, MAX_TOKEN).filter(lambda t: t != tokens[i]))
    database = db(save_unfull_chunk=True)
    before, after = keys(database, tokens), keys(database, changed)
    j = i // CS
    assert before[:j] == after[:j]
    assert all(b != a for b, a in zip(before[j:], after[j:], strict=True))


@hyp
@given(small_tokens)
def test_lists_tuples_arrays_and_tensors_agree(tokens: list[int]) -> None:
    database = db(save_unfull_chunk=True)
    expected = keys(database, tokens)
    assert keys(database, tuple(tokens)) == expected
    assert keys(database, array.array("q", tokens)) == expected
    assert keys(database, torch.tensor(tokens, dtype=torch.int64)) == expected
    assert keys(database, torch.tensor(tokens, dtype=torch.int32)) == expected
    assert database.chunk_hashes(torch.tensor(tokens, dtype=torch.int32)) == [
        k.chunk_hash for k in expected
    ]


@hyp
@given(token_lists)
def test_full_uint32_range_agrees_across_inputs(tokens: list[int]) -> None:
    # Ids >= 2**31 only fit int64 (and uint32) tensors; their bytes must match the list's.
    database = db(save_unfull_chunk=True)
    t64 = torch.tensor(tokens, dtype=torch.int64)
    assert keys(database, t64) == keys(database, tokens)
    assert keys(database, t64.to(torch.uint32)) == keys(database, tokens)


def test_non_contiguous_and_small_int_tensors() -> None:
    tokens = list(range(0, 40, 2))
    strided = torch.arange(40)[::2]
    assert not strided.is_contiguous()
    assert keys(db(), strided) == keys(db(), tokens)
    assert keys(db(), torch.tensor(tokens, dtype=torch.int16)) == keys(db(), tokens)
    assert keys(db(), torch.tensor(tokens, dtype=torch.uint8)) == keys(db(), tokens)


def test_token_bytes_are_little_endian_uint32() -> None:
    expected = b"\x01\x00\x00\x00\xff\xff\xff\xff\x00\x01\x00\x00"
    assert tokens_to_bytes([1, MAX_TOKEN, 256]) == expected
    assert tokens_to_bytes(torch.tensor([1, MAX_TOKEN, 256])) == expected
    assert tokens_to_bytes([]) == tokens_to_bytes(torch.tensor([], dtype=torch.int64)) == b""


def test_keys_do_not_follow_later_writes_to_the_tensor() -> None:
    tokens = torch.arange(16, dtype=torch.int32)
    chunks = db().process_tokens(tokens)
    tokens.fill_(7)
    assert [k for _, _, k in chunks] == keys(db(), list(range(16)))


@pytest.mark.parametrize(
    "tokens",
    [
        [-1],
        [MAX_TOKEN + 1],
        [0, 1, 2**40],
        torch.tensor([0, -1]),
        torch.tensor([MAX_TOKEN + 1]),
        torch.tensor([-5], dtype=torch.int32),
        torch.tensor([3, -1], dtype=torch.int8),
    ],
    ids=lambda t: repr(t)[:40],
)
def test_tokens_out_of_range_are_rejected(tokens: object) -> None:
    for database in (db(), SegmentTokenDatabase(NS, [0])):
        with pytest.raises(ValueError):
            database.process_tokens(tokens)  # type: ignore[arg-type]
        with pytest.raises(ValueError):
            database.chunk_hashes(tokens)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "tokens, error",
    [
        ([1.5], TypeError),
        (["1"], TypeError),
        (b"\x01\x02\x03\x04", TypeError),
        ("abcd", TypeError),
        (torch.tensor([1.0, 2.0]), TypeError),
        (torch.tensor([True]), TypeError),
        (torch.zeros((2, 4), dtype=torch.int64), ValueError),
    ],
    ids=lambda t: repr(t)[:30],
)
def test_bad_token_inputs_are_rejected(tokens: object, error: type[Exception]) -> None:
    with pytest.raises(error):
        db().process_tokens(tokens)  # type: ignore[arg-type]


# --- mask ---------------------------------------------------------------------------


@hyp
@given(token_lists, st.integers(0, 10), st.booleans())
def test_masked_prefix_chunks_are_skipped_but_chained(
    tokens: list[int], masked_chunks: int, unfull: bool
) -> None:
    database = db(save_unfull_chunk=unfull)
    n_false = min(masked_chunks * CS, len(tokens) - len(tokens) % CS)
    all_chunks = list(database.process_tokens(tokens))
    masked = list(database.process_tokens(tokens, mask_of(n_false, len(tokens))))
    assert masked == [c for c in all_chunks if c[0] >= n_false]


def test_mask_covering_every_token_yields_nothing() -> None:
    tokens = list(range(10))
    for unfull in (False, True):
        assert list(db(save_unfull_chunk=unfull).process_tokens(tokens, mask_of(10, 10))) == []


def test_all_true_mask_is_no_mask() -> None:
    tokens = list(range(12))
    assert list(db().process_tokens(tokens, mask_of(0, 12))) == list(db().process_tokens(tokens))


@pytest.mark.parametrize(
    "mask",
    [
        mask_of(3, 12),  # not a multiple of the chunk size
        mask_of(5, 12),
        torch.tensor([True] * 4 + [False] * 4 + [True] * 4),  # False after True
        torch.tensor([False] * 4 + [True] * 4 + [False] * 4),
        mask_of(4, 11),  # wrong length
        mask_of(4, 12).view(3, 4),  # not 1-D
    ],
)
def test_invalid_masks_are_rejected(mask: torch.Tensor) -> None:
    with pytest.raises(ValueError):
        db().process_tokens(list(range(12)), mask)


def test_non_bool_mask_is_rejected() -> None:
    with pytest.raises(TypeError):
        db().process_tokens(list(range(8)), torch.ones(8, dtype=torch.int64))


# --- configuration --------------------------------------------------------------------


def test_blake3_chain() -> None:
    blake3 = pytest.importorskip("blake3").blake3
    tokens = list(range(12))
    prev = blake3(b"kvmesh/chunk-chain/v1").digest(length=16)
    expected = []
    for start in range(0, 12, CS):
        prev = blake3(prev + struct.pack("<4I", *tokens[start : start + CS])).digest(length=16)
        expected.append(prev)
    assert db(hash_algorithm="blake3").chunk_hashes(tokens) == expected
    assert expected != db().chunk_hashes(tokens)


@pytest.mark.parametrize("kwargs", [{"chunk_size": 0}, {"chunk_size": -4}, {"chunk_size": 2.0}])
def test_invalid_chunk_size(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        ChunkedTokenDatabase(NS, **kwargs)


def test_unknown_hash_algorithm() -> None:
    with pytest.raises(ValueError, match="hash_algorithm"):
        ChunkedTokenDatabase(NS, hash_algorithm="md5")


def test_tenant_salt_separates_keys_but_not_hashes() -> None:
    tokens = list(range(16))
    tenant = ChunkedTokenDatabase(NS.with_rank(0), chunk_size=CS)
    salted = ChunkedTokenDatabase(
        KeyNamespace(**{**msgspec_fields(NS), "tenant": "acme"}), chunk_size=CS
    )
    a, b = keys(tenant, tokens), keys(salted, tokens)
    assert not set(a) & set(b)
    assert [k.chunk_hash for k in a] == [k.chunk_hash for k in b]


def msgspec_fields(ns: KeyNamespace) -> dict:
    return {f: getattr(ns, f) for f in ns.__struct_fields__}


def test_both_databases_satisfy_the_protocol() -> None:
    assert isinstance(db(), TokenDatabase)
    assert isinstance(SegmentTokenDatabase(NS, [0]), TokenDatabase)


# --- segments -----------------------------------------------------------------------

SEP = [900, 901]


def seg_db() -> SegmentTokenDatabase:
    return SegmentTokenDatabase(NS, SEP)


def test_segments_split_at_the_separator() -> None:
    tokens = [1, 2, 900, 901, 3, 900, 901, 900, 901, 4, 5, 900]
    assert seg_db().segments(tokens) == [(0, 2), (4, 5), (9, 12)]
    assert seg_db().segments([900, 901, *tokens[:2], 900, 901]) == [(2, 4)]
    assert seg_db().segments([]) == []
    assert seg_db().segments([900, 901]) == []
    chunks = list(seg_db().process_tokens(tokens))
    assert [(s, e) for s, e, _ in chunks] == [(0, 2), (4, 5), (9, 12)]
    assert [k.chunk_hash for _, _, k in chunks] == seg_db().chunk_hashes(tokens)


def test_a_byte_match_across_tokens_is_not_a_separator() -> None:
    # [0, 1] is 00 00 00 00 01 00 00 00; bytes 1..4 spell 0x01000000 little-endian.
    database = SegmentTokenDatabase(NS, [0x01000000])
    assert database.segments([0, 1]) == [(0, 2)]
    assert database.segments([0, 1, 0x01000000, 7]) == [(0, 2), (3, 4)]


@hyp
@given(
    st.lists(st.lists(st.integers(0, 899), min_size=1, max_size=8), min_size=1, max_size=5),
    st.data(),
)
def test_a_segment_keeps_its_key_wherever_it_appears(
    docs: list[list[int]], data: st.DataObject
) -> None:
    order = data.draw(st.permutations(range(len(docs))))
    by_doc = {}
    for arrangement in (range(len(docs)), order):
        tokens: list[int] = []
        for i in arrangement:
            tokens += [*docs[i], *SEP]
        for (_, _, key), i in zip(seg_db().process_tokens(tokens), arrangement, strict=True):
            assert by_doc.setdefault(i, key) == key
    # Segment keys are not chained: the same document gives the same key as on its own.
    assert keys(seg_db(), docs[0]) == [by_doc[0]]


def test_segment_hashes_are_domain_separated_from_chunk_hashes() -> None:
    tokens = list(range(CS))
    assert seg_db().chunk_hashes(tokens) != db().chunk_hashes(tokens)


def test_segment_mask_skips_segments_ending_in_the_prefix() -> None:
    tokens = [1, 2, 900, 901, 3, 4, 5, 900, 901, 6]
    all_chunks = list(seg_db().process_tokens(tokens))
    assert list(seg_db().process_tokens(tokens, mask_of(2, 10))) == all_chunks[1:]
    assert list(seg_db().process_tokens(tokens, mask_of(5, 10))) == all_chunks[1:]
    assert list(seg_db().process_tokens(tokens, mask_of(7, 10))) == all_chunks[2:]
    with pytest.raises(ValueError):
        seg_db().process_tokens(tokens, mask_of(2, 9))


def test_empty_separator_is_rejected() -> None:
    with pytest.raises(ValueError):
        SegmentTokenDatabase(NS, [])


# --- stability across processes --------------------------------------------------------

_CHILD = """
import json, torch
from kvmesh.common.keys import KeyNamespace
from kvmesh.common.tokendb import ChunkedTokenDatabase, SegmentTokenDatabase
ns = KeyNamespace(model="tiny-llama", kv_layout="LBHNC", dtype="float16",
                  world_size=2, rank=1, tenant="acme")
tokens = [(i * 7919) % 200003 + 1 for i in range(1000)]
tokens[300] = tokens[700] = 0  # segment separators
out = {
    "list": [k.to_str() for _, _, k in ChunkedTokenDatabase(ns).process_tokens(tokens)],
    "tensor": [k.to_str() for _, _, k in
               ChunkedTokenDatabase(ns).process_tokens(torch.tensor(tokens))],
    "segments": [k.to_str() for _, _, k in
                 SegmentTokenDatabase(ns, [0]).process_tokens(tokens)],
}
print(json.dumps(out))
"""


def test_keys_are_equal_across_processes_and_hash_seeds() -> None:
    results = []
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        done = subprocess.run(
            [sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stderr
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    assert results[0] == results[1]
    assert results[0]["list"] == results[0]["tensor"]
    assert len(results[0]["list"]) == 3 and len(results[0]["segments"]) == 3
    # ...and equal to what this process computes, from the very same source.
    local: dict[str, object] = {}
    exec(_CHILD.replace("print(json.dumps(out))", ""), local)
    assert local["out"] == results[0]


# --- the C helper (common/csrc/chain_hash.c) ------------------------------------------


def test_native_chain_is_built() -> None:
    # `make install` builds it against the system's libxxhash.
    assert tokendb._chain_hash is not None


def test_native_chain_uses_the_fastest_agreeing_xxh3() -> None:
    """The helper hashes with the xxhash module's XXH3_128bits (faster than the system
    library's here), gives the same chain with either, and refuses a function that
    disagrees on the probe."""
    import ctypes

    from kvmesh.common import xxh3_native

    helper = tokendb._chain_hash
    found = [ctypes.cast(f, ctypes.c_void_p).value for f in xxh3_native.symbols("XXH3_128bits")]
    assert len(found) == 2  # the module's build, then libxxhash
    module_fn, system_fn = found
    probe = bytes(range(256)) * 5
    good = xxhash.xxh3_128_digest(probe)
    database = db(chunk_size=256)
    tokens = list(range(100_000, 100_000 + 256 * 5))
    try:
        assert helper.use_xxh3_128(system_fn, probe, good)
        by_system = database.chunk_hashes(tokens)
        assert not helper.use_xxh3_128(module_fn, probe, bytes(16))  # disagrees: kept
        assert database.chunk_hashes(tokens) == by_system
        assert not helper.use_xxh3_128(0, probe, good)
        assert helper.use_xxh3_128(module_fn, probe, good)
        assert database.chunk_hashes(tokens) == by_system == expected_chain(tokens, 256, False)
    finally:
        assert tokendb._faster_xxh3(helper)  # what the import did: the module's first


def python_only(fn, *args):
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tokendb, "_chain_hash", None)
        return fn(*args)


@hyp
@given(
    st.lists(st.integers(0, MAX_TOKEN), max_size=70),
    st.sampled_from([1, 3, 16]),
    st.booleans(),
)
def test_native_chain_matches_python_for_every_input(
    tokens: list[int], size: int, unfull: bool
) -> None:
    database = db(chunk_size=size, save_unfull_chunk=unfull)
    want = python_only(database.chunk_hashes, tokens)
    assert want == expected_chain(tokens, size, unfull)
    as_int64 = torch.tensor(tokens, dtype=torch.int64)
    inputs = [tokens, tuple(tokens), as_int64, as_int64.to(torch.uint32)]
    if all(t < 2**31 for t in tokens):
        inputs.append(as_int64.to(torch.int32))
    for given_tokens in inputs:
        assert database.chunk_hashes(given_tokens) == want
        assert keys(database, given_tokens) == python_only(keys, database, given_tokens)


def test_native_chain_takes_ids_of_every_size() -> None:
    # 0, one and two 30-bit digits, and the largest id.
    tokens = [0, 1, 2**30 - 1, 2**30, 2**31, MAX_TOKEN - 1, MAX_TOKEN, 7]
    assert db().chunk_hashes(tokens) == expected_chain(tokens, CS)


@pytest.mark.parametrize(
    "bad",
    [-1, MAX_TOKEN + 1, 2**64, -(2**40)],
    ids=["negative", "too-big", "huge", "huge-negative"],
)
def test_native_chain_rejects_an_id_in_a_later_chunk(bad: int) -> None:
    tokens = list(range(4 * CS)) + [bad] + [1] * (CS - 1)
    with pytest.raises(ValueError, match="token ids must be in"):
        db().chunk_hashes(tokens)
    if -(2**63) <= bad < 2**63:
        with pytest.raises(ValueError, match="token ids must be in"):
            db().chunk_hashes(torch.tensor(tokens, dtype=torch.int64))


def test_items_that_are_not_exact_ints_take_the_python_path() -> None:
    class Index:
        def __index__(self) -> int:
            return 3

    tokens = [1, 2, True, 3, 5, Index(), 8, 9]
    assert db().chunk_hashes(tokens) == expected_chain([1, 2, 1, 3, 5, 3, 8, 9], CS)


@pytest.mark.parametrize(
    "stranger",
    [object(), None, 1.5, "7", b"\x07"],
    ids=["object", "None", "float", "str", "bytes"],
)
@pytest.mark.parametrize("where", [0, CS - 1, 5 * CS + 2])
def test_a_stranger_among_the_ids_is_refused_wherever_it_stands(
    stranger: object, where: int
) -> None:
    # The list reader reads every item of a chunk before it checks any: an object that
    # is not an int (a 16-byte object() included) must be neither read as an id nor
    # crash it; the Python path refuses it as for any input.
    tokens: list = list(range(6 * CS))
    tokens[where] = stranger
    with pytest.raises(TypeError):
        db().chunk_hashes(tokens)
    with pytest.raises(TypeError):
        python_only(db().chunk_hashes, tokens)


def test_large_lists_of_every_id_kind_agree_with_the_python_chain() -> None:
    # Chunks of 256 ids: one of small cached ints, one of ids up to 2**30, one with an
    # id of two digits, one of zeros; each must hash as the Python chain does.
    gen = torch.Generator().manual_seed(5)
    parts = [
        torch.randint(0, 256, (256,), generator=gen).tolist(),
        torch.randint(0, 2**30, (256,), generator=gen).tolist(),
        [*torch.randint(0, 152_064, (255,), generator=gen).tolist(), 2**32 - 1],
        [0] * 256,
    ]
    tokens = [t for part in parts for t in part]
    database = db(chunk_size=256)
    assert database.chunk_hashes(tokens) == python_only(database.chunk_hashes, tokens)
    assert database.chunk_hashes(tokens) == database.chunk_hashes(torch.tensor(tokens))


# A chunk_size far beyond any prompt: the helper's chunk buffer must follow the tokens
# it holds, not chunk_size (a MemoryError for 2**40; 4 * 2**62 wrapped to 0, a 16-byte
# buffer that two million tokens overran).
_HUGE_CHUNK_CHILD = """
import json, sys
from kvmesh.common import tokendb
from kvmesh.common.keys import KeyNamespace
ns = KeyNamespace(model="m", kv_layout="x", dtype="float16", world_size=1, rank=0)
database = tokendb.ChunkedTokenDatabase(ns, chunk_size=2**62, save_unfull_chunk=True)
tokens = list(range(2_000_000))
native = database.chunk_hashes(tokens)
tokendb._chain_hash = None
print(json.dumps([[h.hex() for h in native], [h.hex() for h in database.chunk_hashes(tokens)]]))
"""


@pytest.mark.parametrize("unfull", [False, True])
def test_native_chain_takes_a_chunk_size_beyond_the_tokens(unfull: bool) -> None:
    database = db(chunk_size=2**40, save_unfull_chunk=unfull)
    for tokens in ([], list(range(10)), tuple(range(1000))):
        assert database.chunk_hashes(tokens) == python_only(database.chunk_hashes, tokens)
        assert database.chunk_hashes(torch.tensor(tokens, dtype=torch.int64)) == (
            python_only(database.chunk_hashes, tokens)
        )


def test_native_chain_does_not_overrun_its_buffer_for_a_chunk_size_of_2_62() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _HUGE_CHUNK_CHILD], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    native, python = json.loads(done.stdout.strip().splitlines()[-1])
    assert native == python and len(native) == 1

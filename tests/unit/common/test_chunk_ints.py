"""Chunk ints packed for snapshots and the wire (common/chunk_holders.py pack_ints):
the C packer and the array("Q") path give the same bytes and the same errors."""

from __future__ import annotations

import random
import sys
from array import array

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.common import chunk_holders
from kvmesh.common.chunk_holders import pack_ints, unpack_ints


def by_array(ints) -> bytes:
    arr = array("Q", ints)
    if sys.byteorder != "little":
        arr.byteswap()
    return arr.tobytes()


def test_the_c_packer_is_built() -> None:
    # CI builds the package with a compiler: a missing helper is a failure, not a skip.
    assert chunk_holders.native_packer_available()


ints = st.integers(0, 2**64 - 1)


@settings(max_examples=200, deadline=None)
@given(st.lists(ints, max_size=50))
def test_every_container_packs_as_array_does(values: list[int]) -> None:
    want = by_array(values)
    assert pack_ints(values) == want
    assert pack_ints(tuple(values)) == want
    unique = list(dict.fromkeys(values))
    as_set = set(unique)
    # A set packs in its own iteration order, as array() would read it.
    assert pack_ints(as_set) == by_array(as_set)
    assert pack_ints(frozenset(as_set)) == by_array(frozenset(as_set))
    assert sorted(unpack_ints(pack_ints(as_set))) == sorted(as_set)


def test_ints_of_every_size_and_a_million_chunk_set() -> None:
    edge = [0, 1, 2**30 - 1, 2**30, 2**60 - 1, 2**60, 2**63, 2**64 - 1]
    assert pack_ints(edge) == by_array(edge)
    rng = random.Random(7)
    big = {rng.getrandbits(60) for _ in range(1_000_000)}
    assert pack_ints(big) == by_array(big)


class Sub(int):
    pass


@pytest.mark.parametrize(
    "bad",
    [[-1], [2**64], [1.5], ["7"], [None], [1, 2, object()]],
    ids=["negative", "too-big", "float", "str", "None", "object"],
)
@pytest.mark.parametrize("container", [list, tuple, set])
def test_bad_items_raise_what_array_raises(bad: list, container) -> None:
    items = container(bad)
    with pytest.raises(Exception) as want:
        array("Q", items)
    with pytest.raises(want.type):
        pack_ints(items)


def test_int_subclasses_bools_and_other_iterables() -> None:
    values = [Sub(5), True, 2**40]
    assert pack_ints(values) == by_array([5, 1, 2**40])
    # Anything but a list, tuple or set goes through array().
    assert pack_ints(iter([3, 4])) == by_array([3, 4])
    assert pack_ints({9: "x"}.keys()) == by_array([9])
    assert pack_ints(range(3)) == by_array([0, 1, 2])


# -- chunk key strings folded to chunk ints ------------------------------------------------
NS = "0123456789abcdef"


def by_int_parse(key: str) -> int:
    """The fold by its definition: low 64 bits of the hash ^ namespace, 60 bits kept."""
    return ((int(key[17:], 16) & (2**64 - 1)) ^ int(key[:16], 16)) & (2**60 - 1)


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 2**64 - 1), st.integers(0, 2**128 - 1))
def test_the_c_fold_and_the_python_fold_agree_with_the_definition(ns: int, h: int) -> None:
    key = f"{ns:016x}-{h:032x}"
    want = by_int_parse(key)
    assert chunk_holders.chunk_int(key) == chunk_holders.chunk_int_py(key) == want
    assert chunk_holders.chunk_ints([key, key]) == chunk_holders.chunk_ints_py([key, key])


GOOD = f"{NS}-{'0f' * 16}"
NOT_KEYS = [
    GOOD.upper(),  # only the canonical lower case
    GOOD[:-1],
    GOOD + "0",
    GOOD.replace("-", "0"),
    "g" + GOOD[1:],  # a bad digit in the namespace,
    GOOD[:20] + "x" + GOOD[21:],  # in the hash's high half (int() of the low half
    GOOD[:-1] + "g",  # alone would never see it), in its low half
    GOOD[:40] + "_" + GOOD[41:],  # int() would take these three
    GOOD[:33] + " " + GOOD[34:],
    GOOD[:33] + "+" + GOOD[34:],
    GOOD[:-1] + "é",  # one byte a character, not ASCII
    GOOD[:-1] + "€",
    GOOD.encode(),
    None,
    123,
]


@pytest.mark.parametrize("fold", [chunk_holders.chunk_int, chunk_holders.chunk_int_py])
@pytest.mark.parametrize("bad", NOT_KEYS, ids=range(len(NOT_KEYS)))
def test_what_is_not_a_chunk_key_string_is_refused_by_both(fold, bad) -> None:
    with pytest.raises(ValueError, match="not a chunk key"):
        fold(bad)


@pytest.mark.parametrize("fold", [chunk_holders.chunk_ints, chunk_holders.chunk_ints_py])
def test_a_list_folds_its_keys_and_counts_the_rest(fold) -> None:
    keys = [f"{NS}-{i:032x}" for i in range(1000)]
    mixed = [*keys[:500], *NOT_KEYS, *keys[500:]]
    ints, bad = fold(mixed)
    assert ints == [by_int_parse(k) for k in keys] and bad == len(NOT_KEYS)
    assert fold([]) == ([], 0)

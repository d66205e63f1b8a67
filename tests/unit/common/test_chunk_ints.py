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

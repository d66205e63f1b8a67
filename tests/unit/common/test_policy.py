"""kvmesh.common.policy: victim order per policy, skipping, LFU counts, the factory."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvmesh.common.policy import (
    POLICY_NAMES,
    EvictionPolicy,
    FIFOPolicy,
    LFUPolicy,
    LRUPolicy,
    MRUPolicy,
    make_policy,
)


def always(_key: object) -> bool:
    return True


def scripted(policy: EvictionPolicy) -> EvictionPolicy:
    """Insert a..e, then hit c, a, c, e (a key re-inserted counts as an access)."""
    for k in "abcde":
        policy.on_insert(k)
    for k in "cac":
        policy.on_access(k)
    policy.on_insert("e")
    return policy


@pytest.mark.parametrize(
    ("name", "order"),
    [
        ("lru", list("bdace")),  # least recent first: b, d untouched; then a, c, e
        ("mru", list("ecadb")),
        ("fifo", list("abcde")),  # accesses and the re-insert change nothing
        ("lfu", list("bdaec")),  # counts b1 d1 a2 e2 c3; ties by least recent
    ],
)
def test_victim_order_on_a_scripted_sequence(name: str, order: list[str]) -> None:
    policy = scripted(make_policy(name))
    assert policy.name == name
    assert len(policy) == 5 and "a" in policy and "z" not in policy
    assert policy.victims(5, always) == order
    assert list(policy) == order
    assert policy.victims(2, always) == order[:2]
    assert policy.victims(99, always) == order
    assert policy.victims(0, always) == []


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_pinned_keys_are_skipped_not_counted(name: str) -> None:
    policy = scripted(make_policy(name))
    order = policy.victims(5, always)
    pinned = {order[0], order[2]}
    got = policy.victims(2, lambda k: k not in pinned)
    assert got == [order[1], order[3]]
    assert policy.victims(5, lambda k: False) == []
    assert len(policy) == 5  # victims only proposes


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_remove_takes_the_key_out_and_unknown_keys_raise(name: str) -> None:
    policy = scripted(make_policy(name))
    first = policy.victims(1, always)[0]
    policy.on_remove(first)
    assert first not in policy and len(policy) == 4
    assert first not in policy.victims(5, always)
    with pytest.raises(KeyError):
        policy.on_remove(first)
    with pytest.raises(KeyError):
        policy.on_access("never-inserted")
    for k in list(policy):
        policy.on_remove(k)
    assert len(policy) == 0 and policy.victims(3, always) == []
    policy.on_insert(first)  # usable again after emptying
    assert policy.victims(1, always) == [first]


def test_lfu_counts_and_ties_break_by_least_recent() -> None:
    lfu = LFUPolicy()
    for k in "xyz":
        lfu.on_insert(k)
    lfu.on_access("x")
    lfu.on_access("y")  # x and y both at 2; x reached it first
    assert [lfu.frequency(k) for k in "xyz"] == [2, 2, 1]
    assert lfu.victims(3, always) == ["z", "x", "y"]
    lfu.on_access("x")
    lfu.on_access("z")
    lfu.on_access("z")  # z: 3, after x: 3
    assert lfu.victims(3, always) == ["y", "x", "z"]
    lfu.on_remove("y")
    lfu.on_insert("w")  # a newcomer starts at 1 and goes first
    assert lfu.victims(3, always) == ["w", "x", "z"]
    assert lfu.frequency("z") == 3
    with pytest.raises(KeyError):
        lfu.frequency("y")


def test_lfu_buckets_relink_when_the_middle_empties() -> None:
    lfu = LFUPolicy()
    for k in "abc":
        lfu.on_insert(k)
    lfu.on_access("b")  # a1 c1 b2
    lfu.on_access("c")
    lfu.on_access("c")  # a1 b2 c3
    lfu.on_access("b")  # bucket 2 empties: a1 b3 c3, b reached 3 after c
    assert lfu.victims(3, always) == ["a", "c", "b"]
    lfu.on_remove("a")  # the head bucket empties
    assert lfu.victims(3, always) == ["c", "b"]


OPS = st.sampled_from(["ins", "acc", "rm", "res"])


@given(st.lists(st.tuples(OPS, st.integers(0, 9)), max_size=80))
def test_lfu_matches_a_brute_force_model(ops: list[tuple[str, int]]) -> None:
    lfu = LFUPolicy()
    count: dict[int, int] = {}
    last: dict[int, int] = {}
    for t, (op, k) in enumerate(ops):
        if op == "res":
            lfu.on_restore(k)
            if k not in count:  # restored keys: used 0 times, in order of restoring
                count[k], last[k] = 0, t
        elif op == "ins" or (op == "acc" and k in count):
            (lfu.on_insert if op == "ins" else lfu.on_access)(k)
            count[k] = count.get(k, 0) + 1
            last[k] = t
        elif op == "rm" and k in count:
            lfu.on_remove(k)
            del count[k], last[k]
    expected = sorted(count, key=lambda k: (count[k], last[k]))
    assert lfu.victims(len(expected), always) == expected
    assert len(lfu) == len(expected)


def test_classes_and_factory() -> None:
    assert type(make_policy("lru")) is LRUPolicy
    assert type(make_policy("LFU")) is LFUPolicy
    assert type(make_policy("fifo")) is FIFOPolicy
    assert type(make_policy("mru")) is MRUPolicy
    assert make_policy("lru") is not make_policy("lru")  # fresh each time


@pytest.mark.parametrize("bad", ["", "arc", "lru ", "random"])
def test_factory_rejects_unknown_names_listing_the_valid_ones(bad: str) -> None:
    with pytest.raises(ValueError, match="fifo, lfu, lru, mru") as info:
        make_policy(bad)
    assert repr(bad) in str(info.value)


def test_keys_can_be_any_hashable() -> None:
    policy = make_policy("lru")
    keys = [("ns", b"\x00" * 16), 42, frozenset({1}), None]
    for k in keys:
        policy.on_insert(k)
    policy.on_access(42)
    assert policy.victims(4, always) == [keys[0], keys[2], None, 42]


@pytest.mark.parametrize(
    ("name", "before", "after"),
    [
        # r1, r2 restored (oldest first), then the scripted run, then r2 used once.
        ("lru", "r1 r2 b d a c e", "r1 b d a c e r2"),
        ("mru", "e c a d b r2 r1", "r2 e c a d b r1"),  # the oldest go last
        ("fifo", "r1 r2 a b c d e", "r1 r2 a b c d e"),  # arrival order only
        ("lfu", "r1 r2 b d a e c", "r1 b d r2 a e c"),  # r2: from 0 uses to 1
    ],
)
def test_restored_keys_go_before_this_runs_until_used(name: str, before: str, after: str) -> None:
    policy = make_policy(name)
    policy.on_restore("r1")
    policy.on_restore("r2")
    scripted(policy)
    policy.on_restore("a")  # present: left where it is
    assert len(policy) == 7 and "r1" in policy and "r2" in policy
    assert list(policy) == before.split()
    policy.on_access("r2")
    assert list(policy) == after.split()
    assert policy.victims(2, lambda k: k != "r1") == [k for k in after.split() if k != "r1"][:2]
    policy.on_remove("r1")
    policy.on_remove("r2")
    assert len(policy) == 5 and "r1" not in policy
    with pytest.raises(KeyError):
        policy.on_remove("r1")
    with pytest.raises(KeyError):
        policy.on_access("r1")


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_a_restored_key_stored_again_counts_as_this_runs(name: str) -> None:
    policy = make_policy(name)
    policy.on_restore("old")
    policy.on_insert("new")
    policy.on_insert("old")  # written anew this run
    policy.on_restore("new")  # stored this run: stays among this run's keys
    assert len(policy) == 2
    # FIFO keeps a key's first arrival, which for a restored key was before this run.
    expected = {"lru": "new old", "mru": "old new", "fifo": "old new", "lfu": "new old"}
    assert list(policy) == expected[name].split()

"""Eviction policies against a brute-force model of their definitions (common/policy.py):
random sequences of stores, restores, hits, removals and victim requests with pinned
keys, for every policy."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.common.policy import POLICY_NAMES, make_policy


@dataclass
class _Seen:
    first: int  # when it arrived (stored, or restored)
    last: int  # its last use (a store counts as one)
    uses: int  # stores + hits this run (0 for a restored key never used)
    restored: bool  # found rather than stored, and (except FIFO) not used since


class Model:
    """Each policy's order, computed from scratch from what happened to every key."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.keys: dict[int, _Seen] = {}
        self.t = 0

    def _tick(self) -> int:
        self.t += 1
        return self.t

    def insert(self, k: int) -> None:
        t = self._tick()
        seen = self.keys.get(k)
        if seen is None:
            self.keys[k] = _Seen(t, t, 1, False)
            return
        seen.last, seen.uses = t, seen.uses + 1
        if self.name != "fifo":  # FIFO keeps a restored key's place (its first arrival)
            seen.restored = False

    def restore(self, k: int) -> None:
        t = self._tick()
        if k not in self.keys:
            self.keys[k] = _Seen(t, t, 0, True)

    def access(self, k: int) -> None:
        self.insert(k)  # the same, for a present key

    def remove(self, k: int) -> None:
        del self.keys[k]

    def order(self) -> list[int]:
        ks = self.keys
        old = sorted((k for k in ks if ks[k].restored), key=lambda k: ks[k].first)
        new = [k for k in ks if not ks[k].restored]
        if self.name == "lru":
            return old + sorted(new, key=lambda k: ks[k].last)
        if self.name == "mru":
            return sorted(new, key=lambda k: -ks[k].last) + old[::-1]
        if self.name == "fifo":
            return old + sorted(new, key=lambda k: ks[k].first)
        return sorted(ks, key=lambda k: (ks[k].uses, ks[k].last))  # lfu


OPS = st.lists(
    st.tuples(
        st.sampled_from(["ins", "ins", "acc", "rm", "res", "victims", "pin", "unpin"]),
        st.integers(0, 11),
    ),
    max_size=120,
)


@pytest.mark.parametrize("name", POLICY_NAMES)
@settings(max_examples=300, deadline=None)
@given(ops=OPS)
def test_every_policy_matches_its_definition_with_pins(name: str, ops) -> None:
    policy = make_policy(name)
    model = Model(name)
    pinned: set[int] = set()
    for op, k in ops:
        present = k in model.keys
        if op == "ins":
            policy.on_insert(k)
            model.insert(k)
        elif op == "res":
            policy.on_restore(k)
            model.restore(k)
        elif op == "acc" and present:
            policy.on_access(k)
            model.access(k)
        elif op == "rm" and present:
            policy.on_remove(k)
            model.remove(k)
            pinned.discard(k)
        elif op == "pin":
            pinned.add(k)
        elif op == "unpin":
            pinned.discard(k)
        elif op == "victims":
            n = k % 5
            asked: list[int] = []

            def can_evict(key: int, asked: list[int] = asked) -> bool:
                asked.append(key)
                return key not in pinned

            want = [x for x in model.order() if x not in pinned][:n]
            assert policy.victims(n, can_evict) == want
            assert len(asked) == len(set(asked))  # no key proposed twice
            # The tier evicts what it was offered, reporting each removal.
            for v in want:
                policy.on_remove(v)
                model.remove(v)
        assert len(policy) == len(model.keys)
    assert list(policy) == model.order()
    assert policy.victims(len(model.keys), lambda _k: False) == []
    for k in range(12):
        assert (k in policy) == (k in model.keys)


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_unknown_keys_raise_and_leave_the_policy_as_it_was(name: str) -> None:
    policy = make_policy(name)
    for k in "abc":
        policy.on_insert(k)
    before = list(policy)
    for call in (policy.on_access, policy.on_remove):
        with pytest.raises(KeyError):
            call("zz")
    assert list(policy) == before and len(policy) == 3

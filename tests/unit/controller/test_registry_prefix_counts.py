"""Registry.prefix_counts: per instance, the leading chunks every rank holds (any tier
and L1), ranked; a rank not registered holds nothing."""

from __future__ import annotations

from kvmesh.services.controller.registry import Registry

NS = ["0123456789abcdef", "fedcba9876543210"]  # rank 0's and rank 1's namespaces


def h(i: int) -> bytes:
    return bytes([i]) * 16


def key(ns: str, i: int) -> str:
    return f"{ns}-{h(i).hex()}"


def test_prefix_counts_take_the_minimum_over_ranks_and_rank_instances() -> None:
    reg = Registry()
    a0 = reg.register("a", 0, 2, [NS[0]], "", 1.0, None)
    a1 = reg.register("a", 1, 2, [NS[1]], "", 1.0, None)
    b0 = reg.register("b", 0, 1, [NS[0]], "", 1.0, None)
    c0 = reg.register("c", 0, 2, [NS[0]], "", 1.0, None)  # rank 1 never registers
    reg.apply(a0, [(1, key(NS[0], i), "l1") for i in range(4)])
    reg.apply(a1, [(1, key(NS[1], i), "l1") for i in range(2)])
    reg.apply(a1, [(1, key(NS[1], i), "disk") for i in range(2, 4)])
    reg.apply(b0, [(1, key(NS[0], i), "disk") for i in (0, 1, 2)])
    reg.apply(c0, [(1, key(NS[0], i), "l1") for i in range(4)])
    hashes = [h(i) for i in range(4)]
    got = reg.prefix_counts(hashes)
    assert got == [("a", 2, 2, 4, 2), ("b", 1, 1, 3, 0), ("c", 2, 1, 0, 0)]
    assert reg.prefix_counts(hashes, "b") == [("b", 1, 1, 3, 0)]
    # A gap stops the run; an evicted chunk no longer counts.
    assert reg.prefix_counts([h(0), h(9), h(1)], "b") == [("b", 1, 1, 1, 0)]
    reg.apply(b0, [(2, key(NS[0], 1), "disk")])
    assert reg.prefix_counts(hashes, "b") == [("b", 1, 1, 1, 0)]
    # Another namespace's chunks (another model) are not the prompt's.
    assert reg.prefix_counts(hashes, "nobody") == []
    reg.drop("a/1")
    assert reg.prefix_counts(hashes, "a") == [("a", 2, 1, 0, 0)]

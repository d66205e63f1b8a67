"""How a PD push splits its last write into groups (each committed on its own)."""

from __future__ import annotations

from types import SimpleNamespace

from kvmesh.services.worker.pd_sender import GROUP_BYTES, GROUPS, _groups


def pieces(n: int, nbytes: int) -> list:
    return [(i, SimpleNamespace(nbytes=nbytes), 0) for i in range(n)]


def test_small_pushes_go_whole_and_big_ones_in_at_most_groups_groups() -> None:
    assert _groups([]) == []
    assert len(_groups(pieces(16, 1 << 20))) == 1  # 16 MiB: one group
    assert [len(g) for g in _groups(pieces(16, 4 << 20))] == [4, 4, 4, 4]  # 64 MiB
    big = _groups(pieces(20, 32 << 20))
    assert len(big) == GROUPS and sum(len(g) for g in big) == 20
    one = _groups(pieces(1, 4 * GROUP_BYTES))
    assert [len(g) for g in one] == [1]
    # Order is kept: the decoder commits the chunks it was told, in the order sent.
    assert [i for g in big for i, _, _ in g] == list(range(20))

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


async def test_chunks_are_hashed_group_by_group_before_their_commit() -> None:
    import asyncio

    import torch

    from kvmesh.common.chunk_codec import chunk_bytes, payload_checksum
    from kvmesh.common.memory import HostMemoryPool, MemoryFormat
    from kvmesh.services.worker.pd_sender import _hash_groups

    with HostMemoryPool(1 << 20, 64 * 1024, pin_memory=False) as pool:
        objs = [pool.allocate((64 * 1024,), torch.uint8, MemoryFormat.BINARY) for _ in range(6)]
        for i, o in enumerate(objs):
            o.tensor.fill_(i + 1)
        objs[4].checksum = 12345  # a chunk that came with its sum keeps it
        groups = [[(i, o, 0) for i, o in enumerate(objs[a:b], a)] for a, b in ((0, 2), (2, 6))]
        loop = asyncio.get_running_loop()
        sums = [loop.create_future() for _ in groups]
        await _hash_groups(groups, sums)
        assert all(f.done() and f.exception() is None for f in sums)
        for i, o in enumerate(objs):
            want = 12345 if i == 4 else payload_checksum(chunk_bytes(o))
            assert o.checksum == want

        # A chunk that cannot be hashed fails every commit still waiting (a recompute),
        # rather than leaving them to the deadline.
        bad = [[(0, object(), 0)]]
        sums = [loop.create_future()]
        await _hash_groups(bad, sums)
        assert "hashing the chunks failed" in str(sums[0].exception())

        # A cancelled push cancels the waits too.
        for o in objs:
            o.checksum = None
        sums = [loop.create_future() for _ in groups]
        task = asyncio.create_task(_hash_groups(groups, sums))
        await asyncio.sleep(0)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert all(f.done() for f in sums)
        assert sums[-1].cancelled()
        for o in objs:
            o.ref_down()

"""MLA: the latent KV is the same on every tensor-parallel rank, so only rank 0
stores it and, on retrieve, rank 0 loads it and broadcasts it to the other ranks
(torch.distributed; gloo on CPU)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from kvmesh.common.keys import ChunkKey
    from kvmesh.services.worker.engine import KVEngine


# Chunk bytes in flight at once per retrieve (at least one chunk).
WINDOW_BYTES = 256 << 20


class MLABroadcast:
    """Retrieve for an MLA model across the ranks of one process group."""

    def __init__(self, group: object | None, rank: int) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("MLA with world_size > 1 needs torch.distributed initialised")
        self._group = group
        self._rank = rank
        self._src = dist.get_global_rank(group, 0) if group is not None else 0

    def retrieve(
        self,
        engine: KVEngine,
        chunks: list[tuple[int, int, ChunkKey]],
        slot_mapping: torch.Tensor,
        loaded: torch.Tensor,
    ) -> None:
        # Every rank calls this with the same tokens; all take part in each broadcast.
        objs = []
        if self._rank == 0:
            found, _sources = engine.storage.get_prefix([k for _, _, k in chunks])
            for (start, end, _), obj in zip(chunks, found, strict=False):
                if not engine._fits(obj, end - start):
                    break
                objs.append(obj)
            for obj in found[len(objs) :]:
                obj.ref_down()
        count = torch.tensor([len(objs)], dtype=torch.int64)
        dist.broadcast(count, src=self._src, group=self._group)
        n = int(count.item())
        try:
            first = 0
            while first < n:
                # A window of chunks at a time: their broadcasts all in flight, then one
                # copier call for the window. Other ranks hold one window of buffers,
                # not the whole prompt's KV.
                last, size = first, 0
                while last < n and (last == first or size < WINDOW_BYTES):
                    start, end, _ = chunks[last]
                    size += engine.layout.chunk_nbytes(end - start)
                    last += 1
                spans = [(start, end) for start, end, _ in chunks[first:last]]
                if self._rank == 0:
                    bufs = [obj.tensor for obj in objs[first:last]]
                else:
                    bufs = [
                        torch.empty(
                            engine.layout.chunk_shape(end - start), dtype=engine.layout.dtype
                        )
                        for start, end in spans
                    ]
                works = [
                    dist.broadcast(buf, src=self._src, group=self._group, async_op=True)
                    for buf in bufs
                ]
                for work in works:
                    work.wait()
                engine.copier.scatter_chunks(slot_mapping, spans, bufs)
                for start, end in spans:
                    loaded[start:end] = True
                    engine.stats.record_hit("l1", end - start)
                first = last
        finally:
            for obj in objs:
                obj.ref_down()

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
        try:
            for i in range(int(count.item())):
                start, end, _ = chunks[i]
                if self._rank == 0:
                    buf = objs[i].tensor
                else:
                    buf = torch.empty(
                        engine.layout.chunk_shape(end - start), dtype=engine.layout.dtype
                    )
                dist.broadcast(buf, src=self._src, group=self._group)
                engine.copier.scatter(slot_mapping[start:end], buf)
                loaded[start:end] = True
                engine.stats.record_hit("l1", end - start)
        finally:
            for obj in objs:
                obj.ref_down()

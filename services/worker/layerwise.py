"""Layer-by-layer store and retrieve, as generators the inference engine steps.

Each step moves one layer, so the copy (and, on a GPU, the transfer behind it) of
layer i overlaps the attention compute of the next layer. Chunks are committed to
the tiers only after every layer is in place: a half-written chunk is never visible.
"""

from __future__ import annotations

import time
from collections.abc import Generator, Sequence
from typing import TYPE_CHECKING

import torch

from kvmesh.common.memory import MemoryObj, MemoryObjFreedError
from kvmesh.common.observability import get_logger

if TYPE_CHECKING:
    from kvmesh.common.keys import ChunkKey
    from kvmesh.services.worker.engine import Chunk, KVEngine

log = get_logger(__name__)


def store_layers(
    engine: KVEngine,
    tokens: Sequence[int] | torch.Tensor,
    slot_mapping: torch.Tensor,
    mask: torch.Tensor | None,
    tenant: str = "",
) -> Generator[int, None, int]:
    # Allocating takes pages of the pool: close() waits for it as for a store. The
    # copies of the later steps go into the tensor views taken here.
    engine._enter()
    pending: list[tuple[int, int, ChunkKey, MemoryObj]] = []
    try:
        engine.stats.requests["store"].inc()
        engine.stats.tokens_requested["store"].inc(len(tokens))
        t0 = time.perf_counter()
        if engine._stores_here():
            chunks = engine.chunks(tokens, mask, tenant)
            held = engine.storage.l1.held([key for _, _, key in chunks])
            todo = [chunk for chunk, h in zip(chunks, held, strict=True) if not h]
            objs = engine._allocate_run(chunks, held, todo)
            if objs is not None:
                pending = [
                    (start, end, key, obj)
                    for (start, end, key), obj in zip(todo, objs, strict=True)
                ]
            else:
                # Too little can be freed now: a page at a time, evicting but never waiting.
                # The pages this store holds come back only when it commits, so a wait would
                # stall the forward pass for alloc_timeout_s on pages it holds itself.
                l1, dtype, fmt = engine.storage.l1, engine.layout.dtype, engine.chunk_format
                for start, end, key in todo:
                    obj = l1.try_allocate(engine._chunk_shape(end - start), dtype, fmt)
                    if obj is None:
                        engine.stats.alloc_failures.inc()
                        log.warning(
                            "layerwise store truncated: no free or evictable page",
                            chunks=len(pending),
                            of=len(todo),
                        )
                        break
                    pending.append((start, end, key, obj))
        else:
            engine.stats.stores_skipped.inc()
        spans = [(start, end) for start, end, _, _ in pending]
        outs = [obj.tensor for *_, obj in pending]
    except BaseException:
        _drop(engine, [obj for *_, obj in pending])
        raise
    finally:
        engine._exit()
    committed = False
    try:
        num_layers = engine.layout.num_layers
        for layer in range(num_layers):
            if pending:  # one copier call a layer for every chunk
                engine.copier.gather_chunks(slot_mapping, spans, outs, layer)
            if layer < num_layers - 1:
                yield layer
        stored = 0
        try:
            engine._enter()  # close() waits for a commit under way
        except RuntimeError:
            # Closed between two layers: its tiers are gone, so nothing is stored.
            _drop(engine, [obj for *_, obj in pending])
            pending = []
        else:
            try:
                for start, end, key, obj in pending:
                    obj.key = key
                    if engine.storage.put(key, obj):
                        stored += end - start
                        engine.stats.chunks_stored.inc()
            finally:
                engine._exit()
        committed = True
        engine._account_store(stored, t0)
        return stored
    finally:
        if not committed:  # abandoned part way: the buffers go back to the pool
            _drop(engine, [obj for *_, obj in pending])


def retrieve_layers(
    engine: KVEngine,
    tokens: Sequence[int] | torch.Tensor,
    slot_mapping: torch.Tensor,
    mask: torch.Tensor | None,
    lookup_id: str | None,
    tenant: str = "",
) -> Generator[torch.Tensor, None, torch.Tensor]:
    engine._check_open()
    t0 = time.perf_counter()
    engine.stats.requests["retrieve"].inc()
    engine.stats.tokens_requested["retrieve"].inc(len(tokens))
    loaded = torch.zeros(len(tokens), dtype=torch.bool)
    chunks = engine.chunks(tokens, mask, tenant)
    if engine._mla is not None:
        # MLA across ranks: only rank 0 holds the KV, so the whole load is broadcast
        # at the first layer, and the other layers' steps have nothing left to do.
        return (yield from _retrieve_mla(engine, chunks, slot_mapping, loaded, lookup_id, t0))
    objs: list[MemoryObj] = []
    # This step reads L1's pages: close() waits for it as for a retrieve. The later
    # steps copy from the tensor views taken here, which outlive a close.
    engine._enter()
    try:
        # Once close() began, the lower tiers are a miss (get_prefix).
        objs, sources = engine.storage.get_prefix([k for _, _, k in chunks])
        usable = []
        for (start, end, _), obj, source in zip(chunks, objs, sources, strict=False):
            if not engine._fits(obj, end - start):
                engine.stats.load_errors.inc()
                break
            usable.append((start, end, obj, source))
        spans = [(start, end) for start, end, _, _ in usable]
        srcs = [obj.tensor for _, _, obj, _ in usable]
    except BaseException:
        _drop(engine, objs)
        raise
    finally:
        engine._exit()
    for start, end, _obj, _src in usable:
        loaded[start:end] = True
    try:
        num_layers = engine.layout.num_layers
        for layer in range(num_layers):
            if usable:
                engine.copier.scatter_chunks(slot_mapping, spans, srcs, layer)
            if layer < num_layers - 1:
                yield loaded
        for start, end, _obj, source in usable:
            engine.stats.record_hit(source, end - start)
        return loaded
    finally:
        _drop(engine, objs)
        if lookup_id is not None:
            engine.release_lookup(lookup_id)
        engine.stats.latency["retrieve"].observe(time.perf_counter() - t0)


def _drop(engine: KVEngine, objs: Sequence[MemoryObj]) -> None:
    """Drop a generator's references. The engine may have closed between two layers
    (the inference engine steps it across a shutdown): its pool freed them, and the
    layers copied since came from the tensor views taken before, which keep their
    memory. Raising there failed a request that had been served."""
    for obj in objs:
        try:
            obj.ref_down()
        except MemoryObjFreedError:
            if not engine.pool.closed:
                raise  # freed while the pool lives: a reference miscounted somewhere


def _retrieve_mla(
    engine: KVEngine,
    chunks: list[Chunk],
    slot_mapping: torch.Tensor,
    loaded: torch.Tensor,
    lookup_id: str | None,
    t0: float,
) -> Generator[torch.Tensor, None, torch.Tensor]:
    assert engine._mla is not None
    try:
        # Rank 0 reads L1's pages and copies them out here: close() waits for it as
        # for a retrieve (the pool was freed under it, raising part way through the
        # broadcasts, with the other ranks left waiting in theirs).
        engine._enter()
        try:
            engine._mla.retrieve(engine, chunks, slot_mapping, loaded)
        finally:
            engine._exit()
        for _layer in range(engine.layout.num_layers - 1):
            yield loaded
        return loaded
    finally:
        if lookup_id is not None:
            engine.release_lookup(lookup_id)
        engine.stats.latency["retrieve"].observe(time.perf_counter() - t0)

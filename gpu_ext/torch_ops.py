"""Paged KV ⇄ contiguous chunk copies on the host: the CPU path, and the fallback.

Tokens move in one of three ways, chosen per call:

* the C helper (native_copy, gpu_ext/csrc/block_copy.c), when it was built and the
  cache is in host memory: it checks the slot range, takes the leading slots that run
  through whole blocks in order (slot = block * block_size + offset, offsets
  0..block_size-1, as vLLM maps them) and memcpys each block's contiguous runs, in
  parallel, with the GIL released. Whatever is left (a chunk that ends inside a block,
  or a mapping that is not whole blocks) goes by rows, below.
* whole blocks in torch (gather only, without the helper): the chunk's tokens are
  viewed as ``[blocks, block_size, kv, heads, head_dim]``, the canonical layer's shape,
  and each layer is one ``index_select(out=...)`` over the block dimension, both sides
  viewed as the widest integer type their strides allow (int64 for any fp16 head_dim
  that is a multiple of 4), so that blocks are spread over threads rather than each
  block split among them (measured 0.5x of copy_ as fp16, 0.8x as int64).
* rows (see layout.PagedKVViews): runs of elements contiguous in the cache and in the
  chunk. A layer's K (or V) half of the chunk is ``[tokens * rows_per_token, row_len]``
  contiguous, and the row indices come from the slot mapping once per call.
  Gather is one ``index_select(out=...)`` per layer and K/V, straight into the chunk (its
  contiguous fast path memcpys each row, in parallel). Scatter is one ``index_put_`` per
  layer (K and V together), straight into the cache's row view; that kernel moves one
  element at a time, so both sides are reinterpreted as the widest type the row length
  and alignment allow (16 bytes for any fp16 head_dim that is a multiple of 8).

Without the helper, scatter always goes by rows: torch has no CPU kernel that copies
whole slices to indexed destinations (``index_copy_``/``index_put_`` at block granularity
move one element at a time; one ``copy_`` per (layer, block) pays a new iterator per
call), which held a retrieve to ~0.6 of copy_ on the Llama-3-8B layout
(benchmarks/engine.py); the helper reaches copy_ or more.

The slot mapping is checked (range) before any index is built: the row views alias
memory outside the blocks a bad slot would name, so indexing alone would not catch it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvmesh.gpu_ext import native_copy
from kvmesh.gpu_ext.layout import KVKind, PagedKVViews, widest_view, widest_width


@dataclass(frozen=True)
class CopyCall:
    """A validated gather/scatter request, shared by the torch and Triton backends."""

    slots: torch.Tensor  # int64, on the cache's device
    chunk: torch.Tensor  # the caller's buffer, as given
    layers: range  # cache layers this call moves
    layer_buffer: bool  # chunk holds one layer (layer_chunk_shape), not all of them
    start: int
    end: int


def check_call(
    views: PagedKVViews,
    slot_mapping: torch.Tensor,
    chunk: torch.Tensor,
    layer: int | None,
    start: int,
    end: int | None,
    *,
    check_slots: bool = True,
) -> CopyCall:
    """Validate shapes, dtype, device, the token range and (optionally) the slots."""
    lay = views.layout
    if slot_mapping.dim() != 1:
        raise ValueError(f"slot_mapping must be 1-D, got shape {tuple(slot_mapping.shape)}")
    if slot_mapping.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"slot_mapping must be int64 or int32, got {slot_mapping.dtype}")
    slots = slot_mapping.to(device=lay.device, dtype=torch.int64)
    n = slots.numel()
    end = start + n if end is None else end
    if not 0 <= start <= end or end - start != n:
        raise ValueError(f"token range [{start}, {end}) does not hold {n} slots")
    tokens = chunk.shape[-2] if chunk.dim() >= 2 else 0
    # With a layer, the buffer is that layer's own or a whole chunk; the rank tells.
    layer_buffer = layer is not None and chunk.dim() == len(lay.layer_chunk_shape(0))
    if layer is None:
        layers = range(lay.num_layers)
    elif 0 <= layer < lay.num_layers:
        layers = range(layer, layer + 1)
    else:
        raise ValueError(f"layer {layer} out of range for {lay.num_layers} layers")
    want = lay.layer_chunk_shape(tokens) if layer_buffer else lay.chunk_shape(tokens)
    if tuple(chunk.shape) != want or end > tokens:
        what = "layer buffer" if layer_buffer else "chunk"
        raise ValueError(
            f"{what} shape {tuple(chunk.shape)} is not {want} or cannot hold tokens "
            f"[{start}, {end})"
        )
    if chunk.dtype != lay.dtype or chunk.device != lay.device:
        raise ValueError(
            f"{chunk.dtype}/{chunk.device} buffer for a {lay.dtype}/{lay.device} KV cache"
        )
    if chunk.stride(-1) != 1 or (chunk.shape[-2] > 1 and chunk.stride(-2) != chunk.shape[-1]):
        raise ValueError(
            f"each K/V half of the buffer must be contiguous, strides {chunk.stride()}"
        )
    if check_slots:
        check_slot_range(views, slots)
    return CopyCall(slots, chunk, layers, layer_buffer, start, end)


def check_slot_range(views: PagedKVViews, slots: torch.Tensor) -> None:
    """ValueError unless every slot lies in the cache."""
    if slots.numel():
        low, high = (int(v) for v in torch.aminmax(slots))
        if low < 0 or high >= views.layout.num_slots:
            raise ValueError(
                f"slot_mapping holds {low}..{high}, outside [0, {views.layout.num_slots})"
            )


def chunk_rows(views: PagedKVViews, call: CopyCall, start: int | None = None) -> torch.Tensor:
    """The chunk region a call moves (from token ``start``, by default the call's own) as
    ``[kv, layers, tokens * rows_per_token, row_len]``.

    A view: writing to it writes the caller's buffer.
    """
    buf = _chunk_layers(views, call)
    buf = buf[:, :, call.start if start is None else start : call.end]
    return buf.view(*buf.shape[:2], -1, views.row_len)


def whole_blocks(views: PagedKVViews, slots: torch.Tensor) -> torch.Tensor | None:
    """Block ids for the leading ``len(slots) // block_size`` blocks' worth of tokens,
    when each group of ``block_size`` slots is one block's slots in order (slot = block *
    block_size + offset, offset 0, 1, ...); otherwise (or with no full group) None.

    The caller has checked that every slot is in range.
    """
    bs = views.layout.block_size
    count = slots.numel() // bs
    if not count:
        return None
    if bs == 1:
        return slots
    head = (slots if count * bs == slots.numel() else slots[: count * bs]).view(count, bs)
    blocks = head[:, 0].div(bs, rounding_mode="floor")
    # One comparison checks both that each group starts a block and that it runs in order.
    if not torch.equal(head, torch.add(views.block_offsets, blocks.view(count, 1), alpha=bs)):
        return None
    return blocks


def gather_to_chunk(
    views: PagedKVViews,
    slot_mapping: torch.Tensor,
    out_chunk: torch.Tensor,
    layer: int | None = None,
    *,
    start: int = 0,
    end: int | None = None,
) -> None:
    """Copy the tokens at ``slot_mapping`` from the paged cache into ``out_chunk``.

    ``out_chunk`` is a whole chunk (``layout.chunk_shape``). With ``layer`` only that
    layer moves, and ``out_chunk`` may also be one layer's buffer
    (``layout.layer_chunk_shape``). Token ``start + i`` receives slot ``slot_mapping[i]``.
    """
    call, slots, first, native = _native_first(
        views, slot_mapping, out_chunk, layer, start, end, False
    )
    if not slots.numel():
        return
    # After the helper, what is left starts with a token that is not a whole block.
    blocks = None if native else whole_blocks(views, slots)
    if blocks is not None:
        cache, chunk = _block_views(views, call, blocks.numel())
        for i, out in zip(call.layers, chunk.unbind(0), strict=True):
            # Per block: the layer's [block_size, kv, heads, dim] slice, strided on one
            # side or both, copied with a vectorised inner loop over dim.
            torch.index_select(cache[i], 0, blocks, out=out)
        done = blocks.numel() * views.layout.block_size
        if done == slots.numel():
            return
        slots, first = slots[done:], first + done
    index = views.row_index(slots)
    rows = chunk_rows(views, call, first)
    for j, i in enumerate(call.layers):
        for kv in range(index.shape[0]):
            # The contiguous memcpy path of index_select: rows are contiguous on both sides.
            torch.index_select(views.rows[i], 0, index[kv], out=rows[kv, j])


def scatter_from_chunk(
    views: PagedKVViews,
    slot_mapping: torch.Tensor,
    src_chunk: torch.Tensor,
    layer: int | None = None,
    *,
    start: int = 0,
    end: int | None = None,
) -> None:
    """Copy tokens ``[start, end)`` of ``src_chunk`` into the paged cache at ``slot_mapping``.

    Slots must be distinct (as vLLM's are); with repeats the surviving write is arbitrary.
    """
    call, slots, first, _ = _native_first(views, slot_mapping, src_chunk, layer, start, end, True)
    if not slots.numel():
        return
    index = views.row_index(slots)
    rows = chunk_rows(views, call, first)
    cache = views.wide_rows
    width = widest_width(rows, cache[0].element_size())
    if width != cache[0].element_size():  # the buffer is less aligned than the cache
        cache = tuple(widest_view(t, width) for t in views.rows)
    rows = widest_view(rows, width)
    for j, i in enumerate(call.layers):
        # K and V in one op: twice the elements, so the kernel splits across threads.
        cache[i].index_put_((index,), rows[:, j])


def copy_chunks(
    views: PagedKVViews,
    slot_mapping: torch.Tensor,
    spans: Sequence[tuple[int, int]],
    chunks: Sequence[torch.Tensor],
    *,
    to_cache: bool,
    layer: int | None = None,
) -> None:
    """Many whole-chunk gathers (or scatters, ``to_cache``) in one call: chunk ``i``'s
    tokens ``[0, end - start)`` pair with ``slot_mapping[start:end]`` for ``(start, end)
    = spans[i]``; with ``layer``, only that layer of each (whole-chunk) buffer moves.

    The same as one gather_to_chunk/scatter_from_chunk per chunk, in order, minus their
    per-call cost: the slot mapping is converted once, and a buffer geometry checked
    once is not checked again. If chunk ``i`` fails, chunks before it are complete and
    its exception propagates with ``chunks_done = i`` set on it.
    """
    one = scatter_from_chunk if to_cache else gather_to_chunk
    native = native_copy.available() and views.layout.device.type == "cpu"
    if native:
        if slot_mapping.dim() != 1 or slot_mapping.dtype not in (torch.int64, torch.int32):
            native = False  # one() raises the usual error for the first chunk
        else:
            slot_mapping = slot_mapping.to(dtype=torch.int64, device="cpu").contiguous()
    checked = views.checked_buffers
    mla = views.layout.kind is KVKind.MLA
    moved = range(views.layout.num_layers) if layer is None else range(layer, layer + 1)
    total = slot_mapping.numel()
    base = slot_mapping.data_ptr() if native else 0
    finished = 0
    try:
        for (start, end), chunk in zip(spans, chunks, strict=True):
            n = end - start
            done = None
            # Out-of-range spans behave as slicing does (an empty or shorter mapping):
            # the checked call below sees them.
            if native and 0 <= start <= end <= total:
                geometry = (chunk.shape, chunk.stride(), chunk.dtype, chunk.device, layer)
                layer_buffer = checked.get(geometry)
                if layer_buffer is None or n > chunk.shape[-2]:
                    call = check_call(
                        views, slot_mapping[start:end], chunk, layer, 0, None, check_slots=False
                    )
                    layer_buffer = checked[geometry] = call.layer_buffer
                buf = chunk.unsqueeze(0) if mla else chunk
                if layer_buffer:  # one layer's own buffer
                    buf = buf.unsqueeze(1)
                elif layer is not None:
                    buf = buf[:, layer : layer + 1]
                done = native_copy.copy_slots_at(
                    views, base + 8 * start, n, buf, moved, 0, to_cache
                )
            if done is None:
                one(views, slot_mapping[start:end], chunk, layer)
            elif done < n:
                one(views, slot_mapping[start + done : end], chunk, layer, start=done, end=n)
            finished += 1
    except Exception as exc:
        exc.chunks_done = finished  # type: ignore[attr-defined]
        raise


def _native_first(
    views: PagedKVViews,
    slot_mapping: torch.Tensor,
    chunk: torch.Tensor,
    layer: int | None,
    start: int,
    end: int | None,
    to_cache: bool,
) -> tuple[CopyCall, torch.Tensor, int, bool]:
    """Validate the call and move its leading whole blocks through the C helper where
    it is built: (the call, the slots still to move, the chunk token they start at,
    whether the helper ran)."""
    call = check_call(
        views, slot_mapping, chunk, layer, start, end, check_slots=not native_copy.available()
    )
    slots = call.slots
    if not slots.numel() or not native_copy.available():
        return call, slots, call.start, False
    slots = slots.contiguous()
    done = native_copy.copy_slots(
        views, slots, _chunk_layers(views, call), call.layers, call.start, to_cache=to_cache
    )
    if done is None:  # not a layout the helper takes: it checked nothing
        check_slot_range(views, slots)
        return call, slots, call.start, False
    return call, slots[done:], call.start + done, True


def _chunk_layers(views: PagedKVViews, call: CopyCall) -> torch.Tensor:
    """The call's buffer as ``[kv, layers, tokens, hidden]`` over the layers it moves."""
    buf = call.chunk
    if views.layout.kind is KVKind.MLA:
        buf = buf.unsqueeze(0)
    if call.layer_buffer:
        return buf.unsqueeze(1)
    if len(call.layers) == views.layout.num_layers:
        return buf
    return buf[:, call.layers.start : call.layers.stop]


def _block_views(
    views: PagedKVViews, call: CopyCall, count: int
) -> tuple[Sequence[torch.Tensor], torch.Tensor]:
    """(per-layer canonical cache views, the call's first ``count`` blocks of tokens as
    ``[layers, count, block_size, kv, heads, head_dim]``), at one common width."""
    lay = views.layout
    buf = _chunk_layers(views, call)
    stop = call.start + count * lay.block_size
    if call.start or stop != buf.shape[2]:
        buf = buf[:, :, call.start : stop]
    kv, layers = buf.shape[:2]
    buf = buf.view(kv, layers, count, lay.block_size, lay.kv_heads, lay.head_dim)
    buf = buf.permute(1, 2, 3, 0, 4, 5)
    cache = views.wide_layers
    width = widest_width(buf, cache[0].element_size())
    if width != cache[0].element_size():  # the buffer is less aligned than the cache
        cache = tuple(widest_view(t, width) for t in views.layers)
    return cache, widest_view(buf, width)

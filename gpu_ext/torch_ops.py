"""Paged KV ⇄ contiguous chunk copies in plain torch: the fallback, and the CPU path.

Both directions work on "rows" (see layout.PagedKVViews): runs of elements contiguous in
the cache and in the chunk. A layer's K (or V) half of the chunk is ``[tokens *
rows_per_token, row_len]`` contiguous, and the row indices come from the slot mapping
once per call, so there are no per-token Python loops and no temporaries:

* gather: one ``index_select(out=...)`` per layer and K/V, straight into the chunk. On
  CPU its contiguous fast path memcpys each row, in parallel.
* scatter: one ``index_put_`` per layer (K and V together), straight into the cache's
  row view. That kernel moves one element at a time, so both sides are reinterpreted as
  the widest integer/complex type the row length and alignment allow (16 bytes for any
  fp16 head_dim that is a multiple of 8): bits move unchanged, with 8x fewer elements.

The slot mapping is checked (range) before any index is built: the row views alias
memory outside the blocks a bad slot would name, so indexing alone would not catch it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvmesh.gpu_ext.layout import KVKind, PagedKVViews

# Reinterpretation types by byte width; complex128 is the only 16-byte torch dtype and
# index_put_ copies it as two 8-byte words, bit for bit.
_WIDE_DTYPES = {
    16: torch.complex128,
    8: torch.int64,
    4: torch.int32,
    2: torch.int16,
    1: torch.uint8,
}


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
    if check_slots and n:
        low, high = (int(v) for v in torch.aminmax(slots))
        if low < 0 or high >= lay.num_slots:
            raise ValueError(f"slot_mapping holds {low}..{high}, outside [0, {lay.num_slots})")
    return CopyCall(slots, chunk, layers, layer_buffer, start, end)


def chunk_rows(views: PagedKVViews, call: CopyCall) -> torch.Tensor:
    """The chunk region a call moves, as ``[kv, layers, tokens * rows_per_token, row_len]``.

    A view: writing to it writes the caller's buffer.
    """
    buf = call.chunk
    if views.layout.kind is KVKind.MLA:
        buf = buf.unsqueeze(0)
    layers = slice(call.layers.start, call.layers.stop)
    buf = buf.unsqueeze(1) if call.layer_buffer else buf[:, layers]
    buf = buf[:, :, call.start : call.end]
    return buf.view(*buf.shape[:2], -1, views.row_len)


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
    call = check_call(views, slot_mapping, out_chunk, layer, start, end)
    if not call.slots.numel():
        return
    index = views.row_index(call.slots)
    rows = chunk_rows(views, call)
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
    call = check_call(views, slot_mapping, src_chunk, layer, start, end)
    if not call.slots.numel():
        return
    index = views.row_index(call.slots)
    rows = chunk_rows(views, call)
    wide = _widest_dtype(views.rows[0], rows)
    if wide is not None:
        rows = rows.view(wide)
    for j, i in enumerate(call.layers):
        dst = views.rows[i] if wide is None else views.rows[i].view(wide)
        # K and V in one op: twice the elements, so the kernel splits across threads.
        dst.index_put_((index,), rows[:, j])


def _widest_dtype(rows: torch.Tensor, chunk: torch.Tensor) -> torch.dtype | None:
    """The widest same-bits dtype both row views can be reinterpreted as, if wider."""
    size = rows.element_size()
    if rows.stride(-1) != 1 or chunk.stride(-1) != 1:
        return None
    quantities = (
        rows.shape[-1] * size,
        rows.storage_offset() * size,
        chunk.storage_offset() * size,
        *(stride * size for stride in rows.stride()[:-1]),
        *(stride * size for stride in chunk.stride()[:-1]),
    )
    for width, dtype in _WIDE_DTYPES.items():
        if width <= size:
            return None
        if all(q % width == 0 for q in quantities):
            return dtype
    return None

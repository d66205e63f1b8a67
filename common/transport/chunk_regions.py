"""Where one layer of a chunk lies in its buffer: what a layer-by-layer push writes.

Sender and receiver compute the same byte regions from the chunk's format and shape,
so a write names only (chunk, layer). In KV_2LTD ([2, layers, tokens, hidden]) a layer
is two regions, its K and its V; in KV_MLA ([layers, tokens, latent]) it is one.
Layer -1 is the whole chunk.
"""

from __future__ import annotations

from kvmesh.common.memory import MemoryFormat, MemoryObj

WHOLE = -1


def token_axis(fmt: MemoryFormat) -> int:
    """The tokens dimension of a chunk of fmt (what a last, partial chunk has fewer of)."""
    if fmt is MemoryFormat.KV_2LTD:
        return 2
    if fmt is MemoryFormat.KV_MLA:
        return 1
    raise ValueError(f"no layer-by-layer layout for chunks of format {fmt.name}")


def layer_regions(obj: MemoryObj, layer: int) -> list[tuple[int, int]]:
    """(byte offset, length) of layer's KV in obj, in order; the whole chunk for -1."""
    if layer == WHOLE:
        return [(0, obj.nbytes)]
    fmt = MemoryFormat(obj.fmt)
    shape = tuple(obj.shape)
    elt = obj.nbytes // _numel(shape)
    if fmt is MemoryFormat.KV_2LTD:
        _, layers, tokens, hidden = shape
        span = tokens * hidden * elt
        _check(layer, layers)
        return [(layer * span, span), ((layers + layer) * span, span)]
    if fmt is MemoryFormat.KV_MLA:
        layers, tokens, latent = shape
        span = tokens * latent * elt
        _check(layer, layers)
        return [(layer * span, span)]
    raise ValueError(f"no layer-by-layer layout for chunks of format {fmt.name}")


def _check(layer: int, layers: int) -> None:
    if not 0 <= layer < layers:
        raise ValueError(f"layer {layer} of a {layers}-layer chunk")


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n

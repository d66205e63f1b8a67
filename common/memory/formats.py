"""What the bytes of a MemoryObj mean: the layout of a KV chunk, or opaque bytes.

The values are stable integers because they travel with a chunk (in wire headers and
in self-describing disk files): append new members, never renumber one.
"""

from __future__ import annotations

from enum import IntEnum


class MemoryFormat(IntEnum):
    """The layout of one stored chunk. Letters name the dimensions, outermost first:
    2 = K and V, L = layers, T = tokens, D = hidden (heads × head size)."""

    UNDEFINED = 0
    """Not declared: the bytes have a shape and dtype but no KV meaning attached."""

    KV_2LTD = 1
    """[2, layers, tokens, hidden]: K then V, each layer-major. The engine's default
    chunk layout: a layer's K (or V) is one contiguous slice."""

    KV_T2D = 2
    """[tokens, 2, hidden]: one layer, token-major with K and V interleaved per token,
    as paged engines that store KV per token lay it out."""

    KV_2TD = 3
    """[2, tokens, hidden]: one layer, K then V. The unit of layer-by-layer transfer."""

    KV_MLA = 4
    """[layers, tokens, latent]: multi-head latent attention keeps one compressed
    latent per token instead of K and V, so there is no 2 dimension."""

    BINARY = 5
    """Opaque bytes (shape [nbytes], dtype uint8): a compressed or serialised chunk
    whose meaning lives in its own header."""

    @property
    def is_kv(self) -> bool:
        """Whether the bytes are an uncompressed KV tensor (a layout above)."""
        return self not in (MemoryFormat.UNDEFINED, MemoryFormat.BINARY)

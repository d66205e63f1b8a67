"""Describe an inference engine's paged KV cache and view it uniformly, without copying.

An engine hands us its KV caches as tensors whose meaning we must read from their
shapes and strides. Three kinds exist:

* ``PACKED_KV``: vLLM 0.32's logical per-layer shape ``[blocks, kv_heads, block_tokens,
  2*head_dim]`` (K is the first half of the last dim, V the second), physically laid out
  in one of the ``KVCacheLayout`` orders (LBHNC, LBNHC, LHBNC, BLHNC, BLNHC, BHLNC;
  outermost first). The CPU backend's contiguous per-layer tensors are LBHNC.
* ``SPLIT_KV``: the older per-layer ``[2, blocks, block_tokens, kv_heads, head_dim]``.
* ``MLA``: per-layer ``[blocks, block_tokens, latent_dim]``.

Every layer is normalised to one canonical logical view ``[blocks, block_tokens, kv,
kv_heads, head_dim]`` (kv is 2, or 1 for MLA with kv_heads 1), built with views only, so
the copy code needs no per-layout branches. Only the strides differ between layouts.

The torch fallback also needs "rows": the largest run of elements that is contiguous in
both the paged cache and the chunk (one head's K or V, or all heads when they are
adjacent). A row view ``[num_rows, row_len]`` over the same storage lets one
``index_select``/``index_put_`` move every row of a layer, with row indices computed from
the slot mapping. Where the slots cover whole blocks (vLLM's usual mapping), the torch
path moves blocks instead, indexing the canonical view's block dimension.

Both kinds of view also come reinterpreted as the widest type their strides allow
(``widest_view``): copies move bits, not numbers, and wider elements mean fewer of them.
"""

from __future__ import annotations

import enum
import itertools
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

#: vLLM 0.32 ``KVCacheLayout`` names: the physical order of the logical dims, outermost
#: first (L layers, B blocks, H kv heads, N tokens in a block, C = 2*head_dim).
VLLM_LAYOUT_NAMES: tuple[str, ...] = ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")

_UNDERSTOOD = (
    "per-layer [blocks, kv_heads, block_size, 2*head_dim] (vLLM packed K/V, any stride "
    "order), [2, blocks, block_size, kv_heads, head_dim] (split K/V) or "
    "[blocks, block_size, latent_dim] (MLA); a single tensor adds a leading layers dim"
)


class KVKind(enum.Enum):
    PACKED_KV = "packed_kv"
    SPLIT_KV = "split_kv"
    MLA = "mla"


@dataclass(frozen=True)
class PagedKVLayout:
    """What the engine's paged KV cache holds; enough to size chunk buffers."""

    kind: KVKind
    num_layers: int
    num_blocks: int
    block_size: int
    kv_heads: int  # 1 for MLA
    head_dim: int  # latent_dim for MLA
    dtype: torch.dtype
    device: torch.device
    # A VLLM_LAYOUT_NAMES entry for PACKED_KV when the strides identify one; else None.
    layout_name: str | None = None

    @property
    def is_mla(self) -> bool:
        return self.kind is KVKind.MLA

    @property
    def chunk_format_name(self) -> str:
        """The chunk buffer format: "KV_2LTD" ([2, layers, tokens, hidden]) or "KV_MLA"."""
        return "KV_MLA" if self.is_mla else "KV_2LTD"

    @property
    def num_kv(self) -> int:
        """2 (K and V) or 1 (MLA's single latent)."""
        return 1 if self.kind is KVKind.MLA else 2

    @property
    def hidden(self) -> int:
        """Elements per token, per layer, per K or V: kv_heads * head_dim."""
        return self.kv_heads * self.head_dim

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token occupies over all layers (K and V)."""
        return self.num_layers * self.bytes_per_token_layer

    @property
    def bytes_per_token_layer(self) -> int:
        return self.num_kv * self.hidden * self.dtype.itemsize

    def chunk_shape(self, num_tokens: int) -> tuple[int, ...]:
        """KV_2LTD ``[2, layers, tokens, hidden]``, or KV_MLA ``[layers, tokens, latent]``."""
        if self.kind is KVKind.MLA:
            return (self.num_layers, num_tokens, self.head_dim)
        return (2, self.num_layers, num_tokens, self.hidden)

    def layer_chunk_shape(self, num_tokens: int) -> tuple[int, ...]:
        """One layer of a chunk: ``[2, tokens, hidden]`` or ``[tokens, latent]``."""
        if self.kind is KVKind.MLA:
            return (num_tokens, self.head_dim)
        return (2, num_tokens, self.hidden)

    def chunk_nbytes(self, num_tokens: int) -> int:
        return num_tokens * self.bytes_per_token


@dataclass(frozen=True)
class PagedKVViews:
    """The engine's caches as canonical views and row views, aliasing its memory."""

    layout: PagedKVLayout
    # Per layer: [blocks, block_size, kv, kv_heads, head_dim]; strides equal across layers.
    layers: tuple[torch.Tensor, ...]
    # Per layer: [num_rows, row_len], the same storage addressed in row units.
    rows: tuple[torch.Tensor, ...]
    row_len: int  # head_dim, or kv_heads * head_dim when the heads of a token are adjacent
    rows_per_token: int  # rows per token, per layer, per K or V
    # Row-index steps: block, token-in-block; plus the [kv, rows_per_token] in-token table.
    block_step: int
    token_step: int
    row_table: torch.Tensor
    # The same memory reinterpreted for the torch path (see widest_view): ``layers`` as
    # the widest integer type up to 8 bytes (copy kernels), ``rows`` as the widest type
    # up to 16 bytes (index_put_, which moves one element at a time).
    wide_layers: tuple[torch.Tensor, ...]
    wide_rows: tuple[torch.Tensor, ...]
    block_offsets: torch.Tensor  # arange(block_size): the slots of a block, from its first
    layer_ptrs: torch.Tensor  # int64 data_ptr() of each canonical layer (native copies)
    # native_copy's per-buffer-geometry argument tuples, built on first use.
    native_plans: dict = field(default_factory=dict, compare=False, repr=False)
    # (shape, stride, dtype, device, layer) of chunk buffers already validated
    # (copy_chunks) → whether each is one layer's own buffer.
    checked_buffers: dict = field(default_factory=dict, compare=False, repr=False)

    def row_index(self, slot_mapping: torch.Tensor) -> torch.Tensor:
        """Row indices ``[kv, tokens * rows_per_token]``, ordered as the chunk stores them.

        The caller has checked that every slot is in range.
        """
        bs = self.layout.block_size
        if self.block_step == bs * self.token_step:
            # Blocks follow each other with no gap: the slot is a linear position.
            tok = slot_mapping * self.token_step
        else:
            tok = torch.div(slot_mapping, bs, rounding_mode="floor")
            tok = tok * self.block_step + (slot_mapping - tok * bs) * self.token_step
        kv = self.row_table.shape[0]
        return (tok.view(1, -1, 1) + self.row_table.view(kv, 1, -1)).view(kv, -1)


def describe_kv_caches(
    kv_caches: Sequence[torch.Tensor] | torch.Tensor | Mapping[str, torch.Tensor],
    *,
    layout_hint: str | None = None,
    mla: bool | None = None,
) -> PagedKVLayout:
    """Read a PagedKVLayout from the engine's tensors (their shapes and strides).

    ``kv_caches`` is vLLM's ``register_kv_caches`` dict (ordered by the layer number in
    each name), a list of per-layer tensors, or one cross-layer tensor whose first dim
    is the layer. ``layout_hint`` (a VLLM_LAYOUT_NAMES entry, e.g.
    ``KVCacheLayout.X.name``) names the order of a packed cache where strides cannot tell
    (dims of size 1) and is checked against them otherwise; split K/V and MLA caches
    ignore it. ``mla`` forces or forbids the MLA reading;
    by default a 3-D per-layer tensor is MLA.
    """
    return _analyse(kv_caches, layout_hint, mla)[0]


def build_views(
    kv_caches: Sequence[torch.Tensor] | torch.Tensor | Mapping[str, torch.Tensor],
    *,
    layout_hint: str | None = None,
    mla: bool | None = None,
) -> PagedKVViews:
    """Describe the caches and build the views the copy backends index (no data copy)."""
    layout, canon = _analyse(kv_caches, layout_hint, mla)
    _, n, kv, h, d = canon[0].shape
    sb, sn, sk, sh, sc = (
        s if size > 1 else 0 for s, size in zip(canon[0].stride(), canon[0].shape, strict=True)
    )
    if sc == 1 and (h == 1 or sh == d):
        row_len, rows_per_token, sh = h * d, 1, 0  # all heads of a token are one run
    else:
        row_len, rows_per_token = d, h
    unit = math.gcd(sb, sn, sk, sh) or 1
    last = (
        (layout.num_blocks - 1) * sb + (n - 1) * sn + (kv - 1) * sk + (rows_per_token - 1) * sh
    ) // unit
    row_stride = sc if row_len > 1 else 1
    rows = tuple(
        t.as_strided((last + 1, row_len), (unit, row_stride), t.storage_offset()) for t in canon
    )
    table = (torch.arange(kv, dtype=torch.int64) * (sk // unit)).view(kv, 1) + (
        torch.arange(rows_per_token, dtype=torch.int64) * (sh // unit)
    ).view(1, rows_per_token)
    layer_width = min(widest_width(t, COPY_WIDTH) for t in canon)
    row_width = min(widest_width(t, PUT_WIDTH) for t in rows)
    return PagedKVViews(
        layout=layout,
        layers=tuple(canon),
        rows=rows,
        row_len=row_len,
        rows_per_token=rows_per_token,
        block_step=sb // unit,
        token_step=sn // unit,
        row_table=table.to(layout.device),
        wide_layers=tuple(widest_view(t, layer_width) for t in canon),
        wide_rows=tuple(widest_view(t, row_width) for t in rows),
        block_offsets=torch.arange(layout.block_size, dtype=torch.int64, device=layout.device),
        layer_ptrs=torch.tensor([t.data_ptr() for t in canon], dtype=torch.int64),
    )


#: Widest reinterpretations: copy kernels vectorise integers up to 8 bytes (complex128
#: copies measured slower); index_put_ moves one element at a time, so 16 bytes halves
#: its element count again, and it copies complex128 as two 8-byte words, bit for bit.
COPY_WIDTH, PUT_WIDTH = 8, 16
_BY_WIDTH = {16: torch.complex128, 8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def widest_width(t: torch.Tensor, limit: int) -> int:
    """The widest element size in bytes, up to ``limit``, that ``t`` can be viewed as.

    ``Tensor.view(dtype)`` needs the last dim contiguous and every stride, the last size
    and the storage offset to be multiples of the width (counted in bytes here).
    """
    size = t.element_size()
    if t.dim() == 0 or t.stride(-1) != 1:
        return size
    strides = t.stride()[:-1]
    quantities = (t.shape[-1] * size, t.storage_offset() * size, *(s * size for s in strides))
    width = limit
    while width > size:
        if all(q % width == 0 for q in quantities):
            return width
        width //= 2
    return size


def widest_view(t: torch.Tensor, width: int) -> torch.Tensor:
    """``t`` reinterpreted with ``width``-byte elements (``t`` itself at its own width)."""
    return t if width == t.element_size() else t.view(_BY_WIDTH[width])


def _analyse(
    kv_caches: Sequence[torch.Tensor] | torch.Tensor | Mapping[str, torch.Tensor],
    layout_hint: str | None,
    mla: bool | None,
) -> tuple[PagedKVLayout, list[torch.Tensor]]:
    layers, layer_stride = _layer_list(kv_caches)
    first = layers[0]
    for i, t in enumerate(layers):
        if (t.shape, t.stride(), t.dtype, t.device) != (
            first.shape,
            first.stride(),
            first.dtype,
            first.device,
        ):
            raise ValueError(
                f"KV cache layer {i} differs from layer 0 in shape, strides, dtype or "
                f"device: {tuple(t.shape)}/{t.stride()}/{t.dtype}/{t.device} vs "
                f"{tuple(first.shape)}/{first.stride()}/{first.dtype}/{first.device}"
            )
    shape = tuple(first.shape)
    if any(size > 1 and stride <= 0 for size, stride in zip(shape, first.stride(), strict=True)):
        raise ValueError(f"KV cache strides {first.stride()} must be positive")
    name = None
    if mla or (mla is None and first.dim() == 3):
        if first.dim() != 3:
            raise ValueError(
                f"MLA KV cache layer shape {shape} is not [blocks, block_size, latent_dim]"
            )
        kind, (blocks, block_size, dim), heads = KVKind.MLA, shape, 1
        canon = [t.unsqueeze(2).unsqueeze(3) for t in layers]
    elif first.dim() == 4:
        blocks, heads, block_size, packed = shape
        if packed % 2:
            raise ValueError(f"packed K/V last dim {packed} of shape {shape} is odd; {_UNDERSTOOD}")
        kind, dim = KVKind.PACKED_KV, packed // 2
        canon = [t.unflatten(3, (2, dim)).permute(0, 2, 3, 1, 4) for t in layers]
        name = _packed_layout_name(first, layer_stride, len(layers), layout_hint)
    elif first.dim() == 5 and shape[0] == 2:
        kind, (_, blocks, block_size, heads, dim) = KVKind.SPLIT_KV, shape
        canon = [t.permute(1, 2, 0, 3, 4) for t in layers]
    else:
        what = "MLA is false but" if mla is False and first.dim() == 3 else "cannot read"
        raise ValueError(f"{what} KV cache layer shape {shape}; understood: {_UNDERSTOOD}")
    if min(blocks, block_size, heads, dim) < 1:
        raise ValueError(f"KV cache layer shape {shape} has an empty dimension")
    layout = PagedKVLayout(
        kind=kind,
        num_layers=len(layers),
        num_blocks=blocks,
        block_size=block_size,
        kv_heads=heads,
        head_dim=dim,
        dtype=first.dtype,
        device=first.device,
        layout_name=name,
    )
    return layout, canon


def _layer_list(
    kv_caches: Sequence[torch.Tensor] | torch.Tensor | Mapping[str, torch.Tensor],
) -> tuple[list[torch.Tensor], int | None]:
    """The per-layer tensors, and the layer stride in elements when it is uniform."""
    if isinstance(kv_caches, torch.Tensor):
        if kv_caches.dim() < 4:
            raise ValueError(
                f"a single KV cache tensor is read as [layers, ...]; shape "
                f"{tuple(kv_caches.shape)} is too small. Wrap one layer's tensor in a list."
            )
        return list(kv_caches.unbind(0)), kv_caches.stride(0)
    if isinstance(kv_caches, Mapping):
        layers = _by_layer_number(kv_caches)
    elif isinstance(kv_caches, Sequence):
        layers = list(kv_caches)
    else:
        raise ValueError(f"kv_caches must be tensors, got {type(kv_caches).__name__}")
    if not layers:
        raise ValueError("kv_caches is empty")
    if not all(isinstance(t, torch.Tensor) for t in layers):
        raise ValueError("every kv_caches entry must be a torch.Tensor")
    return layers, _uniform_spacing(layers)


def _by_layer_number(kv_caches: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
    # vLLM names layers like "model.layers.12.self_attn.attn"; sort on that number so a
    # dict built in another order still maps chunk layer i to model layer i.
    numbers = []
    for name in kv_caches:
        found = re.findall(r"\d+", name)
        numbers.append(int(found[0]) if len(found) == 1 else None)
    if None in numbers or len(set(numbers)) != len(numbers):
        return list(kv_caches.values())
    order = sorted(range(len(numbers)), key=lambda i: numbers[i])
    values = list(kv_caches.values())
    return [values[i] for i in order]


def _uniform_spacing(layers: list[torch.Tensor]) -> int | None:
    """Element distance between consecutive layers that share one allocation, if even."""
    if len(layers) < 2:
        return None
    storage = layers[0].untyped_storage().data_ptr()
    if any(t.untyped_storage().data_ptr() != storage for t in layers):
        return None
    offsets = [t.storage_offset() for t in layers]
    step = offsets[1] - offsets[0]
    if step <= 0 or any(b - a != step for a, b in itertools.pairwise(offsets)):
        return None
    return step


def _packed_layout_name(
    layer: torch.Tensor, layer_stride: int | None, num_layers: int, hint: str | None
) -> str | None:
    """The VLLM_LAYOUT_NAMES entry matching the strides of a packed per-layer tensor."""
    if hint is not None and hint not in VLLM_LAYOUT_NAMES:
        raise ValueError(f"layout_hint {hint!r} is not one of {VLLM_LAYOUT_NAMES}")
    blocks, heads, tokens, packed = layer.shape
    sizes = {"B": blocks, "H": heads, "N": tokens, "C": packed}
    strides = dict(zip("BHNC", layer.stride(), strict=True))
    if num_layers > 1:
        sizes["L"] = num_layers
        # Separate allocations have no common order; the layer is then the outermost.
        strides["L"] = layer_stride if layer_stride is not None else math.inf

    def fits(name: str) -> bool:
        dims = [c for c in name if sizes.get(c, 1) > 1]
        return all(strides[a] > strides[b] for a, b in itertools.pairwise(dims))

    if hint is not None:
        if not fits(hint):
            found = [n for n in VLLM_LAYOUT_NAMES if fits(n)]
            raise ValueError(
                f"layout_hint {hint} does not match the KV cache strides {layer.stride()} "
                f"(layer stride {layer_stride}); they fit {found or 'no vLLM layout'}"
            )
        return hint
    return next((n for n in VLLM_LAYOUT_NAMES if fits(n)), None)

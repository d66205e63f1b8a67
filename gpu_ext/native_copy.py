"""Whole-block copies through the optional C helper (gpu_ext/csrc/block_copy.c).

torch's CPU kernels cannot copy whole slices to indexed destinations (index_put_ and
index_copy_ move one element at a time), which held the scatter of a retrieve to ~0.6
of a plain copy_, and each torch call costs microseconds of dispatch. The helper checks
the slot mapping, finds the leading whole blocks and memcpys each block's contiguous
runs, over torch's thread count, with the GIL released; copies larger than the caches
use non-temporal stores. It is built with the package when a C compiler is there;
without it `available()` is False and torch_ops keeps its torch-only paths.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from kvmesh.gpu_ext.layout import PagedKVViews

try:
    from kvmesh.gpu_ext import _block_copy  # type: ignore[attr-defined]
except ImportError:  # no compiler at install time: the torch paths serve
    _block_copy = None

# Below this many bytes a call runs on one thread: starting threads costs ~10-20 µs.
PARALLEL_BYTES = 1 << 20
# From this many bytes on, stores bypass the caches (as glibc's memcpy does for copies
# larger than its share of the last-level cache): the destination will not be read from
# cache before it is evicted anyway, and skipping the read-for-ownership of every
# destination line saves a third of the memory traffic (measured on the Llama-3-8B
# layout: scatter 0.75 -> 1.2 of copy_).
STREAM_BYTES = 4 << 20

Geometry = tuple[tuple[int, int, int], tuple[int, int, int], tuple[int, int, int], int]


def available() -> bool:
    """Whether the C helper was built and loads."""
    return _block_copy is not None


def copy_slots(
    views: PagedKVViews,
    slots: torch.Tensor,
    chunk: torch.Tensor,
    layers: range,
    start: int,
    *,
    to_cache: bool,
) -> int | None:
    """Check ``slots`` and copy their leading whole blocks; the number of tokens copied.

    ``chunk`` is the call's buffer as ``[kv, layers, tokens, hidden]`` over ``layers``
    (torch_ops._chunk_layers); token ``start + i`` pairs with ``slots[i]`` (int64,
    contiguous, on the CPU). A slot outside the cache raises ValueError before anything
    is copied. Returns None (nothing copied, slots unchecked) when the helper is missing,
    the cache is not in host memory or the layout has no contiguous innermost run.
    """
    return copy_slots_at(views, slots.data_ptr(), slots.numel(), chunk, layers, start, to_cache)


def copy_slots_at(
    views: PagedKVViews,
    slots_addr: int,
    n_slots: int,
    chunk: torch.Tensor,
    layers: range,
    start: int,
    to_cache: bool,
) -> int | None:
    """copy_slots with the slots given as the address and length of int64 memory
    (which the caller keeps alive), for callers that walk one mapping chunk by chunk."""
    if _block_copy is None:
        return None
    strides = chunk.stride()  # one call: three stride(i) cost ~0.45 µs more
    tok = strides[2]
    key = (tok, strides[0], strides[1], layers.start, len(layers), to_cache)
    plan = views.native_plans.get(key)
    if plan is None:
        plan = views.native_plans[key] = _plan(views, *key)
    if plan is False:
        return None
    size, head, middle, tail = plan  # type: ignore[misc]
    return _block_copy.copy_slots(
        head,
        chunk.data_ptr() + start * tok * size,
        *middle,
        slots_addr,
        n_slots,
        *tail,
        torch.get_num_threads(),
        PARALLEL_BYTES,
        STREAM_BYTES,
    )


Plan = tuple[int, int, tuple[int, int], tuple[object, ...]]


def _plan(
    views: PagedKVViews,
    tok: int,
    kvs: int,
    lay_stride: int,
    first: int,
    count: int,
    to_cache: bool,
) -> Plan | bool:
    """copy_slots's arguments that depend only on the cache, the buffer's strides and
    the direction, or False when the helper cannot take them."""
    lay = views.layout
    if not count or lay.device.type != "cpu":
        return False
    cache0 = views.layers[0]
    size = cache0.element_size()
    geometry = _coalesce(
        (lay.block_size, cache0.shape[2], lay.kv_heads, lay.head_dim),
        tuple(cache0.stride()[1:]),
        (tok, kvs, lay.head_dim, 1),
    )
    if geometry is None:
        return False
    dims, cache_strides, chunk_strides, run = geometry
    head = views.layer_ptrs.data_ptr() + first * 8
    tail = (
        lay.block_size,
        lay.num_slots,
        to_cache,
        cache0.stride(0) * size,
        tok * size,
        dims,
        tuple(s * size for s in cache_strides),
        tuple(s * size for s in chunk_strides),
        run * size,
    )
    return size, head, (lay_stride * size, count), tail


@functools.lru_cache(maxsize=256)
def _coalesce(shape: tuple[int, ...], a: Sequence[int], b: Sequence[int]) -> Geometry | None:
    """(three outer dims, their strides on side a and side b, the innermost run), in
    elements, after merging dimensions that are contiguous on both sides; None when the
    innermost dimension is strided on either side or more than three outer dims remain.
    """
    if not shape or a[-1] != 1 or b[-1] != 1:
        return None
    run = shape[-1]
    outer: list[tuple[int, int, int]] = []
    for n, sa, sb in zip(reversed(shape[:-1]), reversed(a[:-1]), reversed(b[:-1]), strict=True):
        if n == 1:
            continue  # a size-1 dim loops once, whatever its stride
        if not outer and sa == run and sb == run:
            run *= n  # still one contiguous run on both sides
        elif outer and sa == outer[-1][0] * outer[-1][1] and sb == outer[-1][0] * outer[-1][2]:
            inner, inner_a, inner_b = outer[-1]
            outer[-1] = (inner * n, inner_a, inner_b)
        else:
            outer.append((n, sa, sb))
    if len(outer) > 3:
        return None
    outer += [(1, 0, 0)] * (3 - len(outer))
    outer.reverse()
    return (
        (outer[0][0], outer[1][0], outer[2][0]),
        (outer[0][1], outer[1][1], outer[2][1]),
        (outer[0][2], outer[1][2], outer[2][2]),
        run,
    )

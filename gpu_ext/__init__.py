"""Paged-KV gather/scatter kernels (Triton) with a torch fallback.

Entry point::

    copier = make_copier(kv_caches)          # vLLM's register_kv_caches dict, a list or a tensor
    chunk = torch.empty(copier.layout.chunk_shape(256), dtype=..., device=...)
    copier.gather(slot_mapping, chunk)       # paged cache -> chunk (store)
    copier.scatter(slot_mapping, chunk)      # chunk -> paged cache (retrieve)
    copier.gather(slot_mapping, chunk, layer=i)        # layerwise: layer i of the chunk
    copier.gather(slot_mapping, layer_buf, layer=i)    # ... or into a [2, tokens, hidden] buffer

``backend="auto"`` runs the Triton kernels on CUDA caches when triton is installed and
plain torch otherwise (CPU, or no triton). The copier only aliases the engine's memory:
build it once after the engine has allocated its caches, and again if it reallocates.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Literal

import torch

from kvmesh.gpu_ext import torch_ops
from kvmesh.gpu_ext.layout import (
    VLLM_LAYOUT_NAMES,
    KVKind,
    PagedKVLayout,
    PagedKVViews,
    build_views,
    describe_kv_caches,
)

Backend = Literal["auto", "torch", "triton"]

__all__ = [
    "VLLM_LAYOUT_NAMES",
    "Backend",
    "KVCopier",
    "KVKind",
    "PagedKVLayout",
    "PagedKVViews",
    "build_views",
    "describe_kv_caches",
    "make_copier",
]


class KVCopier:
    """Moves tokens between one engine's paged KV cache and chunk buffers."""

    def __init__(self, views: PagedKVViews, backend: Backend = "auto") -> None:
        from kvmesh.gpu_ext import triton_ops  # imports no triton until a kernel is built

        if backend not in ("auto", "torch", "triton"):
            raise ValueError(f"backend must be auto, torch or triton, not {backend!r}")
        device = views.layout.device
        if backend == "auto":
            # The interpreter also runs on CPU but is orders of magnitude slower than torch.
            use_triton = device.type == "cuda" and triton_ops.triton_available(device)
        else:
            use_triton = backend == "triton"
        self.views = views
        self._triton = triton_ops.TritonCopier(views) if use_triton else None

    @property
    def layout(self) -> PagedKVLayout:
        return self.views.layout

    @property
    def backend(self) -> Literal["torch", "triton"]:
        return "triton" if self._triton is not None else "torch"

    def gather(
        self,
        slot_mapping: torch.Tensor,
        out: torch.Tensor,
        layer: int | None = None,
        *,
        start: int = 0,
        end: int | None = None,
    ) -> None:
        """Paged cache → ``out``: all layers, or with ``layer`` only that one.

        ``out`` has ``layout.chunk_shape(tokens)``; with ``layer`` it may instead be that
        layer's own ``layout.layer_chunk_shape(tokens)`` buffer. Token ``start + i`` of
        ``out`` receives slot ``slot_mapping[i]``. The torch backend raises ValueError on a
        slot outside the cache; the Triton one skips it (no host synchronisation).
        """
        if self._triton is not None:
            self._triton.gather(slot_mapping, out, layer, start=start, end=end)
        else:
            torch_ops.gather_to_chunk(self.views, slot_mapping, out, layer, start=start, end=end)

    def scatter(
        self,
        slot_mapping: torch.Tensor,
        src: torch.Tensor,
        layer: int | None = None,
        *,
        start: int = 0,
        end: int | None = None,
    ) -> None:
        """``src`` → paged cache; the mirror of :meth:`gather`. Slots must be distinct."""
        if self._triton is not None:
            self._triton.scatter(slot_mapping, src, layer, start=start, end=end)
        else:
            torch_ops.scatter_from_chunk(self.views, slot_mapping, src, layer, start=start, end=end)

    def gather_chunks(
        self,
        slot_mapping: torch.Tensor,
        spans: Sequence[tuple[int, int]],
        outs: Sequence[torch.Tensor],
        layer: int | None = None,
    ) -> None:
        """One :meth:`gather` per ``(spans[i], outs[i])`` — ``out`` receives
        ``slot_mapping[start:end]``, all layers or with ``layer`` that one (into a whole
        chunk or that layer's own buffer) — for a request's chunks at once. If chunk
        ``i`` fails, those before it are complete and its exception carries
        ``chunks_done = i``."""
        if self._triton is None:
            torch_ops.copy_chunks(
                self.views, slot_mapping, spans, outs, to_cache=False, layer=layer
            )
        else:
            _each(self.gather, slot_mapping, spans, outs, layer)

    def scatter_chunks(
        self,
        slot_mapping: torch.Tensor,
        spans: Sequence[tuple[int, int]],
        srcs: Sequence[torch.Tensor],
        layer: int | None = None,
    ) -> None:
        """The mirror of :meth:`gather_chunks`."""
        if self._triton is None:
            torch_ops.copy_chunks(self.views, slot_mapping, spans, srcs, to_cache=True, layer=layer)
        else:
            _each(self.scatter, slot_mapping, spans, srcs, layer)


def _each(
    one: Callable[..., None],
    slot_mapping: torch.Tensor,
    spans: Sequence[tuple[int, int]],
    chunks: Sequence[torch.Tensor],
    layer: int | None,
) -> None:
    finished = 0
    try:
        for (start, end), chunk in zip(spans, chunks, strict=True):
            one(slot_mapping[start:end], chunk, layer)
            finished += 1
    except Exception as exc:
        exc.chunks_done = finished  # type: ignore[attr-defined]
        raise


def make_copier(
    kv_caches: Sequence[torch.Tensor] | torch.Tensor | Mapping[str, torch.Tensor],
    *,
    backend: Backend = "auto",
    layout_hint: str | None = None,
    mla: bool | None = None,
) -> KVCopier:
    """Describe ``kv_caches`` (see describe_kv_caches) and return a copier for them."""
    return KVCopier(build_views(kv_caches, layout_hint=layout_hint, mla=mla), backend)

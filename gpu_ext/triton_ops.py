"""Triton kernels for paged KV ⇄ chunk copies (CUDA; on CPU only in the interpreter).

Triton is imported on first use, so importing this module never needs it;
``triton_available()`` and ``unavailable_reason()`` say whether the kernels can run.
Triton has no CPU backend: CPU tensors work only under the interpreter, which must be
switched on with ``TRITON_INTERPRET=1`` before triton is imported (tests do this; it is
far too slow for serving).

One kernel covers every layout, so none falls back to torch: it reads the canonical
per-layer strides (layout.PagedKVViews.layers: block, token, K/V, head, dim) and a device
table of per-layer base addresses, so separate per-layer tensors, strided views of one
cross-layer allocation (any vLLM KVCacheLayout), split K/V and MLA all take the same
code. Data moves as same-width integers, so any dtype (fp8 included) copies bit for bit.

One program moves one token's K or V for one layer: grid ``(tokens, layers, kv)``.
Slots outside ``[0, num_slots)`` (vLLM pads with -1) are skipped rather than checked on
the host, because a check would synchronise the stream; the torch fallback raises.
"""

from __future__ import annotations

import functools
import os
from types import SimpleNamespace

import torch

from kvmesh.gpu_ext.layout import KVKind, PagedKVViews
from kvmesh.gpu_ext.torch_ops import CopyCall, check_call

_BITS_DTYPES = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_MAX_TILE = 4096  # elements per program step: keeps register use sane for wide layers


@functools.cache
def _kernels() -> SimpleNamespace | str:
    """The jitted kernels, or why they cannot be built."""
    try:
        import triton
        import triton.language as tl
    except ImportError as exc:  # optional dependency: the torch path covers its absence
        return f"triton is not installed ({exc})"

    @triton.jit
    def copy(
        layer_ptrs,
        slots,
        chunk,
        num_slots,
        block_size,
        s_block,
        s_token,
        s_kv,
        s_head,
        s_dim,
        c_kv,
        c_layer,
        c_token,
        heads,
        head_dim,
        BLOCK_H: tl.constexpr,
        BLOCK_D: tl.constexpr,
        TO_CHUNK: tl.constexpr,
    ):
        token = tl.program_id(0)
        layer = tl.program_id(1)
        kv = tl.program_id(2)
        slot = tl.load(slots + token)
        valid = (slot >= 0) & (slot < num_slots)
        slot = tl.where(valid, slot, 0)
        block = slot // block_size
        base = tl.load(layer_ptrs + layer).to(tl.pointer_type(chunk.dtype.element_ty))
        paged = base + block * s_block + (slot - block * block_size) * s_token + kv * s_kv
        flat = chunk + kv * c_kv + layer * c_layer + token.to(tl.int64) * c_token
        # An invalid slot moves zero heads. (Folding `valid` in as a scalar mask term trips
        # the interpreter, which rejects the broadcast mask's dtype.)
        head_limit = tl.where(valid, heads, 0)
        d = tl.arange(0, BLOCK_D)
        for h0 in range(0, heads, BLOCK_H):
            h = h0 + tl.arange(0, BLOCK_H)
            mask = (h[:, None] < head_limit) & (d[None, :] < head_dim)
            in_cache = paged + h[:, None].to(tl.int64) * s_head + d[None, :] * s_dim
            in_chunk = flat + h[:, None] * head_dim + d[None, :]
            if TO_CHUNK:
                tl.store(in_chunk, tl.load(in_cache, mask=mask), mask=mask)
            else:
                tl.store(in_cache, tl.load(in_chunk, mask=mask), mask=mask)

    return SimpleNamespace(copy=copy, next_pow2=triton.next_power_of_2)


def interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def unavailable_reason(device: torch.device | None = None) -> str | None:
    """None when the kernels can run on ``device`` (default: CUDA), else why not."""
    kernels = _kernels()
    if isinstance(kernels, str):
        return kernels
    device = torch.device("cuda") if device is None else device
    if device.type == "cuda":
        if interpreter_enabled():
            # The interpreter runs on the host and would dereference the layer address
            # table's device pointers there.
            return "TRITON_INTERPRET=1 cannot run kernels on CUDA tensors"
        return None if torch.cuda.is_available() else "CUDA is not available"
    if device.type == "cpu" and interpreter_enabled():
        return None
    return f"triton has no backend for {device.type} tensors (TRITON_INTERPRET=1 is unset)"


def triton_available(device: torch.device | None = None) -> bool:
    return unavailable_reason(device) is None


class TritonCopier:
    """Launches the kernels for one set of views; holds the device's layer-address table."""

    def __init__(self, views: PagedKVViews) -> None:
        reason = unavailable_reason(views.layout.device)
        if reason is not None:
            raise RuntimeError(f"Triton copy kernels unavailable: {reason}")
        self.views = views
        self._kernels = _kernels()
        self._layer_ptrs = torch.tensor(
            [t.data_ptr() for t in views.layers], dtype=torch.int64, device=views.layout.device
        )
        self._bits = _BITS_DTYPES[views.layout.dtype.itemsize]
        _, _, kv, heads, dim = views.layers[0].shape
        strides = views.layers[0].stride()
        self._paged_strides = strides[0], strides[1], strides[2] if kv > 1 else 0
        self._head_stride, self._dim_stride = strides[3], strides[4]
        self._block_d = self._kernels.next_pow2(dim)
        self._block_h = max(1, min(self._kernels.next_pow2(heads), _MAX_TILE // self._block_d))

    def gather(
        self,
        slot_mapping: torch.Tensor,
        out: torch.Tensor,
        layer: int | None = None,
        *,
        start: int = 0,
        end: int | None = None,
    ) -> None:
        call = check_call(self.views, slot_mapping, out, layer, start, end, check_slots=False)
        self._launch(call, to_chunk=True)

    def scatter(
        self,
        slot_mapping: torch.Tensor,
        src: torch.Tensor,
        layer: int | None = None,
        *,
        start: int = 0,
        end: int | None = None,
    ) -> None:
        call = check_call(self.views, slot_mapping, src, layer, start, end, check_slots=False)
        self._launch(call, to_chunk=False)

    def _launch(self, call: CopyCall, *, to_chunk: bool) -> None:
        n = call.slots.numel()
        if not n:
            return
        lay = self.views.layout
        chunk = call.chunk.view(self._bits)
        mla = lay.kind is KVKind.MLA
        # Start the chunk view at token `start` of the first layer moved, so the kernel's
        # token and layer program ids index it directly.
        token_dim = chunk.dim() - 2
        chunk = chunk.narrow(token_dim, call.start, n)
        if call.layer_buffer:
            c_layer = 0
        else:
            layer_dim = 0 if mla else 1
            chunk = chunk.narrow(layer_dim, call.layers.start, len(call.layers))
            c_layer = chunk.stride(layer_dim)
        c_kv = 0 if mla else chunk.stride(0)
        c_token = chunk.stride(token_dim)
        ptrs = self._layer_ptrs[call.layers.start : call.layers.stop]
        s_block, s_token, s_kv = self._paged_strides
        grid = (n, len(call.layers), lay.num_kv)
        self._kernels.copy[grid](
            ptrs,
            call.slots,
            chunk,
            lay.num_slots,
            lay.block_size,
            s_block,
            s_token,
            s_kv,
            self._head_stride,
            self._dim_stride,
            c_kv,
            c_layer,
            c_token,
            lay.kv_heads,
            lay.head_dim,
            BLOCK_H=self._block_h,
            BLOCK_D=self._block_d,
            TO_CHUNK=to_chunk,
        )

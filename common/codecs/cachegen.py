"""A CacheGen-style lossy codec for KV chunks: per-layer, per-channel quantisation,
deltas between neighbouring tokens, then entropy coding.

1. **Canonical view.** The chunk is seen, without a copy, as [layers, K/V, tokens,
   channels] (`_view`: the memory format says which axis is which; an MLA latent has
   one "K/V" slot). A single-layer chunk (the layer-by-layer formats) counts as an
   early layer and gets the most bits.
2. **Bits per layer.** The layers are split into `len(layer_bits)` equal bands, first
   band first: the default (6, 5, 4) gives the first third 6 bits, the middle third 5
   and the last third 4, because errors in early layers travel through every later
   one (CacheGen's observation). (8, 6, 4) is closer but ~20% larger
   (docs/benchmarks.md).
3. **Per-channel quantisation.** For each (layer, K/V, channel) the chunk's minimum
   and step ((max - min) / (2^bits - 1)) over its tokens, stored as float32; values
   become integer codes round((x - min) / step). Per channel, because KV channels
   differ in range by orders of magnitude (outlier channels) while one channel is
   similar across tokens. The error is at most step / 2 per value.
4. **Token deltas.** Neighbouring tokens are similar, so each code is stored as its
   difference from the previous token's code, modulo 2^bits. The difference is taken
   between integer codes, after quantisation, so decoding (a running sum) gives back
   the codes exactly: no error accumulates along the chunk, unlike deltas of values.
5. **Entropy coding.** The deltas, one byte each, token-major, go through zstd, one
   frame per segment (at most `segment_layers` layers of one band), so the segments
   of a large chunk encode and decode side by side on every core. zstd's Huffman
   stage codes each byte in about its order-0 entropy; CacheGen's arithmetic coder
   with per-channel distributions saves a little more, but zstd is already a
   dependency and decodes at GB/s in C, where an arithmetic coder in Python would
   not, and decode speed is this codec's goal.

Payload: the params frame (base.pack_params), then per segment: minimum and step
(float32, [2][layers in segment, K/V, channels]), the u32 length of the zstd frame,
the frame (its content is [tokens, layers in segment, K/V, channels] uint8).
"""

from __future__ import annotations

import os
import struct
import threading
from collections.abc import Callable, Sequence
from typing import Annotated, Any, TypeVar

import msgspec
import torch
import zstandard

from kvmesh.common.codecs.base import (
    Codec,
    CodecError,
    CodecId,
    KVLayout,
    as_tensor,
    pack_params,
    unpack_params,
)
from kvmesh.common.memory import MemoryFormat
from kvmesh.common.thread_jobs import LazyPool, map_all

Bits = Annotated[int, msgspec.Meta(ge=1, le=8)]
_LEN = struct.Struct("<I")
_T = TypeVar("_T")
# Values dequantised per step: a block's float32 temporaries stay in the CPU's cache.
_BLOCK_VALUES = 1 << 18
# torch's cumsum over the token axis is fast for short rows, a Python loop of
# contiguous row adds (~1 ms per 256 tokens, mostly call overhead) for long ones; per
# 256 tokens, cumsum took 0.4 ms for rows of 1.5K values, 2.8 ms for 4K, 53 ms for 64K.
_ROW_LOOP_FROM = 2048
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_FORMATS = (MemoryFormat.KV_2LTD, MemoryFormat.KV_2TD, MemoryFormat.KV_T2D, MemoryFormat.KV_MLA)


class CacheGenParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The settings a cachegen payload was written with (stored in it)."""

    layer_bits: Annotated[tuple[Bits, ...], msgspec.Meta(min_length=1, max_length=64)] = (6, 5, 4)
    """Bits per value for each equal band of layers, first layers first."""
    zstd_level: Annotated[int, msgspec.Meta(ge=1, le=19)] = 1
    """zstd level of the entropy stage (higher: slower writes, a few % smaller)."""
    segment_layers: Annotated[int, msgspec.Meta(ge=1, le=1024)] = 4
    """Layers per independently coded segment (segments decode in parallel)."""


def _view(t: torch.Tensor, fmt: MemoryFormat) -> torch.Tensor:
    """t as [layers, K/V, tokens, channels], a view."""
    if fmt is MemoryFormat.KV_2LTD:
        return t.permute(1, 0, 2, 3)
    if fmt is MemoryFormat.KV_2TD:
        return t.unsqueeze(0)
    if fmt is MemoryFormat.KV_T2D:
        return t.permute(1, 0, 2).unsqueeze(0)
    if fmt is MemoryFormat.KV_MLA:
        return t.unsqueeze(1)
    raise ValueError(f"cachegen does not encode {fmt.name} chunks")


def _segments(layers: int, params: CacheGenParams) -> list[tuple[int, int, int]]:
    """(first layer, end layer, bits) of each segment: the bands cut into pieces of at
    most segment_layers layers."""
    out = []
    for lo, hi, bits in _bands(layers, params.layer_bits):
        for s in range(lo, hi, params.segment_layers):
            out.append((s, min(hi, s + params.segment_layers), bits))
    return out


_pool = LazyPool(lambda: max(2, min(8, os.cpu_count() or 2)), "kvmesh-cachegen")
# Below this many bytes a thread hop costs more than the segments' work.
_PARALLEL_FROM = 1 << 20


def _map(fn: Callable[[Any], _T], items: Sequence[Any], chunk: torch.Tensor) -> list[_T]:
    """fn over items, on a shared pool of one thread per core for large chunks (zstd and
    torch let go of the GIL, so the segments run side by side)."""
    if len(items) < 2 or chunk.numel() * chunk.element_size() < _PARALLEL_FROM:
        return [fn(item) for item in items]
    # Every job has finished before this returns or raises (map_all): a decode writes
    # into the caller's buffer, which the caller hands back to the pool when the decode
    # fails, and a segment still running then would write into another chunk's page.
    return map_all(_pool.get(), fn, items)


def _bands(layers: int, layer_bits: tuple[int, ...]) -> list[tuple[int, int, int]]:
    """(first layer, end layer, bits) of each non-empty band."""
    n = len(layer_bits)
    out: list[tuple[int, int, int]] = []
    for b, bits in enumerate(layer_bits):
        lo, hi = -(-b * layers // n), -(-(b + 1) * layers // n)
        if hi > lo:
            out.append((lo, hi, bits))
    return out


class CacheGenCodec(Codec):
    id = CodecId.CACHEGEN
    name = "cachegen"
    lossless = False

    def __init__(self, params: CacheGenParams | None = None) -> None:
        self._params = params or CacheGenParams()
        self._frame = pack_params(self._params)
        self._local = threading.local()

    @property
    def params(self) -> CacheGenParams:
        return self._params

    def _zstd(self) -> tuple[Any, Any]:
        pair = getattr(self._local, "pair", None)
        if pair is None:
            pair = self._local.pair = (
                zstandard.ZstdCompressor(level=self._params.zstd_level),
                zstandard.ZstdDecompressor(),
            )
        return pair

    def supports(self, layout: KVLayout) -> bool:
        return (
            layout.fmt in _FORMATS
            and layout.torch_dtype in _FLOAT_DTYPES
            and len(layout.shape) == (3 if layout.fmt != MemoryFormat.KV_2LTD else 4)
            # An empty chunk has no range to quantise (amin over no tokens raises).
            and all(d > 0 for d in layout.shape)
        )

    # -- encode ---------------------------------------------------------------------------
    def encode(self, data: torch.Tensor | memoryview | bytes, layout: KVLayout) -> bytes:
        if not self.supports(layout):
            raise ValueError(f"cachegen does not encode {layout}")
        v = _view(as_tensor(data, layout), layout.memory_format)
        segments = _segments(v.shape[0], self._params)
        parts = _map(lambda seg: self._encode_segment(v[seg[0] : seg[1]], seg[2]), segments, v)
        return b"".join([self._frame, *(b for seg in parts for b in seg)])

    def _encode_segment(self, seg: torch.Tensor, bits: int) -> list[bytes]:
        x = seg.to(torch.float32, copy=True)  # [l, kv, T, C], worked in place
        if not bool(torch.isfinite(x).all()):
            raise ValueError("cachegen cannot quantise non-finite values")
        levels = (1 << bits) - 1
        lo_v = x.amin(dim=2, keepdim=True)
        step = (x.amax(dim=2, keepdim=True) - lo_v) / levels
        step = torch.where(step > 0, step, torch.ones_like(step))
        # A channel spanning more than float32 holds (bf16 and fp32 reach 3.4e38) has an
        # infinite step, or a top level that overflows: decoding would give inf or NaN
        # (0 * inf) for finite values. Such a chunk is stored raw instead.
        if not bool(torch.isfinite(torch.addcmul(lo_v, step, torch.full_like(step, levels))).all()):
            raise ValueError("cachegen cannot quantise a channel whose range overflows float32")
        q = x.sub_(lo_v).div_(step).round_().clamp_(0, levels).to(torch.uint8)
        q = q.permute(2, 0, 1, 3).contiguous()  # token-major: deltas run along rows
        d = q.clone()
        d[1:] -= q[:-1]  # uint8 arithmetic wraps: a difference modulo 256
        d &= levels
        frame = self._zstd()[0].compress(memoryview(d.numpy()).cast("B"))
        side = torch.stack([lo_v.squeeze(2), step.squeeze(2)]).contiguous()
        return [side.numpy().tobytes(), _LEN.pack(len(frame)), frame]

    # -- decode ---------------------------------------------------------------------------
    def decode(
        self, payload: memoryview | bytes, layout: KVLayout, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        if not self.supports(layout):
            raise CodecError(f"cachegen payload for an unsupported layout {layout}")
        params, rest = unpack_params(memoryview(payload).cast("B"), CacheGenParams)
        if out is None:
            out = torch.empty(layout.shape, dtype=layout.torch_dtype)
        elif tuple(out.shape) != layout.shape or out.dtype != layout.torch_dtype:
            raise ValueError(f"out {tuple(out.shape)} {out.dtype} does not match {layout}")
        v = _view(out, layout.memory_format)
        _, kv, _, channels = v.shape
        # Where each segment's parts are, checked before any work starts.
        jobs: list[tuple[int, int, int, memoryview, memoryview]] = []
        pos = 0
        for lo, hi, bits in _segments(v.shape[0], params):
            n_side = 2 * 4 * (hi - lo) * kv * channels
            if pos + n_side + _LEN.size > rest.nbytes:
                raise CodecError("cachegen payload truncated")
            side = rest[pos : pos + n_side]
            pos += n_side
            (n,) = _LEN.unpack_from(rest, pos)
            pos += _LEN.size
            if pos + n > rest.nbytes:
                raise CodecError("cachegen payload truncated")
            jobs.append((lo, hi, bits, side, rest[pos : pos + n]))
            pos += n
        if pos != rest.nbytes:
            raise CodecError(f"{rest.nbytes - pos} bytes after the last cachegen segment")
        _map(lambda job: self._decode_segment(v, *job), jobs, v)
        return out

    def _decode_segment(
        self, v: torch.Tensor, lo: int, hi: int, bits: int, side: memoryview, frame: memoryview
    ) -> None:
        _, kv, tokens, channels = v.shape
        lo_v, step = (
            torch.frombuffer(bytearray(side), dtype=torch.float32)
            .view(2, hi - lo, kv, channels)
            .unbind(0)
        )
        q = torch.empty(tokens, hi - lo, kv, channels, dtype=torch.uint8)
        dst = memoryview(q.numpy()).cast("B")
        got = 0
        try:
            # Decompressed straight into q: no intermediate bytes object.
            with self._zstd()[1].stream_reader(frame) as reader:
                while got < dst.nbytes:
                    n = reader.readinto(dst[got:])
                    if not n:
                        break
                    got += n
                extra = reader.read(1)
        except zstandard.ZstdError as exc:
            raise CodecError(f"cachegen entropy stage: {exc}") from None
        if got != dst.nbytes or extra:
            raise CodecError(f"cachegen segment holds other than the {dst.nbytes} codes expected")
        self._dequantise(q, (1 << bits) - 1, lo_v, step, v[lo:hi])

    @staticmethod
    def _dequantise(
        q: torch.Tensor, levels: int, lo_v: torch.Tensor, step: torch.Tensor, dst: torch.Tensor
    ) -> None:
        """Undo the deltas (a running sum over tokens, modulo 256, then the band's bit
        mask) and the quantisation of q [T, l, kv, C] into dst [l, kv, T, C], a block
        of tokens at a time so the temporaries stay in cache."""
        tokens, row = q.shape[0], q[0].numel()
        if row < _ROW_LOOP_FROM:
            q = torch.cumsum(q, 0, dtype=torch.uint8)  # wraps: a sum modulo 256
        else:
            for t in range(1, tokens):  # each row is contiguous: one fast add per token
                q[t] += q[t - 1]
        q &= levels
        dst_t = dst.permute(2, 0, 1, 3)
        block = max(1, _BLOCK_VALUES // row)
        for t0 in range(0, tokens, block):
            t1 = min(tokens, t0 + block)
            torch.addcmul(lo_v, q[t0:t1].float(), step, out=dst_t[t0:t1])

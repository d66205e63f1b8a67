"""Lossless codecs over the chunk's raw bytes: zstd and lz4 (frame format).

Both formats describe themselves (a zstd or lz4 frame header), so the payload carries
no params frame and is byte for byte what the remote tier stored before codecs had a
registry: values written then decode here. fp16/bf16 KV has near-random low mantissa
bits, so expect ratios of about 1.1–1.3; their value is exactness.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import lz4.frame
import msgspec
import torch
import zstandard

from kvmesh.common.codecs.base import Codec, CodecError, CodecId, KVLayout, as_bytes


class ZstdParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    level: int = 1
    """zstd level: 1 is fast enough for a write path; higher saves little on KV."""


class Lz4Params(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    pass


# Bytes per piece of decoded_pieces: the most a verification holds at once.
PIECE_BYTES = 1 << 20


def _into(raw: bytes, layout: KVLayout, out: torch.Tensor | None) -> torch.Tensor:
    """raw (the decoded bytes) as a tensor of layout, in out when given: one copy."""
    if len(raw) != layout.nbytes:
        raise CodecError(f"decoded {len(raw)} bytes, the layout needs {layout.nbytes}")
    if out is None:
        out = torch.empty(layout.shape, dtype=layout.torch_dtype)
    elif tuple(out.shape) != layout.shape or out.dtype != layout.torch_dtype:
        raise ValueError(f"out {tuple(out.shape)} {out.dtype} does not match {layout}")
    as_bytes(out)[:] = raw
    return out


class ZstdCodec(Codec):
    id = CodecId.ZSTD
    name = "zstd"
    lossless = True

    def __init__(self, params: ZstdParams | None = None) -> None:
        self._params = params or ZstdParams()
        # zstandard's (de)compressor objects are not thread-safe: one per thread.
        self._local = threading.local()

    @property
    def params(self) -> ZstdParams:
        return self._params

    def _pair(self) -> tuple[Any, Any]:
        pair = getattr(self._local, "pair", None)
        if pair is None:
            pair = self._local.pair = (
                zstandard.ZstdCompressor(level=self._params.level),
                zstandard.ZstdDecompressor(),
            )
        return pair

    def encode(self, data: torch.Tensor | memoryview | bytes, layout: KVLayout) -> bytes:
        return self._pair()[0].compress(as_bytes(data))

    def decode(
        self, payload: memoryview | bytes, layout: KVLayout, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        try:
            # decompress sizes its output by the frame's declared content size and
            # heeds max_output_size only when there is none: a damaged size field
            # would have it allocate that many bytes (MemoryError past the RAM).
            declared = zstandard.frame_content_size(payload)
            if declared not in (-1, layout.nbytes):
                raise CodecError(
                    f"zstd frame of {declared} bytes, the layout needs {layout.nbytes}"
                )
            raw = self._pair()[1].decompress(payload, max_output_size=layout.nbytes)
        except zstandard.ZstdError as exc:
            raise CodecError(f"zstd decompression failed: {exc}") from None
        return _into(raw, layout, out)

    def decoded_pieces(self, payload: memoryview | bytes, layout: KVLayout) -> Iterator[bytes]:
        # Stricter than decode on one point: bytes after the frame (which decompress
        # ignores, and no writer leaves) fail here, since the frame's end must be read.
        got = 0
        extra = b""
        try:
            declared = zstandard.frame_content_size(payload)
            if declared not in (-1, layout.nbytes):
                raise CodecError(
                    f"zstd frame of {declared} bytes, the layout needs {layout.nbytes}"
                )
            with self._pair()[1].stream_reader(payload, read_across_frames=False) as reader:
                while got < layout.nbytes:
                    piece = reader.read(min(PIECE_BYTES, layout.nbytes - got))
                    if not piece:
                        break
                    got += len(piece)
                    yield piece
                extra = reader.read(1)
        except zstandard.ZstdError as exc:
            raise CodecError(f"zstd decompression failed: {exc}") from None
        if got != layout.nbytes or extra:
            raise CodecError(f"zstd frame is not the {layout.nbytes} bytes the layout needs")


class Lz4Codec(Codec):
    id = CodecId.LZ4
    name = "lz4"
    lossless = True

    def __init__(self, params: Lz4Params | None = None) -> None:
        self._params = params or Lz4Params()

    @property
    def params(self) -> Lz4Params:
        return self._params

    def encode(self, data: torch.Tensor | memoryview | bytes, layout: KVLayout) -> bytes:
        return lz4.frame.compress(as_bytes(data))

    def decode(
        self, payload: memoryview | bytes, layout: KVLayout, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        # Bounded by the layout's size, so a damaged frame cannot claim gigabytes.
        d = lz4.frame.LZ4FrameDecompressor()
        try:
            raw = d.decompress(payload, max_length=layout.nbytes)
        except RuntimeError as exc:  # lz4's only error type
            raise CodecError(f"lz4 decompression failed: {exc}") from None
        if not d.eof:
            raise CodecError("lz4 frame longer than the chunk or truncated")
        return _into(raw, layout, out)

    def decoded_pieces(self, payload: memoryview | bytes, layout: KVLayout) -> Iterator[bytes]:
        d = lz4.frame.LZ4FrameDecompressor()
        got = 0
        stalled = 0
        try:
            piece = d.decompress(payload, max_length=PIECE_BYTES)
            while True:
                got += len(piece)
                if got > layout.nbytes:
                    raise CodecError("lz4 frame longer than the chunk")
                if piece:
                    stalled = 0
                    yield piece
                else:
                    stalled += 1
                if d.eof or d.needs_input or stalled > 2:
                    break
                piece = d.decompress(b"", max_length=PIECE_BYTES)
        except RuntimeError as exc:
            raise CodecError(f"lz4 decompression failed: {exc}") from None
        if not d.eof:
            raise CodecError("lz4 frame longer than the chunk or truncated")
        if got != layout.nbytes:
            raise CodecError(f"decoded {got} bytes, the layout needs {layout.nbytes}")

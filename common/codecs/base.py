"""One interface for every way a chunk's bytes can be stored smaller.

A codec turns a KV chunk (a tensor, or its raw bytes, plus the `KVLayout` that says
what the bytes are) into a stored payload and back. Each codec has a stable id (the
chunk header's codec field, `common.chunk_codec.Codec`) and a msgspec params Struct.
Decoding needs only the id and the payload: a codec whose params change the bytes
(cachegen) writes them at the start of its payload as a length-prefixed msgpack frame
(`pack_params` / `unpack_params`), so a reader decodes whatever settings the writer
chose, with no config of its own.

`lossless` codecs give back the exact bytes; the header's checksum then stays the
checksum of the raw chunk and is verified after decoding. A lossy codec cannot give
back the raw bytes, so its header checksum covers the stored payload and is verified
before decoding (common/chunk_codec.py).
"""

from __future__ import annotations

import struct
from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import ClassVar, TypeVar

import msgspec
import torch

from kvmesh.common.chunk_codec import Codec as CodecId
from kvmesh.common.chunk_codec import CorruptChunk, dtype_from_name, dtype_name
from kvmesh.common.memory import MemoryFormat

__all__ = [
    "Codec",
    "CodecError",
    "CodecId",
    "KVLayout",
    "as_bytes",
    "pack_params",
    "unpack_params",
]


class CodecError(CorruptChunk):
    """A payload this codec cannot decode (damaged, truncated, or not its own). A
    CorruptChunk, so a tier treats it like any failed check: a miss, never wrong KV."""


class KVLayout(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What a chunk's bytes are: the tensor's shape, dtype name and memory format, as
    the chunk header records them."""

    shape: tuple[int, ...]
    dtype: str
    fmt: int = int(MemoryFormat.UNDEFINED)

    @classmethod
    def of(cls, tensor: torch.Tensor, fmt: MemoryFormat | int = MemoryFormat.UNDEFINED) -> KVLayout:
        return cls(tuple(int(d) for d in tensor.shape), dtype_name(tensor.dtype), int(fmt))

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtype_from_name(self.dtype)

    @property
    def memory_format(self) -> MemoryFormat:
        return MemoryFormat(self.fmt)

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.torch_dtype.itemsize


Params = TypeVar("Params", bound=msgspec.Struct)


def as_bytes(data: torch.Tensor | memoryview | bytes | bytearray) -> memoryview:
    """A flat byte view of data without a copy (a tensor must be contiguous)."""
    if isinstance(data, torch.Tensor):
        if not data.is_contiguous():
            raise ValueError("a codec encodes contiguous tensors only")
        return memoryview(data.reshape(-1).view(torch.uint8).numpy()).cast("B")
    return memoryview(data).cast("B")


def as_tensor(
    data: torch.Tensor | memoryview | bytes | bytearray, layout: KVLayout
) -> torch.Tensor:
    """data seen as layout's tensor, without a copy where data is writable."""
    if isinstance(data, torch.Tensor):
        if tuple(data.shape) != layout.shape or data.dtype != layout.torch_dtype:
            raise ValueError(
                f"tensor {tuple(data.shape)} {data.dtype} does not match layout {layout}"
            )
        return data
    mv = memoryview(data).cast("B")
    if mv.nbytes != layout.nbytes:
        raise ValueError(f"{mv.nbytes} bytes do not match layout {layout} ({layout.nbytes})")
    if mv.readonly:
        mv = memoryview(bytearray(mv))
    return torch.frombuffer(mv, dtype=torch.uint8).view(layout.torch_dtype).view(layout.shape)


_PARAMS_LEN = struct.Struct("<I")
# A params frame is a few hundred bytes; anything larger is a damaged length.
MAX_PARAMS_BYTES = 1 << 16


def pack_params(params: msgspec.Struct) -> bytes:
    """params as a frame for the start of a payload: u32 length, then msgpack."""
    body = msgspec.msgpack.encode(params)
    return _PARAMS_LEN.pack(len(body)) + body


def unpack_params(payload: memoryview, params_type: type[Params]) -> tuple[Params, memoryview]:
    """(params, the rest of payload) from a frame made by pack_params; CodecError when
    the frame is truncated or its params do not validate."""
    if payload.nbytes < _PARAMS_LEN.size:
        raise CodecError("payload too short for its params frame")
    (n,) = _PARAMS_LEN.unpack_from(payload)
    end = _PARAMS_LEN.size + n
    if n > MAX_PARAMS_BYTES or end > payload.nbytes:
        raise CodecError(f"params frame of {n} bytes does not fit the payload")
    try:
        params = msgspec.msgpack.decode(payload[_PARAMS_LEN.size : end], type=params_type)
    except msgspec.DecodeError as exc:  # ValidationError included
        raise CodecError(f"bad codec params: {exc}") from None
    return params, payload[end:]


class Codec(ABC):
    """A way to store a chunk. Instances are immutable and thread-safe: encode and
    decode run on tier I/O threads side by side."""

    id: ClassVar[CodecId]
    name: ClassVar[str]
    lossless: ClassVar[bool]

    @property
    @abstractmethod
    def params(self) -> msgspec.Struct | None:
        """The settings this instance encodes with (None: the codec has none)."""

    @abstractmethod
    def encode(self, data: torch.Tensor | memoryview | bytes, layout: KVLayout) -> bytes:
        """The stored payload for data (a tensor or its raw bytes) laid out as layout.
        ValueError when this codec cannot encode that layout."""

    @abstractmethod
    def decode(
        self, payload: memoryview | bytes, layout: KVLayout, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The chunk payload encodes, as a tensor of layout (written into out when
        given: a contiguous tensor of layout's shape and dtype). CodecError when the
        payload does not decode to layout."""

    def decoded_pieces(self, payload: memoryview | bytes, layout: KVLayout) -> Iterator[bytes]:
        """The bytes decode would give, in order, in pieces (CodecError as decode): a
        check that only hashes them need not hold a chunk of whatever size a header
        claims. This default decodes whole; streaming codecs override it."""
        yield as_bytes(self.decode(payload, layout)).tobytes()

    def supports(self, layout: KVLayout) -> bool:
        """Whether encode takes chunks of this layout (lossless codecs take any)."""
        return True

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.params!r})"

"""Chunk codecs behind one interface (base.py), found by the id a chunk header stores
or by the name a config uses. See docs/configuration.md (`compression`)."""

from __future__ import annotations

import msgspec

from kvmesh.common.codecs.base import Codec, CodecError, CodecId, KVLayout
from kvmesh.common.codecs.cachegen import CacheGenCodec, CacheGenParams
from kvmesh.common.codecs.lossless import Lz4Codec, Lz4Params, ZstdCodec, ZstdParams

__all__ = [
    "CODEC_TYPES",
    "CacheGenCodec",
    "CacheGenParams",
    "Codec",
    "CodecError",
    "CodecId",
    "KVLayout",
    "Lz4Codec",
    "Lz4Params",
    "ZstdCodec",
    "ZstdParams",
    "codec_by_id",
    "codec_from_config",
    "make_codec",
]

CODEC_TYPES: dict[CodecId, type[Codec]] = {
    CodecId.ZSTD: ZstdCodec,
    CodecId.LZ4: Lz4Codec,
    CodecId.CACHEGEN: CacheGenCodec,
}
_BY_NAME = {cls.name: cls for cls in CODEC_TYPES.values()}
# Decoders need no settings (a payload carries what it needs), so one instance per id
# serves every reader.
_DECODERS: dict[CodecId, Codec] = {}


def codec_by_id(codec_id: int) -> Codec:
    """The codec that decodes payloads stored under codec_id; CodecError for an id
    this build does not know (a newer writer's), which a reader treats as a miss."""
    try:
        cid = CodecId(codec_id)
        cls = CODEC_TYPES[cid]
    except (ValueError, KeyError):
        raise CodecError(f"unknown codec id {codec_id}") from None
    codec = _DECODERS.get(cid)
    if codec is None:
        codec = _DECODERS[cid] = cls()
    return codec


def make_codec(name: str, params: msgspec.Struct | dict | None = None) -> Codec | None:
    """The codec a config names ("none" gives None), with params (its params Struct,
    or a dict validated into it)."""
    if name == "none":
        return None
    cls = _BY_NAME.get(name)
    if cls is None:
        raise ValueError(f"unknown codec {name!r} (known: none, {', '.join(_BY_NAME)})")
    if params is None:
        return cls()
    if isinstance(params, dict):
        ptype = type(cls().params)
        params = msgspec.convert(params, ptype)
    return cls(params)  # type: ignore[call-arg]


def codec_from_config(compression: str, cachegen: msgspec.Struct | None = None) -> Codec | None:
    """The codec a tier's `compression` key names, cachegen with the tier's `cachegen`
    settings (a config Struct with the fields of CacheGenParams)."""
    if compression == "cachegen" and cachegen is not None:
        return CacheGenCodec(msgspec.convert(msgspec.to_builtins(cachegen), CacheGenParams))
    return make_codec(compression)

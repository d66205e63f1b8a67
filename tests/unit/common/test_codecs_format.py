"""The stored formats codecs depend on, byte for byte: a cachegen payload and a
version 2 chunk file header written by this release must decode the same in every
later one (files and remote values outlive the process that wrote them). If one of
these tests fails, the change breaks stored chunks: give it a new codec id or header
version instead."""

from __future__ import annotations

import torch

from kvmesh.common.chunk_codec import FILE_LAYOUT, ChunkHeader, Codec
from kvmesh.common.codecs import KVLayout, codec_by_id
from kvmesh.common.keys import ChunkKey
from kvmesh.common.memory import MemoryFormat

# CacheGenCodec() (layer_bits (6, 5, 4), zstd level 1, 4-layer segments) over
# sin(arange(48) * 0.37 - 3) as fp16 [2, 2, 4, 3] KV_2LTD, as written on 2026-11-25.
CACHEGEN_PAYLOAD = bytes.fromhex(
    "2c00000083aa6c617965725f6269747393060504aa7a7374645f6c6576656c01ae7365676d656e745f"
    "6c617965727304002073bf00a07fbf00a069bf00e0c8be00401ebe006000bf7a9ea53c5996d53c0cc3e8"
    "3c721cb13c4992863ce438c23c2100000028b52ffd2018c10000281405000723182c3b30381c0c171f0f"
    "3c2d3328201d051400a07fbf000069bf00a073bf004068bf002074bf00807fbfdf7b833d29a5783d0821"
    "6a3d29a56c3de79c803d3ae7813d2100000028b52ffd2018c100001f1f1f02000019140f1e040a100f12"
    "0f1110181e04100a05"
)
CACHEGEN_DECODED = bytes.fromhex(
    "83b0a2b72aba99bbfdbb4dbba8b962b612a82f352739053bef3bc63b903a5738c933d8b0c2b74fba9dbb"
    "fdbb48bbc9b947b610a941352a390b3bf03bc23b843a5538d132f2b003b855baa1bbfcbb42bb9fb9d2b5"
    "33a9d8353539123bf23bbf3b"
)
# A compressed chunk's file header (version 2), its 162 used bytes.
FILE_V2_HEADER = bytes.fromhex(
    "4b564d4553484c33020000100100040062666c6f61743136000000000000000002000000000000000300"
    "000000000000000100000000000080000000000000000000000000000000000000000000000000000000"
    "0000000000000000000000000000060000000000efcdab896745230100002a36fe9c97170123456789ab"
    "cdef000102030405060708090a0b0c0d0e0f0300a086010000000000655fcd057e15bebc"
)


def test_a_stored_cachegen_payload_decodes_to_the_same_bytes() -> None:
    layout = KVLayout((2, 2, 4, 3), "float16", int(MemoryFormat.KV_2LTD))
    out = codec_by_id(Codec.CACHEGEN).decode(CACHEGEN_PAYLOAD, layout)
    assert out.view(torch.uint8).numpy().tobytes() == CACHEGEN_DECODED


def test_a_stored_version_2_file_header_parses_the_same() -> None:
    raw = FILE_V2_HEADER + bytes(FILE_LAYOUT.size - len(FILE_V2_HEADER))
    want = ChunkHeader(
        ChunkKey("0123456789abcdef", bytes(range(16))),
        (2, 3, 256, 128),
        torch.bfloat16,
        MemoryFormat.KV_2LTD,
        393216,
        0x0123456789ABCDEF,
        codec=Codec.CACHEGEN,
        stored_nbytes=100000,
        written_ns=1_700_000_000_000_000_000,
    )
    assert FILE_LAYOUT.parse(raw) == want
    assert FILE_LAYOUT.pack(want) == raw

"""Stored chunks from a hostile or broken peer, decoded in-process: headers whose own
checksum is right but whose fields are anything (huge, zero or odd dims, any dtype
name, any codec), payloads that are noise, and real payloads with bytes flipped, cut
or appended, all through what a tier's read path runs (parse, key check, a pool page
of the header's shape, decode_chunk).

Each must end as a miss (CorruptChunk, or the pool's ValueError for a shape that does
not fit a page) within a bounded allocation; a chunk that does decode must be the very
bytes that were stored under that header (lossless) or pass the stored checksum
(cachegen, which is checked before decoding).
"""

from __future__ import annotations

import math
import tracemalloc

import pytest
import torch
import xxhash
from fuzzkit import fuzz_for
from hypothesis import strategies as st

from kvmesh.common.chunk_codec import (
    FILE_LAYOUT,
    VALUE_LAYOUT,
    CorruptChunk,
    check_key,
)
from kvmesh.common.codecs import CacheGenCodec, Lz4Codec, ZstdCodec
from kvmesh.common.codecs.stored import decode_chunk, encode_chunk
from kvmesh.common.keys import ChunkKey
from kvmesh.common.memory import HostMemoryPool, MemoryFormat

KEY = ChunkKey("0123456789abcdef", bytes(range(16)))
PAGE = 1 << 18
# A decode may allocate its output and a few buffers of its size, never what a
# header or frame merely claims.
ALLOC_LIMIT = 16 * PAGE
CODECS = [None, ZstdCodec(), Lz4Codec(), CacheGenCodec()]
DTYPE_NAMES = ["float16", "bfloat16", "float32", "uint8", "int64", "bool", "qint8", "nope", ""]
DIMS = [0, 1, 2, 3, 16, 255, 2**31, 2**32, 2**62, 2**63, 2**64 - 1]


@pytest.fixture(scope="module")
def pool():
    p = HostMemoryPool(64 * PAGE, PAGE, pin_memory=False)
    yield p
    p.close()


def real_chunk(pool: HostMemoryPool, codec, tokens: int, seed: int):
    """(header, payload, the chunk's bytes) of a smooth fp16 chunk stored via codec."""
    g = torch.Generator().manual_seed(seed)
    x = torch.cumsum(torch.randn(2, 2, tokens, 32, generator=g) * 0.1, 2).half()
    obj = pool.allocate(torch.Size(x.shape), x.dtype, MemoryFormat.KV_2LTD)
    try:
        obj.tensor.copy_(x)
        header, payload, _ = encode_chunk(KEY, obj, codec)
        return header, bytes(payload), bytes(obj.raw.numpy())
    finally:
        obj.ref_down()


def forged_header(layout, draw_fields: dict) -> bytes:
    """A header of layout with arbitrary fields and a correct header checksum."""
    body = bytearray(layout.pack(draw_fields["template"]))
    f = draw_fields
    if layout is VALUE_LAYOUT:
        body[5] = f["codec"] & 0xFF
        body[6] = f["fmt"] & 0xFF
        body[7] = f["ndim"] & 0xFF
        body[8:24] = f["dtype"].encode()[:16].ljust(16, b"\0")
        for i, d in enumerate(f["shape"][:8]):
            body[24 + 8 * i : 32 + 8 * i] = d.to_bytes(8, "little")
        body[88:96] = f["nbytes"].to_bytes(8, "little")
        body[96:104] = f["stored"].to_bytes(8, "little")
        used = 136
    else:
        body[12:14] = (f["fmt"] & 0xFFFF).to_bytes(2, "little")
        body[14:16] = (f["ndim"] & 0xFFFF).to_bytes(2, "little")
        body[16:32] = f["dtype"].encode()[:16].ljust(16, b"\0")
        for i, d in enumerate(f["shape"][:8]):
            body[32 + 8 * i : 40 + 8 * i] = d.to_bytes(8, "little")
        body[96:104] = f["nbytes"].to_bytes(8, "little")
        used = 144
        if body[8] == 2:
            body[144:146] = (f["codec"] & 0xFFFF).to_bytes(2, "little")
            body[146:154] = f["stored"].to_bytes(8, "little")
            used = 154
    body[used : used + 8] = xxhash.xxh3_64_intdigest(bytes(body[:used])).to_bytes(8, "little")
    return bytes(body)


u64 = st.one_of(st.sampled_from(DIMS), st.integers(0, 2**64 - 1))
cases = st.fixed_dictionaries(
    {
        "codec": st.sampled_from(range(len(CODECS))),
        "layout": st.sampled_from(["value", "file"]),
        "tokens": st.integers(1, 64),
        "seed": st.integers(0, 2**16),
        "mode": st.sampled_from(["forge", "flip", "cut", "append", "noise"]),
        "consistent": st.booleans(),
        "fields": st.fixed_dictionaries(
            {
                "codec": st.integers(0, 5),
                "fmt": st.integers(0, 7),
                "ndim": st.integers(0, 9),
                "dtype": st.sampled_from(DTYPE_NAMES),
                "shape": st.lists(u64, min_size=8, max_size=8),
                "nbytes": u64,
                "stored": u64,
            }
        ),
        "at": st.integers(0, 2**20),
        "noise": st.binary(max_size=4096),
    }
)


def decode_one(pool: HostMemoryPool, case: dict) -> None:
    codec = CODECS[case["codec"]]
    header, payload, raw = real_chunk(pool, codec, case["tokens"], case["seed"])
    layout = VALUE_LAYOUT if case["layout"] == "value" else FILE_LAYOUT
    head = layout.pack(header)
    mode = case["mode"]
    if mode == "forge":
        fields = dict(case["fields"])
        dtype = getattr(torch, fields["dtype"], None) if fields["dtype"].isidentifier() else None
        if case["consistent"] and isinstance(dtype, torch.dtype) and fields["ndim"] <= 8:
            # A length that matches the shape, so the forgery passes the header's checks.
            n = dtype.itemsize * math.prod(fields["shape"][: fields["ndim"]])
            if n < 2**64:
                fields["nbytes"] = n
                if fields["codec"] == 0:
                    fields["stored"] = n
        head = forged_header(layout, {**fields, "template": header})
    elif mode == "flip":
        b = bytearray(payload)
        if b:
            b[case["at"] % len(b)] ^= 1 << (case["at"] % 8)
        payload = bytes(b)
    elif mode == "cut":
        payload = payload[: case["at"] % (len(payload) + 1)]
    elif mode == "append":
        payload = payload + case["noise"]
    else:
        payload = case["noise"]
    try:
        got = layout.parse(head)
        check_key(got, KEY)
        out = pool.allocate(torch.Size(got.shape), got.dtype, got.fmt)
    except (CorruptChunk, ValueError, RuntimeError, TypeError):
        return  # refused before decoding: a miss
    assert out is not None, "the pool ran out: a page leaked"
    try:
        decode_chunk(got, payload, out)
        ok = True
    except CorruptChunk:
        ok = False
    try:
        if ok and got == header and got.codec.lossless:
            assert bytes(out.raw.numpy()) == raw, "a lossless chunk decoded to other bytes"
        if ok and got != header:
            assert got.codec.lossless or got.stored_nbytes == len(payload)
    finally:
        out.ref_down()


def test_hostile_stored_chunks_are_misses_not_crashes(pool: HostMemoryPool) -> None:
    def run_batch(case: dict) -> None:
        tracemalloc.start()
        try:
            decode_one(pool, case)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < ALLOC_LIMIT, f"{peak} bytes allocated decoding {case['mode']}"
        assert pool.free_pages == pool.num_pages, "a page was not given back"

    assert fuzz_for("stored chunks", cases, run_batch) > 0

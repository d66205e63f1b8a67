"""kvmesh.common.keys: namespace ids, chunk keys and their string form."""

from __future__ import annotations

import re

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvmesh.common import keys as keys_mod
from kvmesh.common.keys import ChunkKey, KeyNamespace

BASE = {
    "model": "meta-llama/Llama-3-8B",
    "kv_layout": "LBHNC",
    "dtype": "float16",
    "world_size": 4,
    "rank": 1,
    "tenant": "",
}
KEY_STR_RE = re.compile(r"[0-9a-f]{16}-[0-9a-f]{32}")


def make_ns(**changes: object) -> KeyNamespace:
    return KeyNamespace(**{**BASE, **changes})  # type: ignore[arg-type]


def test_ns_id_is_16_hex_of_an_8_byte_digest() -> None:
    ns = make_ns()
    assert len(ns.digest()) == 8
    assert ns.ns_id == ns.digest().hex()
    assert re.fullmatch(r"[0-9a-f]{16}", ns.ns_id)


def test_ns_id_is_pinned() -> None:
    # A changed id orphans every stored chunk: this fails if the encoding drifts.
    assert make_ns().ns_id == "21b8875084c24613"


@pytest.mark.parametrize(
    "field, value",
    [
        ("model", "meta-llama/Llama-3-70B"),
        ("kv_layout", "LBNHC"),
        ("dtype", "bfloat16"),
        ("world_size", 8),
        ("rank", 2),
        ("tenant", "acme"),
    ],
)
def test_every_field_changes_the_id(field: str, value: object) -> None:
    assert make_ns(**{field: value}).ns_id != make_ns().ns_id


def test_field_boundaries_are_unambiguous() -> None:
    # Length prefixes: moving a character between adjacent strings changes the id.
    a = make_ns(model="ab", kv_layout="c")
    b = make_ns(model="a", kv_layout="bc")
    assert a.ns_id != b.ns_id


names = st.text(min_size=1, max_size=12)


@given(
    st.tuples(names, names, names, st.integers(1, 4), st.integers(0, 3), st.text(max_size=6)),
    st.tuples(names, names, names, st.integers(1, 4), st.integers(0, 3), st.text(max_size=6)),
)
def test_ids_equal_exactly_when_namespaces_equal(a: tuple, b: tuple) -> None:
    def build(t: tuple) -> KeyNamespace:
        model, layout, dtype, world, rank, tenant = t
        return KeyNamespace(
            model=model,
            kv_layout=layout,
            dtype=dtype,
            world_size=world,
            rank=rank % world,
            tenant=tenant,
        )

    na, nb = build(a), build(b)
    assert (na == nb) == (na.ns_id == nb.ns_id)


def test_namespace_is_hashable_and_equal_by_fields() -> None:
    assert make_ns() == make_ns()
    assert hash(make_ns()) == hash(make_ns())
    assert len({make_ns(), make_ns(), make_ns(rank=0)}) == 2


def test_with_rank() -> None:
    ns = make_ns()
    other = ns.with_rank(3)
    assert other.rank == 3
    assert (other.model, other.kv_layout, other.dtype, other.world_size, other.tenant) == (
        ns.model,
        ns.kv_layout,
        ns.dtype,
        ns.world_size,
        ns.tenant,
    )
    assert other.ns_id != ns.ns_id
    assert other.with_rank(1) == ns
    assert other.with_rank(1).ns_id == ns.ns_id
    with pytest.raises(ValueError):
        ns.with_rank(4)


def test_same_chunk_at_another_rank_needs_no_rehash() -> None:
    ns = make_ns()
    key = ns.key(bytes(range(16)))
    moved = ns.with_rank(0).key(key.chunk_hash)
    assert moved.chunk_hash == key.chunk_hash
    assert moved.namespace_id == ns.with_rank(0).ns_id != key.namespace_id


@pytest.mark.parametrize(
    "changes, error",
    [
        ({"world_size": 0}, ValueError),
        ({"rank": 4}, ValueError),
        ({"rank": -1}, ValueError),
        ({"model": ""}, ValueError),
        ({"kv_layout": ""}, ValueError),
        ({"dtype": ""}, ValueError),
        ({"model": 3}, TypeError),
        ({"tenant": None}, TypeError),
        ({"rank": 1.0}, TypeError),
        ({"world_size": True}, TypeError),
    ],
)
def test_invalid_namespaces_are_rejected(changes: dict, error: type[Exception]) -> None:
    with pytest.raises(error):
        make_ns(**changes)


def test_namespace_survives_msgpack_and_keeps_its_id() -> None:
    ns = make_ns(tenant="acme")
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(ns), type=KeyNamespace)
    assert decoded == ns
    assert decoded.ns_id == ns.ns_id
    # The cached id is not part of the encoding.
    assert b"_digest" not in msgspec.msgpack.encode(ns)


def test_decoding_an_invalid_namespace_fails() -> None:
    raw = msgspec.msgpack.encode({**BASE, "rank": 9})
    with pytest.raises((msgspec.ValidationError, ValueError)):
        msgspec.msgpack.decode(raw, type=KeyNamespace)


def test_fields_too_large_for_the_id_encoding_are_value_errors_naming_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The id packs world_size and rank as u64: past that, a ValueError naming the field
    # (struct.error named none, and msgspec let it escape a decode as is).
    with pytest.raises(ValueError, match="world_size"):
        make_ns(world_size=2**64, rank=0)
    assert make_ns(world_size=2**64 - 1, rank=2**64 - 2).ns_id
    raw = msgspec.json.encode({**BASE, "world_size": 2**64, "rank": 0})
    with pytest.raises(msgspec.ValidationError, match="world_size"):
        msgspec.json.decode(raw, type=KeyNamespace)
    # A string's UTF-8 length is packed as u32: lowered here, since 4 GiB strings are
    # too large for a unit test.
    monkeypatch.setattr(keys_mod, "_MAX_STR_BYTES", 8)
    short = {"model": "m", "kv_layout": "l", "dtype": "d", "tenant": "t"}
    for field in short:
        with pytest.raises(ValueError, match=f"KeyNamespace.{field} "):
            make_ns(**{**short, field: "é" * 5})  # 5 chars, 10 bytes
    assert make_ns(**{**short, "model": "x" * 8}).ns_id


@given(st.binary(min_size=16, max_size=16), st.binary(min_size=8, max_size=8))
def test_string_round_trip(chunk_hash: bytes, ns_digest: bytes) -> None:
    key = ChunkKey(ns_digest.hex(), chunk_hash)
    text = key.to_str()
    assert KEY_STR_RE.fullmatch(text)
    assert ChunkKey.from_str(text) == key


def test_string_form_is_a_safe_file_name() -> None:
    text = make_ns().key(b"\xff" * 16).to_str()
    assert text == f"{make_ns().ns_id}-{'ff' * 16}"
    assert set(text) <= set("0123456789abcdef-")


VALID = "0123456789abcdef-" + "0123456789abcdef" * 2


@pytest.mark.parametrize(
    "text",
    [
        "",
        VALID.upper(),
        VALID + "\n",
        " " + VALID,
        VALID.replace("-", ""),
        VALID.replace("-", "_"),
        VALID + "0",
        VALID[:-1],
        "0123456789abcde-" + "0" * 33,
        "g123456789abcdef-" + "0" * 32,
        "0123456789abcdef-" + "0" * 31 + "z",
        "../../etc/passwd",
        "0123456789abcdef--" + "0" * 31,
    ],
)
def test_malformed_strings_are_rejected(text: str) -> None:
    ChunkKey.from_str(VALID)  # the template itself parses
    with pytest.raises(ValueError):
        ChunkKey.from_str(text)


@pytest.mark.parametrize("value", [None, b"0123456789abcdef-" + b"0" * 32, 42])
def test_non_strings_are_rejected(value: object) -> None:
    with pytest.raises(ValueError):
        ChunkKey.from_str(value)  # type: ignore[arg-type]


def test_keys_work_as_dict_keys() -> None:
    ns = make_ns()
    keys = [ns.key(i.to_bytes(16, "little")) for i in range(1000)]
    table = {k: i for i, k in enumerate(keys)}
    # Fresh, equal objects find the same entries.
    for i in range(1000):
        assert table[ChunkKey(ns.ns_id, i.to_bytes(16, "little"))] == i
    assert ChunkKey(ns.with_rank(0).ns_id, keys[0].chunk_hash) not in table
    assert sorted(reversed(keys)) == sorted(keys)


def test_key_rejects_wrong_hash_length() -> None:
    with pytest.raises(ValueError):
        make_ns().key(b"short")


def test_key_wire_form_is_a_validated_pair() -> None:
    key = make_ns().key(bytes(16))
    raw = msgspec.msgpack.encode(key)
    assert msgspec.msgpack.decode(raw) == [key.namespace_id, key.chunk_hash]
    assert msgspec.msgpack.decode(raw, type=ChunkKey) == key
    for bad in (
        ["0123", bytes(16)],
        [key.namespace_id, bytes(15)],
        [key.namespace_id.upper(), bytes(16)],
    ):
        with pytest.raises(msgspec.ValidationError):
            msgspec.msgpack.decode(msgspec.msgpack.encode(bad), type=ChunkKey)

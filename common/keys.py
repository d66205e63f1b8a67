"""Chunk keys: whose KV a chunk is (the namespace) and which tokens it holds (the hash).

A `KeyNamespace` names one engine's KV format: model, KV layout, dtype, world size,
rank and an optional tenant salt. Two engines share a chunk only if every field
matches, so two models, two layouts, two ranks or two tenants can never read each
other's KV.

A `ChunkKey` holds only the namespace's 16-hex-char id, never the namespace object:
keys are created by the million and travel on the wire, while the namespace is one
object per engine (the engine maps id → namespace where it needs the fields). The
chunk hash (see kvmesh.common.tokendb) covers the tokens only, so the same chunk at
another rank is `ns.with_rank(r).key(key.chunk_hash)`, with no rehashing.

Both ids are stable across processes, machines and Python versions: they come from
explicit byte encodings hashed with fixed algorithms, never from Python's `hash()`.
"""

from __future__ import annotations

import hashlib
import re
import struct
from typing import Annotated, ClassVar

import msgspec

NS_ID_HEX_LEN = 16
CHUNK_HASH_LEN = 16

# Bumping the version changes every namespace id: do it only when the meaning of a
# field changes, since it orphans every stored chunk.
_NS_ENCODING_TAG = b"kvmesh-namespace\x00v1\x00"
_NS_PERSON = b"kvmesh-ns-v1"  # blake2b personalisation: no other use of blake2b collides

# A ChunkKey.to_str(): its one spelling (fullmatch). The controller and its feeds
# check key strings from the wire against it too.
KEY_STRING = re.compile(r"[0-9a-f]{16}-[0-9a-f]{32}")
_U64 = struct.Struct("<Q")
_U32 = struct.Struct("<I")
# What the id's encoding can hold: a string field's UTF-8 length is a u32, an int a u64.
_MAX_STR_BYTES = (1 << 32) - 1
_MAX_U64 = (1 << 64) - 1


class ChunkKey(msgspec.Struct, frozen=True, array_like=True, gc=False, order=True):
    """The key of one stored chunk: `(namespace id, 16-byte chunk hash)`.

    Hashable and cheap to compare (two fields, no cycles, so `gc=False`). Building one
    directly trusts the caller, to keep the hot path free of checks; decoding one from
    msgpack/JSON with `type=ChunkKey` validates both fields, and `from_str` validates
    its input. `hash(key)` is per-process: persist `to_str()`, never `hash()`.
    """

    namespace_id: Annotated[str, msgspec.Meta(pattern=r"^[0-9a-f]{16}\Z")]
    chunk_hash: Annotated[bytes, msgspec.Meta(min_length=16, max_length=16)]

    def to_str(self) -> str:
        """`"<16 hex ns id>-<32 hex hash>"`: stable, and a safe file name ([0-9a-f-])."""
        return f"{self.namespace_id}-{self.chunk_hash.hex()}"

    @classmethod
    def from_str(cls, s: str) -> ChunkKey:
        """Parse `to_str()` output; anything else (upper case included) is a ValueError.

        Only the canonical lower-case form is accepted, so one key has exactly one
        string and one file name.
        """
        if not isinstance(s, str) or KEY_STRING.fullmatch(s) is None:
            raise ValueError(f"malformed chunk key string: {s!r}")
        return cls(s[:NS_ID_HEX_LEN], bytes.fromhex(s[NS_ID_HEX_LEN + 1 :]))


def _encode_str(field: str, value: str) -> bytes:
    raw = value.encode("utf-8")
    if len(raw) > _MAX_STR_BYTES:
        raise ValueError(
            f"KeyNamespace.{field} is {len(raw)} bytes in UTF-8, over {_MAX_STR_BYTES}"
        )
    # Length prefixes keep ("ab", "c") and ("a", "bc") apart.
    return _U32.pack(len(raw)) + raw


class KeyNamespace(msgspec.Struct, frozen=True, kw_only=True, dict=True):
    """The KV format an engine stores: chunks are shared only within one namespace.

    `tenant` is a salt: engines configured with different salts never share a chunk
    even when everything else matches. The id is computed once, at construction (and
    on decode or `msgspec.structs.replace`, which also run `__post_init__`).
    """

    model: str
    kv_layout: str
    dtype: str
    world_size: int
    rank: int
    tenant: str = ""

    # Set in __post_init__ (outside the Struct's fields, so they are neither encoded
    # nor compared): the id is read on every key built, so it is computed only once.
    _digest: ClassVar[bytes]
    _ns_id: ClassVar[str]

    def __post_init__(self) -> None:
        for name in ("model", "kv_layout", "dtype", "tenant"):
            if not isinstance(getattr(self, name), str):
                raise TypeError(f"KeyNamespace.{name} must be a str")
        for name in ("model", "kv_layout", "dtype"):
            if not getattr(self, name):
                raise ValueError(f"KeyNamespace.{name} must not be empty")
        for name in ("world_size", "rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"KeyNamespace.{name} must be an int")
        # Checked here, not left to struct.pack: its struct.error names no field and is
        # no ValueError, which msgspec would not turn into a ValidationError on decode.
        if not 1 <= self.world_size <= _MAX_U64:
            raise ValueError(
                f"KeyNamespace.world_size must be in [1, 2**64), got {self.world_size}"
            )
        if not 0 <= self.rank < self.world_size:
            raise ValueError(
                f"KeyNamespace.rank must be in [0, {self.world_size}), got {self.rank}"
            )
        digest = hashlib.blake2b(
            self._canonical_bytes(), digest_size=NS_ID_HEX_LEN // 2, person=_NS_PERSON
        ).digest()
        msgspec.structs.force_setattr(self, "_digest", digest)
        msgspec.structs.force_setattr(self, "_ns_id", digest.hex())

    def __copy__(self) -> KeyNamespace:
        # msgspec's own copy copies the fields but not the id set in __post_init__,
        # leaving a namespace whose key() raises. A frozen value is its own copy.
        return self

    def _canonical_bytes(self) -> bytes:
        # An explicit encoding rather than msgpack: the id must not change if a
        # serialiser's choices do. rank < world_size, so both fit a u64.
        return b"".join(
            (
                _NS_ENCODING_TAG,
                _encode_str("model", self.model),
                _encode_str("kv_layout", self.kv_layout),
                _encode_str("dtype", self.dtype),
                _U64.pack(self.world_size),
                _U64.pack(self.rank),
                _encode_str("tenant", self.tenant),
            )
        )

    def digest(self) -> bytes:
        """Stable 8-byte digest of every field (blake2b, so a tenant cannot pick a salt
        that lands on another namespace's id)."""
        return self._digest

    @property
    def ns_id(self) -> str:
        """The digest as 16 lower-case hex chars: what every ChunkKey carries."""
        return self._ns_id

    def with_rank(self, rank: int) -> KeyNamespace:
        """This namespace at another rank (TP peers, MLA's rank-0 copy)."""
        return msgspec.structs.replace(self, rank=rank)

    def key(self, chunk_hash: bytes) -> ChunkKey:
        """The key of chunk_hash in this namespace."""
        if len(chunk_hash) != CHUNK_HASH_LEN:
            raise ValueError(f"chunk hash must be {CHUNK_HASH_LEN} bytes, got {len(chunk_hash)}")
        return ChunkKey(self._ns_id, bytes(chunk_hash))

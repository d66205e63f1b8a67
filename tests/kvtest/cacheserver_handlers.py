"""The cache-server's request handlers over a store, without sockets, for unit tests."""

from __future__ import annotations

import time

from kvmesh.common.observability import Metrics
from kvmesh.services.cacheserver.handlers import Handlers
from kvmesh.services.cacheserver.stats import ServerStats
from kvmesh.services.cacheserver.store import MemoryStore


def handlers(store: MemoryStore) -> Handlers:
    return Handlers(
        store,
        ServerStats(Metrics()),
        server_name="t",
        request_timeout_s=1.0,
        started=time.monotonic(),
        connections=lambda: 0,
    )

"""The interface of a remote store behind the remote tier, and the URL that picks one.

| URL | connector |
|---|---|
| `kvmesh://host:port` | the cache-server (remote_kvmesh.py) |
| `redis://[user:pass@]host:port[/db]`, `rediss://...` | one Redis, plain or TLS (remote_redis.py) |
| `redis-cluster://[user:pass@]host:port[,host:port...]` | a Redis Cluster (remote_redis.py) |
| `fs:///path` | a shared filesystem, disk-tier file format (remote_fs.py) |
| any other `scheme://...` | the `kvmesh.connectors` plugin named `scheme` |

`remote.connector` names a plugin outright (an entry point, or `package.module:factory`)
whatever the scheme. A connector plugin's factory is called as
`factory(url, key_prefix=..., timeout_s=...)` and returns a Connector: it stores the
packed header and the payload it is given, and `get` answers them back as a Fetched (the
header as given, or parsed back from the packed bytes; the tier verifies the checksum,
so a store that corrupts a value yields a miss, never wrong KV).

Optional: `get_into(key, place)`, a get that can receive the payload in place. Once
the header is known it calls `place(header, nbytes)`, which returns a writable buffer
of nbytes (an L1 page) or None; when it returns a buffer, the Fetched's payload must be
that buffer, and nothing may be written into it after get_into returns or raises. The
tier uses it when a connector has it (the cache-server's data connections) and verifies
the chunk in place; a connector without it is read through `get`.

A connector's coroutines run on the engine's event loop; the tier applies deadlines
around them and treats any exception as a failed request (a miss); `ValueRefused` from
`put` drops that put without counting against the store's health.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from kvmesh.common.chunk_codec import ChunkHeader, Payload
from kvmesh.common.keys import ChunkKey
from kvmesh.common.plugins import CONNECTORS_GROUP, PluginError, build, installed, wrong_kinds
from kvmesh.common.redact import redact_url

if TYPE_CHECKING:
    from kvmesh.common.transport.curve import CurveKeys

SCHEMES = ("kvmesh", "redis", "rediss", "redis-cluster", "fs")


class ValueRefused(Exception):
    """The store will not take this value (larger than it admits): that put is
    dropped, but the store is not down, so it is no health failure and what the tier
    remembers of the store's keys still holds (its gets go on). A connector raises it
    when the store answered so, or when it knows the store's limit and the value is
    over it (the cache-server drops the whole connection, and every request on it,
    for a value past its frame limit). `result`: the put's label in
    `remote_puts_total`."""

    result = "too_large"


class StoreFull(ValueRefused):
    """The store has no room for writes (a full or over-quota filesystem, a Redis at
    maxmemory with noeviction): puts are dropped while reads still work."""

    result = "store_full"


@dataclass(slots=True)
class Fetched:
    """A value read back: its parsed header and its payload (still to be verified;
    one buffer, or a list of buffers to be read in order). `keepalive` holds whatever
    owns the payload's memory (e.g. ZMQ frames)."""

    header: ChunkHeader
    payload: Payload
    keepalive: Any = None


class Connector(Protocol):
    scheme: str
    # Whether values may be stored compressed (fs:// keeps the disk tier's format).
    compresses: bool

    @property
    def display(self) -> str:
        """The URL without credentials, for logs."""
        ...

    async def reconnect(self) -> None:
        """(Re)open the connection; also the first open."""
        ...

    async def ping(self) -> None: ...

    async def put(self, key: ChunkKey, header: ChunkHeader, packed: bytes, payload: Any) -> None:
        """Store the value; returns once the payload's memory is no longer needed."""
        ...

    async def get(self, key: ChunkKey) -> Fetched | None: ...

    async def exists(self, keys: Sequence[ChunkKey]) -> list[bool]: ...

    async def delete(self, keys: Sequence[ChunkKey]) -> int: ...

    async def clear(self, namespace_ids: Sequence[str]) -> int:
        """Delete every value of these namespaces; how many were deleted."""
        ...

    def connected(self) -> bool | None:
        """False when the connector knows its connection is gone; None if it cannot tell.

        A connector may also have an int attribute `disconnects`, the connections it has
        lost: the tier then forgets the keys it remembers as present whenever it grows
        (the store may have restarted empty, even between two health checks)."""
        ...

    async def close(self) -> None: ...


def make_connector(
    url: str,
    *,
    key_prefix: str = "kvmesh:",
    timeout_s: float = 1.0,
    curve: CurveKeys | None = None,
    connector: str = "",
) -> Connector:
    """The connector for url (ValueError for an unknown scheme or a malformed URL,
    PluginError for a plugin that fails); curve: the CurveKeys a kvmesh:// connection
    uses (None: plain); connector: a plugin that overrides the scheme."""
    scheme = url.partition("://")[0].lower()
    if connector or (scheme not in SCHEMES and scheme in installed(CONNECTORS_GROUP)):
        return _plugin_connector(connector or scheme, url, key_prefix, timeout_s)
    if scheme == "kvmesh":
        from kvmesh.services.worker.tiers.remote_kvmesh import KvmeshConnector

        return KvmeshConnector(url, key_prefix=key_prefix, timeout_s=timeout_s, curve=curve)
    if scheme in ("redis", "rediss", "redis-cluster"):
        from kvmesh.services.worker.tiers.remote_redis import RedisConnector

        return RedisConnector(url, key_prefix=key_prefix, timeout_s=timeout_s)
    if scheme == "fs":
        from kvmesh.services.worker.tiers.remote_fs import FsConnector

        return FsConnector(url)
    raise ValueError(f"unknown remote URL scheme {scheme!r} in {redact_url(url)!r}; use {SCHEMES}")


_CONNECTOR_MEMBERS = (
    "scheme", "compresses", "display", "reconnect", "ping", "put", "get", "exists", "delete",
    "clear", "connected", "close",
)  # fmt: skip


def _plugin_connector(spec: str, url: str, key_prefix: str, timeout_s: float) -> Connector:
    conn = build(CONNECTORS_GROUP, spec, url, key_prefix=key_prefix, timeout_s=timeout_s)
    missing = [m for m in _CONNECTOR_MEMBERS if not hasattr(conn, m)]
    if missing:
        raise PluginError(
            f"{CONNECTORS_GROUP} plugin {spec!r} returned a {type(conn).__name__} without "
            f"{', '.join(missing)}: not a Connector"
        )
    # The tier awaits these: a plain function there fails every request at run time
    # (the store flaps down and up) instead of stopping the engine at startup.
    wrong = wrong_kinds(conn, _CONNECTOR_ASYNC, ("connected",), optional=("get_into",))
    if wrong:
        raise PluginError(
            f"{CONNECTORS_GROUP} plugin {spec!r} returned a {type(conn).__name__} that "
            f"breaks the Connector protocol: {'; '.join(wrong)}"
        )
    return conn


_CONNECTOR_ASYNC = (
    "reconnect", "ping", "put", "get", "exists", "delete", "clear", "close", "get_into",
)  # fmt: skip

"""The configuration schema: one frozen Struct per service, nested under KvmeshConfig.

Every field has a default, so an empty file is a valid config. Single-field limits are
`msgspec.Meta` constraints (checked when decoding); rules that relate two fields live
in `__post_init__` and raise RuleError naming the field the user should change.
docs/configuration.md describes every key; keep the two in step.
"""

from __future__ import annotations

import ipaddress
from typing import Annotated, Any, Literal

import msgspec

from kvmesh.common.config.endpoints import host_port_problem, remote_url_problem
from kvmesh.common.config.sizes import ByteSize, format_size
from kvmesh.common.redact import redact_url

Port = Annotated[int, msgspec.Meta(ge=0, le=65535)]
# 0 is how a port field says "off" (metrics) or "let the OS pick" (tests).
PositiveInt = Annotated[int, msgspec.Meta(gt=0)]
PositiveSeconds = Annotated[float, msgspec.Meta(gt=0)]

HashAlgorithm = Literal["xxh3_128", "blake3"]
EvictionPolicy = Literal["lru", "lfu", "fifo", "mru"]
LogLevel = Literal["debug", "info", "warning", "error"]

# A chunk file is a 4 KiB header plus the chunk: below 1 MiB a disk tier holds nothing useful.
_MIN_DISK_SIZE = 1024 * 1024


class RuleError(ValueError):
    """A cross-field rule failed.

    `field` is the key (within its Struct) to change; `related` names the other keys the
    rule reads, so the error can say where their values came from.
    """

    def __init__(self, field: str, message: str, related: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.field = field
        self.related = related


ZMQ_ENDPOINT_FORMS = "tcp://host:port or ipc://path"


def is_zmq_endpoint(url: str) -> bool:
    """Whether the sockets take url. Checked here because zmq refuses anything else
    only at connect time, with a traceback."""
    scheme, sep, rest = url.partition("://")
    if sep and scheme == "ipc":
        return bool(rest.strip())
    # zmq cuts the port at the last ':' and takes an IPv6 address bare or in brackets.
    return bool(sep and scheme == "tcp") and (
        host_port_problem(rest, bare_ipv6=True, port_required=True) is None
    )


def _check_zmq_endpoint(field: str, url: str, related: tuple[str, ...] = ()) -> None:
    if not is_zmq_endpoint(url):
        raise RuleError(
            field,
            f"expected {ZMQ_ENDPOINT_FORMS} (got {redact_url(url, malformed=True)!r})",
            related,
        )


def _check_distinct_ports(section: msgspec.Struct, names: tuple[str, ...]) -> None:
    """The ports one service binds (those set: 0 is off or any free one) differ: the
    second bind would fail at start with an address in use, naming no key."""
    seen: dict[int, str] = {}
    for name in names:
        port = getattr(section, name)
        if port and port in seen:
            raise RuleError(name, f"must differ from {seen[port]} (both are {port})", (seen[port],))
        seen.setdefault(port, name)


class _Section(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Base for every config Struct: immutable, typo-proof, keyword-only."""


class L1Config(_Section):
    """The host-memory tier, which is also the allocator every other tier copies through."""

    enabled: bool = True
    max_size: ByteSize = ByteSize("5GiB")
    reserve: ByteSize = ByteSize("2GiB")
    eviction_policy: EvictionPolicy = "lru"
    alloc_timeout_s: PositiveSeconds = 1.0

    def __post_init__(self) -> None:
        # Every store, load and transfer goes through the L1 pool, so there is no
        # engine without it: off, the engine would fail at start (a pool of 0 bytes)
        # or, with a size, keep using it. Said here, where `config check` sees it.
        if not self.enabled:
            raise RuleError(
                "enabled",
                "L1 cannot be turned off: every tier reads and writes through its pool; "
                "a smaller max_size keeps less KV in host memory",
            )
        if self.max_size == 0:
            raise RuleError(
                "max_size", "must be > 0: every tier reads and writes through the L1 pool"
            )


Compression = Literal["none", "zstd", "lz4", "cachegen"]
CacheGenBits = Annotated[int, msgspec.Meta(ge=1, le=8)]


class CacheGenConfig(_Section):
    """Settings of the lossy `cachegen` codec (common/codecs/cachegen.py).

    The layers are split into `len(layer_bits)` equal bands, first layers first; each
    value of a band is quantised per channel to that many bits. The settings travel in
    each stored chunk, so readers need none of their own.
    """

    # Bits per value of each equal band of layers, first layers first.
    layer_bits: Annotated[list[CacheGenBits], msgspec.Meta(min_length=1, max_length=64)] = (
        msgspec.field(default_factory=lambda: [6, 5, 4])
    )
    # zstd level of the entropy stage (higher: slower writes, a few percent smaller).
    zstd_level: Annotated[int, msgspec.Meta(ge=1, le=19)] = 1


class DiskConfig(_Section):
    """The local disk tier (L3): one file per chunk in a directory that survives restarts.

    Each engine (one per rank) keeps its chunks in `<path>/<namespace id>/` and bounds
    them by `max_size` on its own.
    """

    enabled: bool = False
    # No default location: a cache that silently fills the system disk is worse than
    # one that asks where to go.
    path: str = ""
    max_size: ByteSize = ByteSize("50GiB")
    io_threads: Annotated[int, msgspec.Meta(ge=1, le=64)] = 4
    o_direct: bool = True
    eviction_policy: EvictionPolicy = "lru"
    retry_s: PositiveSeconds = 30.0
    max_pending_puts: PositiveInt = 256
    # How chunk files are written: lossless (zstd, lz4) or lossy (cachegen); a reader
    # decodes any of them whatever this says.
    compression: Compression = "none"
    cachegen: CacheGenConfig = CacheGenConfig()

    def __post_init__(self) -> None:
        if self.enabled and not self.path.strip():
            raise RuleError(
                "path",
                "must be set while disk is enabled (the directory for chunk files)",
                related=("enabled",),
            )
        if self.enabled and self.max_size < _MIN_DISK_SIZE:
            raise RuleError(
                "max_size",
                f"must be at least {format_size(_MIN_DISK_SIZE)} while disk is enabled "
                f"(got {format_size(int(self.max_size))})",
                related=("enabled",),
            )


RemoteCompression = Compression
REMOTE_SCHEMES = ("kvmesh", "redis", "rediss", "redis-cluster", "fs")
NonNegativeSeconds = Annotated[float, msgspec.Meta(ge=0)]


class RemoteConfig(_Section):
    """The shared remote tier (L4), chosen by URL: `kvmesh://host:port` (the
    cache-server), `redis://`, `rediss://`, `redis-cluster://host:port[,host:port...]`,
    `fs:///path` (a shared filesystem), or a connector plugin. See docs/configuration.md."""

    enabled: bool = False
    url: str = ""
    # A connector plugin: an entry point of the `kvmesh.connectors` group or
    # `package.module:factory`. Empty: the URL's scheme picks a built-in connector, or
    # an installed plugin whose entry point is named after the scheme.
    connector: str = ""
    timeout_s: PositiveSeconds = 1.0
    lookup_timeout_s: PositiveSeconds = 0.05
    health_interval_s: PositiveSeconds = 1.0
    failures_to_down: PositiveInt = 3
    max_pending_puts: PositiveInt = 256
    compression: RemoteCompression = "none"
    compression_min_saving: Annotated[float, msgspec.Meta(ge=0, lt=1)] = 0.05
    cachegen: CacheGenConfig = CacheGenConfig()
    presence_ttl_s: NonNegativeSeconds = 5.0
    absence_ttl_s: NonNegativeSeconds = 1.0
    presence_max_keys: PositiveInt = 100_000
    key_prefix: str = "kvmesh:"

    def __post_init__(self) -> None:
        if not self.enabled:
            return
        scheme, sep, rest = self.url.partition("://")
        if self.connector or (sep and scheme.lower() not in REMOTE_SCHEMES):
            return  # a plugin's URL: its connector checks it when the engine starts
        if not sep or scheme.lower() not in REMOTE_SCHEMES:
            raise RuleError(
                "url",
                f"must be a URL with a scheme of {', '.join(REMOTE_SCHEMES)} while remote is "
                f"enabled (got {redact_url(self.url)!r})",
                related=("enabled",),
            )
        if scheme.lower() == "fs" and not rest.startswith("/"):
            raise RuleError(
                "url",
                f"fs:// needs an absolute path, as fs:///data/kv (got {redact_url(self.url)!r})",
            )
        if scheme.lower() != "fs" and (problem := remote_url_problem(self.url)) is not None:
            raise RuleError("url", problem)


class EngineControllerConfig(_Section):
    """The engine's link to the controller (registration, heartbeats, KV events,
    admin commands, P2P lookups). Disabled: the engine runs on its own."""

    enabled: bool = False
    # The controller's ROUTER endpoint, tcp://host:port.
    url: str = "tcp://127.0.0.1:7600"
    # At most a day: the controller refuses a longer period (such a worker would never
    # be dropped).
    heartbeat_s: Annotated[float, msgspec.Meta(gt=0, le=86400)] = 1.0
    timeout_s: PositiveSeconds = 1.0
    event_batch: PositiveInt = 1024
    event_flush_s: PositiveSeconds = 0.05

    def __post_init__(self) -> None:
        if self.enabled:
            _check_zmq_endpoint("url", self.url, ("enabled",))


class P2PConfig(_Section):
    """The peer tier (L2): serve this engine's L1 to peers, read chunks from theirs."""

    enabled: bool = False
    # Where this engine serves peers; port 0 = any free one.
    host: str = "127.0.0.1"
    port: Port = 0
    # auto: NIXL when importable, else the ZMQ channel.
    channel: Literal["auto", "nixl", "zmq"] = "auto"
    timeout_s: PositiveSeconds = 1.0
    lookup_timeout_s: PositiveSeconds = 0.05
    # Connections (and NIXL agents) of peers unused this long are let go.
    peer_idle_s: PositiveSeconds = 300.0

    def __post_init__(self) -> None:
        # A read's connection closed as idle mid-read would fail it (a miss every time).
        if self.peer_idle_s <= self.timeout_s:
            raise RuleError(
                "peer_idle_s",
                f"must be above timeout_s ({self.timeout_s}), got {self.peer_idle_s}",
                related=("timeout_s",),
            )


class PDConfig(_Section):
    """Disaggregated prefill: a prefiller (sender) pushes a prompt's KV straight into
    buffers a decoder (receiver) allocates for it, through the P2P endpoint and channel."""

    # none | sender (prefiller) | receiver (decoder) | both. Any role but none also
    # keys a prompt's last, partial chunk (the decoder needs every prompt token's KV).
    role: Literal["none", "sender", "receiver", "both"] = "none"
    # Receiver: the share of L1 that in-flight receive buffers may take; beyond it an
    # AllocRequest is refused (a decoder never evicts to make room) and the request
    # falls back to recompute.
    max_receive_fraction: Annotated[float, msgspec.Meta(gt=0, le=1)] = 0.5
    # Sender: the deadline of one push (allocation, every layer's write, commit).
    # Receiver: buffers not committed by the sender's deadline plus this are freed.
    timeout_s: PositiveSeconds = 10.0
    # Receiver: how long received chunks stay pinned for their decode request; a decode
    # that starts later (or never) finds them dropped, and computes the prompt itself.
    hold_s: PositiveSeconds = 120.0


BUILTIN_TIER_NAMES = ("l1", "p2p", "disk", "remote")
# engine.model_name when not set: the vLLM connector then names the weights it loads.
UNSET_MODEL_NAME = "unknown"


class TierPluginConfig(_Section):
    """A tier from another package, placed after the disk tier and before the remote one."""

    # An entry point of the `kvmesh.tiers` group, or `package.module:factory`.
    plugin: str
    # The tier's name in metrics and lookups; empty: the plugin's name.
    name: str = ""
    # Handed to the plugin's factory as they are.
    options: dict[str, Any] = {}

    def __post_init__(self) -> None:
        if not self.plugin.strip():
            raise RuleError("plugin", "must name an entry point or package.module:factory")

    @property
    def tier_name(self) -> str:
        return self.name or self.plugin.rpartition(":")[2].rpartition(".")[2]


class EngineConfig(_Section):
    """The worker engine embedded in each inference worker process."""

    chunk_size: PositiveInt = 256
    save_unfull_chunk: bool = False
    hash_algorithm: HashAlgorithm = "xxh3_128"
    model_name: str = UNSET_MODEL_NAME
    tenant_salt: str = ""
    l1: L1Config = L1Config()
    disk: DiskConfig = DiskConfig()
    remote: RemoteConfig = RemoteConfig()
    controller: EngineControllerConfig = EngineControllerConfig()
    p2p: P2PConfig = P2PConfig()
    pd: PDConfig = PDConfig()
    # Plugin tiers, in lookup order (docs/plugins.md).
    tiers: list[TierPluginConfig] = []
    pin_timeout_s: PositiveSeconds = 30.0
    close_flush_s: NonNegativeSeconds = 10.0
    layerwise: bool = False
    max_inflight_io: PositiveInt = 64
    # Empty means the default ipc:// path the lookup-server binds on this host.
    lookup_endpoint: str = ""
    metrics_port: Port = 0
    # Where the metrics port listens: loopback by default; 0.0.0.0 in a container or a
    # pod, whose scraper is on another host.
    metrics_host: str = "127.0.0.1"

    def __post_init__(self) -> None:
        # A {rank} is filled in per worker (common/protocol/lookup.engine_endpoint).
        endpoint = self.lookup_endpoint.replace("{rank}", "1")
        if endpoint and not is_zmq_endpoint(endpoint):
            raise RuleError(
                "lookup_endpoint",
                f"expected {ZMQ_ENDPOINT_FORMS}, either may hold a {{rank}} "
                f"(got {self.lookup_endpoint!r})",
            )
        names = [t.tier_name for t in self.tiers]
        for name in names:
            if name in BUILTIN_TIER_NAMES or names.count(name) > 1:
                raise RuleError(
                    "tiers",
                    f"tier name {name!r} is taken (by a built-in tier or another plugin): "
                    "give the plugin a `name`",
                )
        # Rank 0's ports: every engine has one. Ranks beyond are checked at engine start
        # (check_rank_ports), where the world size is known.
        self.check_rank_ports(1)

    def rank_ports(self, rank: int) -> dict[str, int]:
        """The TCP ports rank `rank` listens on, by the key each comes from (those set:
        0 is any free one). Each listener of rank r is on its base port + r."""
        listeners: dict[str, int] = {}
        if self.p2p.port and (self.p2p.enabled or self.pd.role in ("receiver", "both")):
            listeners["p2p.port"] = self.p2p.port + rank
        if self.metrics_port:
            listeners["metrics_port"] = self.metrics_port + rank
        endpoint = self.lookup_endpoint
        if endpoint.startswith("tcp://"):
            # As common/protocol/lookup.engine_endpoint reads it: a {rank} in it is the
            # rank, else the port is the base port + rank.
            templated = "{rank}" in endpoint
            port = endpoint.replace("{rank}", str(rank)).rpartition(":")[2]
            # A {rank} in the address gives each rank an address of its own: its port
            # can clash with nothing of another rank's.
            own_address = templated and rank > 0 and "{rank}" in endpoint.rpartition(":")[0]
            if port.isascii() and port.isdigit() and int(port) and not own_address:
                listeners["lookup_endpoint"] = int(port) + (0 if templated else rank)
        return listeners

    def check_rank_ports(self, world_size: int, first: int = 0) -> None:
        """Raise RuleError when two listeners of the `world_size` ranks of one host
        (ranks first, first + 1, ...) would take one port (the second bind fails at
        start, naming no key), or a rank's port is past 65535."""
        taken: dict[int, list[tuple[str, int]]] = {}
        for rank in range(first, first + world_size):
            for key, port in self.rank_ports(rank).items():
                if port > 65535:
                    raise RuleError(
                        key,
                        f"rank {rank} of {world_size} would listen on port {port} "
                        "(each rank listens on the base port + its rank): past 65535",
                    )
                host = self._listener_host(key)
                met = [
                    t for t in taken.get(port, ()) if _hosts_meet(host, self._listener_host(t[0]))
                ]
                if met:
                    other, other_rank = met[0]
                    where = (
                        f"with {world_size} ranks, rank {rank}'s {key} and rank "
                        f"{other_rank}'s {other} are both {port} (each rank listens on the "
                        "base port + its rank)"
                        if world_size > 1
                        else f"must differ from {other} (both are {port})"
                    )
                    related = () if other == key else (other,)
                    raise RuleError(key, f"{where}: keep each listener's ports apart", related)
                taken.setdefault(port, []).append((key, rank))

    def _listener_host(self, key: str) -> str:
        if key == "p2p.port":
            return self.p2p.host
        if key == "metrics_port":
            return self.metrics_host
        return self.lookup_endpoint.removeprefix("tcp://").rpartition(":")[0]

    @property
    def keys_partial_chunk(self) -> bool:
        """Whether a prompt's last, partial chunk gets a key (is stored and looked up)."""
        return self.save_unfull_chunk or self.pd.role != "none"


def _hosts_meet(a: str, b: str) -> bool:
    """Whether listeners on hosts a and b can take one port between them: unless both
    are addresses, and different ones (a name may be either address; the wildcard
    addresses take every one)."""
    try:
        x, y = (ipaddress.ip_address(h.strip("[]")) for h in (a, b))
    except ValueError:
        return True
    return x == y or x.is_unspecified or y.is_unspecified


class ControllerConfig(_Section):
    host: str = "127.0.0.1"
    port: Port = 7600
    metrics_port: Port = 0
    request_timeout_s: PositiveSeconds = 5.0
    # The HTTP JSON admin API (and /metrics, /health) on this port; 0 = off.
    http_port: Port = 0
    # A worker silent for this many of its heartbeat periods is dropped with its chunks.
    heartbeat_misses: PositiveInt = 3
    # Each worker's deadline when an admin command fans out.
    admin_timeout_s: PositiveSeconds = 5.0
    # Registry snapshot file, reloaded on start; "" = no snapshot.
    snapshot_path: str = ""
    snapshot_interval_s: PositiveSeconds = 30.0
    # Index subscribers (lookup-servers following the registry) that have not pinged
    # for this long are dropped: nothing else tells the controller one is gone.
    index_subscriber_timeout_s: PositiveSeconds = 10.0
    # More subscribers than this are refused (each costs an encode per registry change).
    max_index_subscribers: PositiveInt = 16
    # The KV-event feed (docs/operations.md, "KV events"): an XPUB socket publishing
    # every worker's stored/removed chunks per namespace; 0 = off.
    events_port: Port = 0
    # The feed's replay socket (a ROUTER answering "the messages after seq N"); 0 = off.
    # Needs events_port.
    events_replay_port: Port = 0
    # Events kept for replay (the newest; a message costs its event count).
    events_replay_size: PositiveInt = 100_000

    def __post_init__(self) -> None:
        # A replay of a feed that is not published would always be empty.
        if self.events_replay_port and not self.events_port:
            raise RuleError(
                "events_replay_port",
                "needs events_port (the feed it replays) to be set",
                related=("events_port",),
            )
        # One HTTP server: on http_port, else on metrics_port.
        http = ("http_port",) if self.http_port else ("metrics_port",)
        _check_distinct_ports(self, ("port", *http, "events_port", "events_replay_port"))


class LookupConfig(_Section):
    host: str = "127.0.0.1"
    port: Port = 7610
    metrics_port: Port = 0
    request_timeout_s: PositiveSeconds = 5.0
    # Where the workers' lookup endpoints and the chunk registry come from.
    controller_url: str = "tcp://127.0.0.1:7600"
    # Deadlines: asking one instance's workers, and asking the controller.
    worker_timeout_s: PositiveSeconds = 0.5
    controller_timeout_s: PositiveSeconds = 0.5
    # How long the list of workers (and their endpoints) is reused before re-asking.
    registry_refresh_s: PositiveSeconds = 1.0
    # How the engines hash chunks (must match engine.chunk_size / hash_algorithm):
    # used to turn tokens into chunk hashes for best_instances.
    chunk_size: PositiveInt = 256
    hash_algorithm: HashAlgorithm = "xxh3_128"
    # Keep a copy of the controller's registry, fed by the changes it pushes, and answer
    # best_instances (and lookups by hashes) from it while it is in sync; false = ask
    # the controller on every such request.
    index: bool = True
    # How often the copy is confirmed current (a ping the controller answers behind
    # every change it pushed); a copy not confirmed for index_max_staleness_s is not
    # used: requests then go to the controller.
    index_ping_s: PositiveSeconds = 0.2
    index_max_staleness_s: PositiveSeconds = 1.0
    # Deadline of the snapshot the copy starts from (tens of MB for millions of chunks).
    index_snapshot_timeout_s: PositiveSeconds = 30.0

    def __post_init__(self) -> None:
        _check_zmq_endpoint("controller_url", self.controller_url)
        _check_distinct_ports(self, ("port", "metrics_port"))
        # Pings at or past the staleness bound would let a healthy copy go stale
        # between two confirmations.
        if self.index_ping_s * 2 > self.index_max_staleness_s:
            raise RuleError(
                "index_max_staleness_s",
                f"must be at least twice index_ping_s ({self.index_ping_s})",
                related=("index_ping_s",),
            )


_MAX_ZMQ_MS = 2**31 - 1


class CacheServerConfig(_Section):
    host: str = "127.0.0.1"
    port: Port = 7620
    metrics_port: Port = 0
    request_timeout_s: PositiveSeconds = 5.0
    max_memory: ByteSize = ByteSize("4GiB")
    max_value_size: ByteSize = ByteSize("256MiB")
    max_connections: PositiveInt = 1024
    session_idle_s: PositiveSeconds = 600.0
    # A connection that delivers no whole frame for this long after a heartbeat (a
    # client stalled or gone mid-put), or leaves the server's output unacknowledged
    # that long, is closed. Above the time the largest put takes on a busy link.
    stall_timeout_s: PositiveSeconds = 60.0
    # LMCache's lm:// protocol on a second port (0 = let the OS pick).
    lm_enabled: bool = False
    lm_port: Port = 7621
    # Gets over a plain TCP stream beside ZMQ (0 = let the OS pick; the hello tells
    # clients the port). Never offered with CURVE on.
    data_enabled: bool = True
    data_port: Port = 0
    # Empty = no spill: what the memory LRU evicts is dropped.
    spill_path: str = ""
    spill_max_size: ByteSize = ByteSize("16GiB")

    def __post_init__(self) -> None:
        listeners = (
            "port",
            "metrics_port",
            *(("lm_port",) if self.lm_enabled else ()),
            *(("data_port",) if self.data_enabled else ()),
        )
        _check_distinct_ports(self, listeners)
        # Its milliseconds go into zmq socket options, C ints: past that the server
        # failed to start with an OverflowError traceback.
        # Not int(): a finite 1e308 s is inf ms, which int() refuses with a traceback.
        if self.stall_timeout_s * 1000 >= _MAX_ZMQ_MS + 1:
            raise RuleError(
                "stall_timeout_s",
                f"must be at most {_MAX_ZMQ_MS // 1000} (zmq takes it in milliseconds "
                f"as a C int), got {self.stall_timeout_s}",
            )
        # 0 would refuse every put: a cache-server that never stores anything.
        if self.max_value_size == 0:
            raise RuleError("max_value_size", "must be > 0 (it bounds each stored value)")
        # A value larger than the whole store could never be admitted; say so at
        # startup rather than rejecting every such put at runtime.
        if self.max_value_size > self.max_memory:
            raise RuleError(
                "max_value_size",
                f"must not exceed max_memory ({format_size(int(self.max_value_size))}"
                f" > {format_size(int(self.max_memory))})",
                related=("max_memory",),
            )
        if self.spill_path.strip() and self.spill_max_size < self.max_value_size:
            raise RuleError(
                "spill_max_size",
                f"must be at least max_value_size ({format_size(int(self.max_value_size))}) "
                "while spill_path is set",
                related=("spill_path", "max_value_size"),
            )


NonNegativeInt = Annotated[int, msgspec.Meta(ge=0)]


def _check_http_url(field: str, url: str) -> None:
    scheme, sep, rest = url.partition("://")
    hosts = rest
    for end in "/?#":
        hosts = hosts.split(end, 1)[0]
    # aiohttp reads the URL with yarl at each request: a bad port would fail every one.
    host = hosts.rpartition("@")[2]
    if (
        not sep
        or scheme.lower() not in ("http", "https")
        or not hosts
        or host_port_problem(host, bare_ipv6=False) is not None
    ):
        raise RuleError(
            field,
            f"must be an http:// or https:// URL with a host and an optional port "
            f"(got {redact_url(url, malformed=True)!r})",
        )


class BackendConfig(_Section):
    """One vLLM OpenAI-compatible server behind the bridge."""

    # The server's base URL, without /v1: http://host:port.
    url: str = ""
    # The kvmesh instance id of this server's engines (the connector's `instance_id`
    # in kv_connector_extra_config): how the lookup-server's answers name it. Needed
    # by KV-aware routing (bridge.lookup_url).
    instance_id: str = ""

    def __post_init__(self) -> None:
        _check_http_url("url", self.url)


class DecoderConfig(BackendConfig):
    # The decoder's kvmesh P2P endpoint (engine.p2p) of each rank, in rank order: where
    # a prefiller pushes the prompt's KV. Empty: this decoder always prefills itself.
    kv_endpoints: list[str] = []

    def __post_init__(self) -> None:
        super().__post_init__()
        for endpoint in self.kv_endpoints:
            scheme, sep, rest = endpoint.partition("://")
            # The prefiller's engine dials it (host_ports: the port after the last ':').
            if (
                not sep
                or not scheme
                or ":" not in rest
                or host_port_problem(rest, bare_ipv6=True, port_required=True) is not None
            ):
                raise RuleError(
                    "kv_endpoints",
                    "expected scheme://host:port entries "
                    f"(got {redact_url(endpoint, malformed=True)!r})",
                )


class BridgeConfig(_Section):
    host: str = "127.0.0.1"
    port: Port = 7630
    metrics_port: Port = 0
    # Deadline of the bridge's small calls: backends' /health and /v1/models, reading
    # a client's request body, and a client connection with no request in progress.
    request_timeout_s: PositiveSeconds = 5.0
    prefillers: list[BackendConfig] = []
    decoders: list[DecoderConfig] = []
    # The whole prefill call, which returns once the KV has landed on the decoder;
    # past it the decoder prefills itself.
    prefill_timeout_s: PositiveSeconds = 30.0
    # The decoder's first byte, then each later read of its answer, and each write of
    # a streamed answer to the client.
    decode_timeout_s: PositiveSeconds = 60.0
    # Larger request bodies are refused with 413.
    max_body_bytes: ByteSize = ByteSize("1MiB")
    health_interval_s: PositiveSeconds = 2.0
    # KV-aware routing: the lookup-server (tcp://host:port) asked which backend holds
    # the longest prefix of a prompt; "" = off (the least loaded backend gets it).
    lookup_url: str = ""
    # Deadlines of the routing calls; past either the request goes to the least loaded
    # backend: the backend's POST /tokenize, and the lookup-server's answer.
    tokenize_timeout_s: PositiveSeconds = 0.25
    lookup_timeout_s: PositiveSeconds = 0.05
    # A cached prefix shorter than this does not steer a request (one chunk at the
    # default engine.chunk_size); with PD, a decoder missing fewer tokens than this
    # of the prompt computes them itself instead of waiting for a prefill.
    lookup_min_hit_tokens: PositiveInt = 256
    # A backend holding the prefix gets the request only while it has at most this many
    # requests in flight more than the least loaded one: a hot prefix must not pile
    # every request onto one server.
    lookup_max_extra_inflight: NonNegativeInt = 4

    def __post_init__(self) -> None:
        _check_distinct_ports(self, ("port", "metrics_port"))
        if self.max_body_bytes == 0:
            raise RuleError("max_body_bytes", "must be > 0")
        # Two entries for one server would double its share of requests and split its
        # in-flight count, which is what picking the least loaded one reads.
        for name, backends in (("prefillers", self.prefillers), ("decoders", self.decoders)):
            urls = [b.url.rstrip("/") for b in backends]
            dup = next((u for u in urls if urls.count(u) > 1), None)
            if dup is not None:
                raise RuleError(name, f"lists {redact_url(dup)} more than once")
        if self.lookup_url:
            self._check_lookup()

    def _check_lookup(self) -> None:
        _check_zmq_endpoint("lookup_url", self.lookup_url)
        # Without its id a backend could never be matched to a cache hit: refuse the
        # config rather than route by load alone without saying so.
        seen: dict[str, str] = {}
        for name, backends in (("prefillers", self.prefillers), ("decoders", self.decoders)):
            for i, b in enumerate(backends):
                # The list is the key a config layer set, so the error can say where.
                where = f"[{i}].instance_id ({redact_url(b.url)})"
                if not b.instance_id:
                    raise RuleError(
                        name, f"{where}: required while lookup_url is set", ("lookup_url",)
                    )
                if b.instance_id in seen:
                    other = seen[b.instance_id]
                    raise RuleError(name, f"{where}: {b.instance_id!r} is also {other}")
                seen[b.instance_id] = f"{name}{where}"


class SecurityConfig(_Section):
    """Who may talk to the mesh: ZMQ CURVE on every kvmesh socket, a bearer token on the
    HTTP admin endpoints. Everything empty (the default): no encryption, no checks.

    CURVE uses pyzmq's certificate files (`kvmesh keys generate DIR --name NAME` writes
    NAME.key, the public half, and NAME.key_secret). The whole mesh shares one server key
    pair, so a client needs one public key whatever it talks to; each client process
    (worker, lookup-server, CLI) has its own key pair, and servers accept the client
    public keys found in `allowed_clients`. Files are read and checked at start-up.
    """

    # The servers' certificate: the secret file on hosts that serve (it also carries the
    # public key), the public file where only clients run. "" = CURVE off.
    server_key: str = ""
    # This process's client certificate (the secret file); needed wherever a process
    # connects to a kvmesh server.
    client_key: str = ""
    # A directory of client public certificates (*.key): the clients servers accept.
    allowed_clients: str = ""
    # A file holding the bearer token the HTTP admin endpoints require ("" = open);
    # /metrics and /health stay open for scrapers and probes.
    http_token_file: str = ""

    def __post_init__(self) -> None:
        # CURVE half set up would run the mesh in the clear while the user believes it
        # is locked: refuse it.
        if not self.server_key and (self.client_key or self.allowed_clients):
            raise RuleError(
                "server_key",
                "must be set when client_key or allowed_clients is (CURVE needs the servers' key)",
                related=("client_key", "allowed_clients"),
            )

    @property
    def curve(self) -> bool:
        """Whether CURVE is on."""
        return bool(self.server_key)


class LoggingConfig(_Section):
    level: LogLevel = "info"
    json: bool = True


class KvmeshConfig(_Section):
    """The whole configuration; each process reads the sections it needs."""

    engine: EngineConfig = EngineConfig()
    controller: ControllerConfig = ControllerConfig()
    lookup: LookupConfig = LookupConfig()
    cacheserver: CacheServerConfig = CacheServerConfig()
    bridge: BridgeConfig = BridgeConfig()
    logging: LoggingConfig = LoggingConfig()
    security: SecurityConfig = SecurityConfig()

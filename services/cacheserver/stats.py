"""The cache-server's Prometheus metrics (kvmesh_cacheserver_*), bound once."""

from __future__ import annotations

from kvmesh.common.observability import Metrics
from kvmesh.common.protocol.cacheserver import ErrorCode
from kvmesh.services.cacheserver.store import MISS_REASONS

OPS = (
    "hello",
    "put",
    "get",
    "exists",
    "delete",
    "mput",
    "mget",
    "mexists",
    "mdelete",
    "list",
    "stats",
    "health",
    "invalid",
)
LM_OPS = ("put", "get", "exist", "list", "health", "invalid")
DATA_OPS = ("get", "invalid")
LISTENERS = ("zmq", "lm", "data")


class ServerStats:
    def __init__(self, metrics: Metrics | None = None) -> None:
        self.metrics = m = metrics if metrics is not None else Metrics()
        requests = m.counter(
            "cacheserver_requests_total",
            "Requests served, by listener and operation",
            ["listener", "op"],
        )
        self.requests = {op: requests.labels(listener="zmq", op=op) for op in OPS}
        self.lm_requests = {op: requests.labels(listener="lm", op=op) for op in LM_OPS}
        self.data_requests = {op: requests.labels(listener="data", op=op) for op in DATA_OPS}
        seconds = m.histogram(
            "cacheserver_request_seconds", "Time to serve one request (zmq listener)", ["op"]
        )
        self.seconds = {op: seconds.labels(op=op) for op in OPS}
        errors = m.counter(
            "cacheserver_errors_total",
            "Error replies (or closed connections), by code",
            ["code"],
        )
        self.errors = {c: errors.labels(code=c.name.lower()) for c in ErrorCode}
        self.lm_closed = errors.labels(code="lm_connection_closed")
        self.data_closed = errors.labels(code="data_connection_closed")
        gets = m.counter("cacheserver_gets_total", "Values asked for, by result", ["result"])
        self.hits = gets.labels(result="hit")
        self.misses = gets.labels(result="miss")
        reasons = m.counter(
            "cacheserver_misses_total",
            "Values asked for and not found, by reason (not_stored, evicted, checksum, timeout)",
            ["reason"],
        )
        self.miss_reasons = {r: reasons.labels(reason=r) for r in MISS_REASONS}
        for counter in self.miss_reasons.values():
            counter.inc(0)
        evictions = m.counter(
            "cacheserver_evictions_total",
            "Values evicted from memory, by where they went",
            ["to"],
        )
        self.evicted_to = {
            "spill": evictions.labels(to="spill"),
            "drop": evictions.labels(to="drop"),
        }
        self.bytes_in = m.counter("cacheserver_received_bytes_total", "Value bytes stored")
        self.bytes_out = m.counter("cacheserver_sent_bytes_total", "Value bytes sent back")
        self.keys = m.gauge("cacheserver_keys", "Values held (memory and spill)")
        self.memory_bytes = m.gauge("cacheserver_memory_bytes", "Bytes of values held in memory")
        self.max_memory = m.gauge("cacheserver_max_memory_bytes", "The memory bound")
        self.spill_bytes = m.gauge("cacheserver_spill_bytes", "Bytes of spill files")
        self.spill_corrupt = m.counter(
            "cacheserver_spill_corrupt_total", "Spill files that failed verification (a miss)"
        )
        connections = m.gauge(
            "cacheserver_connections", "Open client connections, by listener", ["listener"]
        )
        self.connections = {name: connections.labels(listener=name) for name in LISTENERS}
        self.sessions = m.gauge("cacheserver_sessions", "Clients that said hello (zmq)")
        for counter in (self.bytes_in, self.bytes_out, self.spill_corrupt, self.hits, self.misses):
            counter.inc(0)

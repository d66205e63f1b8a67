"""The remote tier's Prometheus metrics (kvmesh_remote_*), bound once.

They live in the registry handed in (the engine's, so they carry its `instance` and
`rank` labels and share its endpoint), or in one of their own.
"""

from __future__ import annotations

from kvmesh.common.observability import Metrics

PUT_RESULTS = ("written", "duplicate", "down", "queue_full", "too_large", "store_full", "error")
GET_RESULTS = ("hit", "miss", "down", "error", "corrupt", "no_memory")
LOOKUP_RESULTS = ("cached", "asked", "down", "timeout", "error")
OPS = ("put", "get", "exists")


class RemoteStats:
    def __init__(self, metrics: Metrics | None = None, scheme: str = "") -> None:
        self.metrics = m = metrics if metrics is not None else Metrics()
        puts = m.counter("remote_puts_total", "Chunks submitted to the remote tier", ["result"])
        self.puts = {r: puts.labels(result=r) for r in PUT_RESULTS}
        gets = m.counter("remote_gets_total", "Remote tier reads, by outcome", ["result"])
        self.gets = {r: gets.labels(result=r) for r in GET_RESULTS}
        lookups = m.counter(
            "remote_lookups_total",
            "Remote existence checks of a lookup: answered from the presence cache, "
            "asked of the remote, or skipped",
            ["result"],
        )
        self.lookups = {r: lookups.labels(result=r) for r in LOOKUP_RESULTS}
        seconds = m.histogram("remote_seconds", "Time of one remote operation", ["op"])
        self.seconds = {op: seconds.labels(op=op) for op in OPS}
        self.sent = m.counter("remote_sent_bytes_total", "Payload bytes sent (after compression)")
        self.raw_sent = m.counter(
            "remote_raw_sent_bytes_total", "Chunk bytes put (before compression)"
        )
        self.received = m.counter("remote_received_bytes_total", "Payload bytes fetched")
        self.up = m.gauge("remote_up", "1 while the remote store answers, 0 while it is down")
        changes = m.counter(
            "remote_state_changes_total", "Times the remote went down or came back", ["to"]
        )
        self.went = {"up": changes.labels(to="up"), "down": changes.labels(to="down")}
        self.pending_puts = m.gauge("remote_pending_puts", "Puts submitted and not finished")
        for counter in (self.sent, self.raw_sent, self.received):
            counter.inc(0)
        self.up.set(0)
        self.pending_puts.set(0)

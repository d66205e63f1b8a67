"""The controller's Prometheus metrics (kvmesh_controller_*), bound once."""

from __future__ import annotations

from kvmesh.common.observability import Metrics
from kvmesh.common.protocol import controller as proto
from kvmesh.common.protocol.controller import ErrorCode

OPS = (*sorted(proto.REQUEST_TAGS), "invalid")


class ControllerStats:
    def __init__(self, metrics: Metrics | None = None) -> None:
        self.metrics = m = metrics if metrics is not None else Metrics()
        requests = m.counter("controller_requests_total", "Messages received, by type", ["op"])
        self.requests = {op: requests.labels(op=op) for op in OPS}
        errors = m.counter("controller_errors_total", "Error replies, by code", ["code"])
        self.errors = {c: errors.labels(code=c.name.lower()) for c in ErrorCode}
        self.events = m.counter("controller_kv_events_total", "KV events applied")
        self.resyncs = m.counter("controller_resyncs_total", "Resync requests pushed to workers")
        self.dropped = m.counter(
            "controller_workers_dropped_total", "Workers dropped, by why", ["reason"]
        )
        self.dropped_by = {r: self.dropped.labels(reason=r) for r in ("heartbeat", "deregister")}
        self.lookups = m.counter("controller_p2p_lookups_total", "P2P lookups, by result", ["hit"])
        self.lookup_hit = self.lookups.labels(hit="yes")
        self.lookup_miss = self.lookups.labels(hit="no")
        self.workers = m.gauge("controller_workers", "Workers registered (or restored)")
        self.chunks = m.gauge("controller_chunks", "Distinct chunks in the registry")
        self.snapshots = m.counter("controller_snapshots_total", "Snapshots written")
        self.snapshot_seconds = m.gauge(
            "controller_snapshot_seconds", "Time the last snapshot took"
        )
        self.index_subscribers = m.gauge(
            "controller_index_subscribers", "Lookup-servers following the registry"
        )
        self.index_snapshots = m.counter(
            "controller_index_snapshots_total", "Registry snapshots sent to index subscribers"
        )
        self.index_pushes = m.counter(
            "controller_index_pushes_total", "Registry changes pushed to index subscribers"
        )
        # Event batches held while a worker's full state is applied (handlers.py).
        self.held_bytes = m.gauge(
            "controller_held_event_bytes", "Held KV event batches' memory, estimated"
        )
        overflows = m.counter(
            "controller_held_overflows_total",
            "Held KV event batches dropped (the worker resyncs), by the bound reached",
            ["bound"],
        )
        self.held_overflows = {
            b: overflows.labels(bound=b) for b in ("batches", "bytes", "total_bytes")
        }
        for c in (self.index_snapshots, self.index_pushes, *self.held_overflows.values()):
            c.inc(0)
        for c in (self.events, self.resyncs, self.snapshots, self.lookup_hit, self.lookup_miss):
            c.inc(0)

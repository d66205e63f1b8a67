"""The disk tier's Prometheus metrics, bound once so the I/O paths only increment.

They live in the registry handed in (the engine's, so they share its `instance` and
`rank` labels and its metrics endpoint), or in a registry of their own.
"""

from __future__ import annotations

from kvmesh.common.observability import Metrics

PUT_RESULTS = ("written", "duplicate", "degraded", "queue_full", "no_space", "error")
GET_RESULTS = ("hit", "miss", "error")
SCAN_RESULTS = ("kept", "deleted", "evicted")


class DiskStats:
    """kvmesh_disk_* series (plus the engine's kvmesh_evictions_total{tier="disk"})."""

    def __init__(self, metrics: Metrics | None = None, tier: str = "disk") -> None:
        self.metrics = metrics if metrics is not None else Metrics()
        m = self.metrics
        puts = m.counter(
            "disk_puts_total", "Chunks submitted to the disk tier, by outcome", ["result"]
        )
        self.puts = {r: puts.labels(result=r) for r in PUT_RESULTS}
        gets = m.counter("disk_gets_total", "Disk tier reads, by outcome", ["result"])
        self.gets = {r: gets.labels(result=r) for r in GET_RESULTS}
        self.corrupt = m.counter(
            "disk_corrupt_total", "Chunk files that failed verification (deleted; a miss)"
        )
        io_errors = m.counter("disk_io_errors_total", "Failed disk operations", ["op"])
        self.io_errors = {op: io_errors.labels(op=op) for op in ("write", "read", "delete")}
        self.bytes_written = m.counter("disk_written_bytes_total", "Bytes written to chunk files")
        self.bytes_read = m.counter("disk_read_bytes_total", "Bytes read from chunk files")
        seconds = m.histogram("disk_io_seconds", "Time of one chunk file write or read", ["op"])
        self.io_seconds = {op: seconds.labels(op=op) for op in ("write", "read")}
        evictions = m.counter("evictions_total", "Chunks evicted, by tier", ["tier"])
        self.evictions = evictions.labels(tier=tier)
        self.usage = m.gauge("disk_usage_bytes", "Bytes of chunk files the tier holds")
        self.capacity = m.gauge("disk_capacity_bytes", "The tier's maximum size")
        self.chunks = m.gauge("disk_chunks", "Chunk files the tier holds (readable ones)")
        self.pending_puts = m.gauge("disk_pending_puts", "Puts queued or being written")
        self.degraded = m.gauge(
            "disk_degraded", "1 while the tier is degraded (full, read-only, missing directory)"
        )
        scanned = m.counter(
            "disk_reindex_files_total",
            "Files seen by the re-index on start, by outcome",
            ["result"],
        )
        self.scanned = {r: scanned.labels(result=r) for r in SCAN_RESULTS}
        self.reindex_seconds = m.gauge(
            "disk_reindex_seconds", "How long the last re-index on start took (0 while running)"
        )
        # Export the unlabelled series from the start, so a dashboard sees 0, not nothing.
        for counter in (self.corrupt, self.bytes_written, self.bytes_read):
            counter.inc(0)
        for gauge in (self.usage, self.chunks, self.pending_puts, self.degraded):
            gauge.set(0)

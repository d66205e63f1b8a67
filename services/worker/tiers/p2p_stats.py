"""The P2P tier's Prometheus metrics (kvmesh_p2p_*), bound once, in the engine's registry."""

from __future__ import annotations

from kvmesh.common.observability import Metrics

LOOKUP_RESULTS = ("found", "none", "no_locator", "self", "error", "down")
GET_RESULTS = ("hit", "miss", "no_peer", "error", "corrupt", "no_memory", "down")
OPS = ("locate", "read")


class P2PStats:
    def __init__(self, metrics: Metrics | None = None) -> None:
        self.metrics = m = metrics if metrics is not None else Metrics()
        lookups = m.counter(
            "p2p_lookups_total",
            "P2P lookups: a peer found, none, no locator attached, only ourselves, the "
            "locator failed, or the peer named did not answer lately (down)",
            ["result"],
        )
        self.lookups = {r: lookups.labels(result=r) for r in LOOKUP_RESULTS}
        gets = m.counter("p2p_gets_total", "Chunks asked of peers, by outcome", ["result"])
        self.gets = {r: gets.labels(result=r) for r in GET_RESULTS}
        seconds = m.histogram("p2p_seconds", "Time of one P2P locate or read batch", ["op"])
        self.seconds = {op: seconds.labels(op=op) for op in OPS}
        self.received = m.counter(
            "p2p_received_bytes_total", "Verified chunk bytes read from peers"
        )
        self.received.inc(0)
        for c in (*self.gets.values(), *self.lookups.values()):
            c.inc(0)

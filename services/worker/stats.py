"""The engine's Prometheus metrics, bound once so the hot path only increments."""

from __future__ import annotations

from kvmesh.common.observability import Metrics

OPS = ("store", "retrieve", "lookup", "prefetch")


class EngineStats:
    """kvmesh_* metrics of one engine (labels: instance, rank)."""

    def __init__(self, instance_id: str, rank: int, tier_names: list[str]) -> None:
        self.metrics = Metrics({"instance": instance_id, "rank": str(rank)})
        m = self.metrics
        requests = m.counter("requests_total", "Engine operations served", ["op"])
        requested = m.counter("tokens_requested_total", "Tokens asked for", ["op"])
        latency = m.histogram("op_latency_seconds", "Engine operation latency", ["op"])
        self.requests = {op: requests.labels(op=op) for op in OPS}
        self.tokens_requested = {op: requested.labels(op=op) for op in OPS}
        self.latency = {op: latency.labels(op=op) for op in OPS}
        hits = m.counter("tokens_hit_total", "Tokens found in the cache, by tier", ["tier"])
        self.tokens_hit = {t: hits.labels(tier=t) for t in tier_names}
        chunk_hits = m.counter(
            "chunk_hits_total", "Chunks loaded into the inference engine, by source tier", ["tier"]
        )
        self.chunks_hit = {t: chunk_hits.labels(tier=t) for t in tier_names}
        for counter in self.chunks_hit.values():
            counter.inc(0)
        self.tokens_stored = m.counter("tokens_stored_total", "Tokens written to the cache")
        self.chunks_stored = m.counter("chunks_stored_total", "Chunks written to the cache")
        self.stores_skipped = m.counter(
            "stores_skipped_total", "Stores skipped (engine frozen, or rank without MLA duty)"
        )
        evictions = m.counter("evictions_total", "Chunks evicted, by tier", ["tier"])
        self.evictions = {t: evictions.labels(tier=t) for t in tier_names}
        self.alloc_failures = m.counter(
            "alloc_failures_total", "Allocations that found no free page before their deadline"
        )
        self.load_errors = m.counter(
            "load_errors_total", "Chunks that failed to load (the engine recomputes them)"
        )
        self.l1_used = m.gauge("l1_usage_bytes", "Bytes of L1 held by chunks")
        self.l1_capacity = m.gauge("l1_capacity_bytes", "Bytes of the L1 pool")
        self.l1_chunks = m.gauge("l1_chunks", "Chunks held in L1")
        self.pinned_lookups = m.gauge("pinned_lookups", "Lookups holding pins")
        hit_rate = m.gauge(
            "hit_rate", "Hit tokens / looked-up tokens since start, by tier", ["tier"]
        )
        self.hit_rate = {t: hit_rate.labels(tier=t) for t in tier_names}
        self._lookup_tokens = 0
        self._hit_tokens = dict.fromkeys(tier_names, 0)

    def record_hit(self, tier: str, tokens: int) -> None:
        """One chunk of tokens loaded from tier."""
        self.tokens_hit[tier].inc(tokens)
        self.chunks_hit[tier].inc()

    def record_hits(self, tier: str, chunks: int, tokens: int) -> None:
        """`record_hit` of `chunks` chunks holding `tokens` tokens in all, from tier."""
        self.tokens_hit[tier].inc(tokens)
        self.chunks_hit[tier].inc(chunks)

    def record_lookup(self, requested: int, hits_by_tier: dict[str, int]) -> None:
        self._lookup_tokens += requested
        for tier, n in hits_by_tier.items():
            self._hit_tokens[tier] = self._hit_tokens.get(tier, 0) + n
        if self._lookup_tokens:
            for tier, gauge in self.hit_rate.items():
                gauge.set(self._hit_tokens.get(tier, 0) / self._lookup_tokens)

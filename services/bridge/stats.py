"""The bridge's Prometheus metrics (kvmesh_bridge_*), bound once."""

from __future__ import annotations

from kvmesh.common.observability import Metrics

ENDPOINTS = ("completions", "chat", "models")
# ok: the decoder answered 2xx; decoder_status: it answered 4xx/5xx (passed through);
# decoder_failed/decoder_timeout: the bridge answered 502/504; no_decoder: 503;
# bad_request: the bridge refused the request (4xx); cancelled: the client went away.
OUTCOMES = (
    "ok",
    "decoder_status",
    "decoder_failed",
    "decoder_timeout",
    "no_decoder",
    "bad_request",
    "cancelled",
)
# Why a request was decoded without a prefill: no prefiller configured, every one
# known to be down, the decoder has no kv_endpoints; or the prefill call failed: no
# connection, past prefill_timeout_s, a non-2xx answer, another transport error.
FALLBACK_REASONS = (
    "no_prefiller",
    "prefiller_down",
    "no_kv_endpoints",
    "connect",
    "timeout",
    "status",
    "error",
)
# Seconds, from a one-token prefill of a short prompt to a long one queued behind others.
PREFILL_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class BridgeStats:
    def __init__(self, metrics: Metrics | None = None) -> None:
        self.metrics = m = metrics if metrics is not None else Metrics()
        requests = m.counter(
            "bridge_requests_total",
            "Client requests, by endpoint and outcome",
            ["endpoint", "outcome"],
        )
        self.requests = {(e, o): requests.labels(e, o) for e in ENDPOINTS for o in OUTCOMES}
        fallbacks = m.counter(
            "bridge_fallbacks_total",
            "Requests the decoder prefilled itself, by why the prefill was not used",
            ["reason"],
        )
        self.fallbacks = {r: fallbacks.labels(r) for r in FALLBACK_REASONS}
        prefill = m.histogram(
            "bridge_prefill_seconds",
            "Prefill calls, until the prefiller answered (the KV had landed), by result",
            ["result"],
            buckets=PREFILL_BUCKETS,
        )
        self.prefill_ok = prefill.labels("ok")
        self.prefill_failed = prefill.labels("failed")
        self.decode_ttfb = m.histogram(
            "bridge_decode_first_byte_seconds",
            "From sending the decode request to the first byte of the decoder's answer",
            buckets=PREFILL_BUCKETS,
        )
        self.inflight = m.gauge(
            "bridge_backend_inflight", "Requests in flight per backend", ["role", "backend"]
        )
        self.up = m.gauge(
            "bridge_backend_up",
            "1 when the backend's last check or call succeeded",
            ["role", "backend"],
        )
        for counter in (*self.requests.values(), *self.fallbacks.values()):
            counter.inc(0)

    def request(self, endpoint: str, outcome: str) -> None:
        self.requests[(endpoint, outcome)].inc()

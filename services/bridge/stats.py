"""The bridge's Prometheus metrics (kvmesh_bridge_*), bound once."""

from __future__ import annotations

from kvmesh.common.observability import Metrics

ENDPOINTS = ("completions", "chat", "models")
# ok: the decoder answered 2xx; decoder_status: it answered 4xx/5xx (passed through);
# decoder_failed/decoder_timeout: the bridge answered 502/504; no_decoder: 503;
# saturated: 503, every connection of the bridge's pool was busy for decode_timeout_s;
# bad_request: the bridge refused the request (4xx); cancelled: the client went away.
OUTCOMES = (
    "ok",
    "decoder_status",
    "decoder_failed",
    "decoder_timeout",
    "no_decoder",
    "saturated",
    "bad_request",
    "cancelled",
)
# Why a request was decoded without a prefill: no prefiller configured, every one
# known to be down, the decoder has no kv_endpoints, the decoder already holds nearly
# the whole prompt (KV-aware routing); or the prefill call failed: no connection, past
# prefill_timeout_s, a non-2xx answer, another transport error; or the prefill pushed
# the KV to a decoder that then refused the decode's connection, and another decoder
# took the request; or the bridge could not open a connection to the prefiller for
# want of its own resources (file descriptors...): "saturated".
FALLBACK_REASONS = (
    "no_prefiller",
    "prefiller_down",
    "no_kv_endpoints",
    "decoder_cached",
    "connect",
    "timeout",
    "status",
    "error",
    "decoder_refused",
    "saturated",
)
ROLES = ("prefiller", "decoder")
# How a backend was chosen: "kv", its cached prefix of the prompt; "load", the least
# loaded one (no lookup, no hit worth it, or the lookup failed).
ROUTE_BY = ("kv", "load")
# Why KV-aware routing had no answer for a request (it went to the least loaded
# backend): several prompts in one request, /tokenize failed or was too slow, the
# lookup-server did not answer in lookup_timeout_s (down included) or said no.
ROUTE_FALLBACK_REASONS = (
    "batch",
    "tenant",
    "tokenize",
    "tokenize_refused",
    "tokenize_timeout",
    "lookup_timeout",
    "lookup_error",
)
# Seconds the routing step (tokenize + lookup) adds to a request.
ROUTE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
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
        self.ejected = m.gauge(
            "bridge_backend_ejected",
            "1 while the backend is out of rotation after failed requests (passive "
            "ejection), whatever its /health says",
            ["role", "backend"],
        )
        self.ejections = m.counter(
            "bridge_backend_ejections_total",
            "Times the backend was taken out of rotation after failed requests",
            ["role", "backend"],
        )
        routes = m.counter(
            "bridge_routes_total",
            "Backends chosen, by role and by what chose them (kv: a cached prefix; load: "
            "the least loaded)",
            ["role", "by"],
        )
        self.routes = {(r, b): routes.labels(r, b) for r in ROLES for b in ROUTE_BY}
        route_fallbacks = m.counter(
            "bridge_route_fallbacks_total",
            "Requests KV-aware routing had no answer for (they went to the least loaded "
            "backend), by reason",
            ["reason"],
        )
        self.route_fallbacks = {r: route_fallbacks.labels(r) for r in ROUTE_FALLBACK_REASONS}
        hit_tokens = m.counter(
            "bridge_route_hit_tokens_total",
            "Prompt tokens already cached on the backend each request went to, by role",
            ["role"],
        )
        self.route_hit_tokens = {r: hit_tokens.labels(r) for r in ROLES}
        self.route_prompt_tokens = m.counter(
            "bridge_route_prompt_tokens_total", "Prompt tokens of the requests looked up"
        )
        self.route_seconds = m.histogram(
            "bridge_route_seconds",
            "The KV-aware routing step of a request (tokenize and lookup), failures included",
            buckets=ROUTE_BUCKETS,
        )
        for counter in (
            *self.requests.values(),
            *self.fallbacks.values(),
            *self.routes.values(),
            *self.route_fallbacks.values(),
            *self.route_hit_tokens.values(),
        ):
            counter.inc(0)

    def request(self, endpoint: str, outcome: str) -> None:
        self.requests[(endpoint, outcome)].inc()

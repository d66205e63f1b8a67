"""Write the kvmesh Grafana dashboard, k8s/kvmesh/dashboards/kvmesh.json.

The panels are listed here, as PromQL over the kvmesh_* metrics the services export
(docs/operations.md, "Metrics"); the JSON is generated so that ids and the grid stay
consistent. The chart ships the JSON in a ConfigMap for Grafana's dashboard sidecar
(values: grafanaDashboard); it can also be imported by hand (Dashboards → Import).
tests/deploy/test_grafana_dashboard.py checks every metric named here against the
/metrics pages of running services.

    python k8s/tools/grafana_dashboard.py           # rewrite the JSON
    python k8s/tools/grafana_dashboard.py --check   # exit 1 when it is out of date
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "kvmesh" / "dashboards" / "kvmesh.json"
# Every selector carries the namespace variable: "All" is ".*", which also matches
# series without the label (a Prometheus outside Kubernetes).
NS = 'namespace=~"$namespace"'
RATE = "$__rate_interval"
RETRIEVE = 'op="retrieve"'


def rate(metric: str, by: str = "", match: str = "") -> str:
    sel = ", ".join(x for x in (NS, match) if x)
    inner = f"rate({metric}{{{sel}}}[{RATE}])"
    return f"sum by ({by}) ({inner})" if by else f"sum({inner})"


def quantile(q: float, metric: str, by: str = "") -> str:
    keys = ", ".join(x for x in ("le", by) if x)
    return f"histogram_quantile({q}, sum by ({keys}) (rate({metric}_bucket{{{NS}}}[{RATE}])))"


def gauge(metric: str, agg: str = "sum", by: str = "") -> str:
    return f"{agg}{f' by ({by})' if by else ''} ({metric}{{{NS}}})"


@dataclass
class Panel:
    title: str
    targets: list[tuple[str, str]]  # (expr, legend)
    unit: str = "short"
    kind: str = "timeseries"
    description: str = ""
    width: int = 12
    extra: dict = field(default_factory=dict)


ROWS: list[tuple[str, list[Panel]]] = [
    ("Hits and misses", [
        Panel("Token hit rate per tier", [(
            f"{rate('kvmesh_tokens_hit_total', 'tier')} / ignoring (tier) group_left "
            f"{rate('kvmesh_tokens_requested_total', match=RETRIEVE)}",
            "{{tier}}",
        )], unit="percentunit",
            description="Tokens loaded from each tier over the tokens retrieves asked for."),
        Panel("Chunk hits per tier", [(rate("kvmesh_chunk_hits_total", "tier"), "{{tier}}")],
              unit="ops"),
        Panel("Chunk misses by tier and reason",
              [(rate("kvmesh_chunk_misses_total", "tier, reason"), "{{tier}} {{reason}}")],
              unit="ops",
              description="Why a tier could not give a chunk it was asked for "
                          "(docs/operations.md: miss reasons)."),
        Panel("Cache-server misses by reason",
              [(rate("kvmesh_cacheserver_misses_total", "reason"), "{{reason}}")], unit="ops"),
    ]),
    ("Latency", [
        Panel("Time to first token at the bridge", [
            (quantile(0.5, "kvmesh_bridge_decode_first_byte_seconds"), "p50 first byte"),
            (quantile(0.99, "kvmesh_bridge_decode_first_byte_seconds"), "p99 first byte"),
            (quantile(0.99, "kvmesh_bridge_prefill_seconds"), "p99 prefill"),
        ], unit="s", description="Disaggregated serving: prefill, then the decoder's first "
                                 "byte, as the bridge sees them."),
        Panel("Engine operation latency (p99)",
              [(quantile(0.99, "kvmesh_op_latency_seconds", "op"), "{{op}}")], unit="s"),
        Panel("Tier latency (p99)", [
            (quantile(0.99, "kvmesh_disk_io_seconds", "op"), "disk {{op}}"),
            (quantile(0.99, "kvmesh_remote_seconds", "op"), "remote {{op}}"),
            (quantile(0.99, "kvmesh_p2p_seconds", "op"), "p2p {{op}}"),
        ], unit="s"),
        Panel("Lookup-server and cache-server latency (p99)", [
            (quantile(0.99, "kvmesh_lookup_request_seconds", "op"), "lookup {{op}}"),
            (quantile(0.99, "kvmesh_cacheserver_request_seconds", "op"), "cache-server {{op}}"),
        ], unit="s"),
    ]),
    ("Bytes and usage", [
        Panel("Bytes per tier", [
            (rate("kvmesh_disk_written_bytes_total"), "disk written"),
            (rate("kvmesh_disk_read_bytes_total"), "disk read"),
            (rate("kvmesh_remote_sent_bytes_total"), "remote sent"),
            (rate("kvmesh_remote_received_bytes_total"), "remote received"),
            (rate("kvmesh_p2p_received_bytes_total"), "p2p received"),
            (rate("kvmesh_p2p_served_bytes_total"), "p2p served"),
        ], unit="Bps"),
        Panel("L1 and disk usage", [
            (f"{gauge('kvmesh_l1_usage_bytes')} / {gauge('kvmesh_l1_capacity_bytes')}", "L1"),
            (f"{gauge('kvmesh_disk_usage_bytes')} / {gauge('kvmesh_disk_capacity_bytes')}",
             "disk"),
            (f"{gauge('kvmesh_cacheserver_memory_bytes')} / "
             f"{gauge('kvmesh_cacheserver_max_memory_bytes')}", "cache-server memory"),
        ], unit="percentunit", extra={"max": 1}),
        Panel("Chunks held", [
            (gauge("kvmesh_l1_chunks"), "L1"),
            (gauge("kvmesh_disk_chunks"), "disk"),
            (gauge("kvmesh_cacheserver_keys"), "cache-server"),
        ]),
        Panel("Queue depths", [
            (gauge("kvmesh_disk_pending_puts"), "disk puts pending"),
            (gauge("kvmesh_remote_pending_puts"), "remote puts pending"),
            (gauge("kvmesh_pinned_lookups"), "pinned lookups"),
            (gauge("kvmesh_p2p_server_leases"), "p2p leases"),
            (gauge("kvmesh_bridge_backend_inflight", by="role"), "bridge in flight {{role}}"),
        ]),
    ]),
    ("Control plane", [
        Panel("Controller: workers and chunks", [
            (gauge("kvmesh_controller_workers", "max"), "workers"),
            (gauge("kvmesh_controller_chunks", "max"), "chunks"),
        ]),
        Panel("Controller: KV events, resyncs, drops", [
            (rate("kvmesh_controller_kv_events_total"), "KV events applied"),
            (rate("kvmesh_controller_resyncs_total"), "resyncs"),
            (rate("kvmesh_controller_workers_dropped_total", "reason"), "dropped {{reason}}"),
            (rate("kvmesh_controller_errors_total", "code"), "errors {{code}}"),
        ], unit="ops"),
        Panel("Controller: KV-event feed", [
            (rate("kvmesh_controller_events_published_total"), "messages published"),
            (gauge("kvmesh_controller_events_topics", "max"), "topics subscribed"),
            (rate("kvmesh_controller_events_epochs_total"), "new epochs"),
            (rate("kvmesh_controller_event_replay_requests_total", "op"), "replay {{op}}"),
            (rate("kvmesh_controller_event_replay_errors_total", "code"),
             "replay errors {{code}}"),
        ], width=18, description="The feed for routers and scripts "
                                 "(controller.events_port); empty while it is off."),
        Panel("Lookup-server: index in sync", [
            (gauge("kvmesh_lookup_index_in_sync", "min"), "in sync (all replicas)"),
        ], kind="stat", width=6, extra={"mappings": [{"type": "value", "options": {
            "0": {"text": "OUT OF SYNC", "color": "red"},
            "1": {"text": "in sync", "color": "green"}}}]}),
        Panel("Lookup-server: index and fallbacks", [
            (gauge("kvmesh_lookup_index_staleness_seconds", "max"), "staleness (s)"),
            (rate("kvmesh_lookup_controller_fallbacks_total", "op"), "fallbacks {{op}}"),
            (rate("kvmesh_lookup_index_resyncs_total", "reason"), "resyncs {{reason}}"),
        ], width=24),
    ]),
    ("Bridge and cache-server", [
        Panel("Bridge requests and fallbacks", [
            (rate("kvmesh_bridge_requests_total", "outcome"), "requests {{outcome}}"),
            (rate("kvmesh_bridge_fallbacks_total", "reason"), "fallback {{reason}}"),
            (rate("kvmesh_bridge_route_fallbacks_total", "reason"), "route fallback {{reason}}"),
        ], unit="reqps"),
        Panel("Bridge backends up", [
            (gauge("kvmesh_bridge_backend_up", by="role"), "{{role}} up"),
        ]),
        Panel("Cache-server operations", [
            (rate("kvmesh_cacheserver_requests_total", "op"), "{{op}}"),
            (rate("kvmesh_cacheserver_gets_total", "result"), "get {{result}}"),
            (rate("kvmesh_cacheserver_evictions_total", "to"), "evicted to {{to}}"),
        ], unit="ops"),
        Panel("Remote tier health", [
            (gauge("kvmesh_remote_up", "min"), "remote up (min over workers)"),
            (rate("kvmesh_remote_state_changes_total", "to"), "became {{to}}"),
        ]),
    ]),
    ("Security", [
        Panel("Refused connections and requests", [
            (rate("kvmesh_controller_auth_failures_total", "reason"),
             "controller CURVE {{reason}}"),
            (rate("kvmesh_lookup_auth_failures_total", "reason"), "lookup CURVE {{reason}}"),
            (rate("kvmesh_cacheserver_auth_failures_total", "reason"),
             "cache-server CURVE {{reason}}"),
            (rate("kvmesh_worker_auth_failures_total", "reason"), "worker CURVE {{reason}}"),
            (rate("kvmesh_controller_http_auth_failures_total", "reason"),
             "controller HTTP {{reason}}"),
            (rate("kvmesh_bridge_http_auth_failures_total", "reason"), "bridge HTTP {{reason}}"),
        ], unit="ops", width=24,
            description="CURVE handshakes refused (no_key, unknown_key, bad_handshake) and "
                        "HTTP admin requests without the right token. Anything above 0 is "
                        "a misconfigured client or someone knocking."),
    ]),
]  # fmt: skip


VARIABLES = [
    {"name": "datasource", "label": "Prometheus", "type": "datasource",
     "query": "prometheus", "current": {}, "hide": 0},
    {"name": "namespace", "label": "Namespace", "type": "query",
     "datasource": {"type": "prometheus", "uid": "${datasource}"},
     "query": {"query": "label_values(kvmesh_controller_workers, namespace)",
               "refId": "namespace"},
     "definition": "label_values(kvmesh_controller_workers, namespace)",
     "includeAll": True, "allValue": ".*", "multi": True, "refresh": 2,
     "current": {"text": "All", "value": "$__all"}, "hide": 0},
]  # fmt: skip


def _panel(p: Panel, pid: int, x: int, y: int) -> dict:
    out = {
        "id": pid,
        "type": p.kind,
        "title": p.title,
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "gridPos": {"h": 8, "w": p.width, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": p.unit}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}},
        "targets": [
            {"refId": chr(ord("A") + i), "expr": expr, "legendFormat": legend}
            for i, (expr, legend) in enumerate(p.targets)
        ],
    }
    if p.kind == "stat":
        out["options"] = {
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "colorMode": "background",
        }
    if p.description:
        out["description"] = p.description
    defaults = out["fieldConfig"]["defaults"]
    for key in ("max", "mappings"):
        if key in p.extra:
            defaults[key] = p.extra[key]
    return out


def build() -> dict:
    panels: list[dict] = []
    pid, y = 1, 0
    for title, row in ROWS:
        panels.append({"id": pid, "type": "row", "title": title, "collapsed": False,
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})  # fmt: skip
        pid, y, x = pid + 1, y + 1, 0
        for p in row:
            if x + p.width > 24:
                x, y = 0, y + 8
            panels.append(_panel(p, pid, x, y))
            pid, x = pid + 1, x + p.width
        y += 8
    return {
        "uid": "kvmesh-overview",
        "title": "kvmesh",
        "description": "The kvmesh KV-cache mesh: hits and misses per tier, latency, bytes, "
        "usage, queues, control plane, bridge, cache-server, refused connections.",
        "tags": ["kvmesh"],
        "timezone": "browser",
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "refresh": "30s",
        "time": {"from": "now-1h", "to": "now"},
        "templating": {"list": VARIABLES},
        "annotations": {"list": []},
        "panels": panels,
    }


def render() -> str:
    return json.dumps(build(), indent=2) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the file is stale")
    args = parser.parse_args()
    text = render()
    if args.check:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT} is out of date: run python {Path(__file__).name}", file=sys.stderr)
            return 1
        return 0
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

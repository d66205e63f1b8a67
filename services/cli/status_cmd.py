"""`kvmesh status`: one view of a running mesh, for people (tables) and scripts (--json).

    kvmesh status [--config FILE] [--json] [--watch SECONDS] [--metrics NAME=URL ...]

What it asks, all at once, each with the --timeout deadline:

- the controller (ZMQ, the client `kvmesh admin` uses): its workers grouped by
  instance, with chunks per tier, and each worker's L1 use (the `health` fan-out);
- the lookup-server (ZMQ hello) and the cache-server (ZMQ hello + stats: keys, memory,
  hit rate);
- the /metrics page of every service that has one configured (controller P2P hit rate,
  the lookup-server's index), and of every `--metrics NAME=URL` (worker engines'
  `engine.metrics_port`: hit rate per tier, L1 use).

Endpoints come from the config (`controller.host/port`, `lookup.*`, `cacheserver.*`,
or `engine.remote.url` when it is a kvmesh:// one) unless given as options. A service
that does not answer is shown as down with why; nothing waits past the deadline.
Exit status: 0 when every service asked answered, 3 otherwise (the last refresh under
--watch, which runs until ctrl-C), 2 for a bad option (an endpoint zmq would refuse).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import click
import msgspec
from prometheus_client.parser import text_string_to_metric_families

from kvmesh.common.config import KvmeshConfig
from kvmesh.common.config.schema import ZMQ_ENDPOINT_FORMS, is_zmq_endpoint
from kvmesh.common.protocol import controller as proto
from kvmesh.common.redact import redact_text
from kvmesh.common.transport.cacheserver_client import CacheServerClient
from kvmesh.common.transport.controller_client import ControllerConnection
from kvmesh.common.transport.curve import CurveKeys
from kvmesh.common.transport.handshake_probe import handshake_problem
from kvmesh.common.transport.lookup_service_client import LookupServiceClient
from kvmesh.common.transport.tcp_address import (
    cacheserver_endpoint,
    host_part,
    local_host,
    tcp_endpoint,
)
from kvmesh.services.cli.serving import load_security, load_service_config

EXIT_DOWN = 3
HANDSHAKE_PROBE_S = 1.0
# Metric samples kept per page: what the tables show, nothing else.
_WANTED = (
    "kvmesh_controller_p2p_lookups_total",
    "kvmesh_controller_chunks",
    "kvmesh_lookup_index_in_sync",
    "kvmesh_lookup_index_chunks",
    "kvmesh_lookup_requests_total",
    "kvmesh_hit_rate",
    "kvmesh_l1_usage_bytes",
    "kvmesh_l1_capacity_bytes",
    "kvmesh_l1_chunks",
)


@dataclass
class Endpoints:
    controller: str
    lookup: str
    cacheserver: str
    # name -> http://host:port/metrics
    metrics: dict[str, str] = field(default_factory=dict)


def endpoints_from_config(cfg: KvmeshConfig) -> Endpoints:
    """Where each service of cfg listens, as a client on the same host reaches it."""
    c, lk, cs = cfg.controller, cfg.lookup, cfg.cacheserver
    cache = tcp_endpoint(local_host(cs.host), cs.port)
    remote = cfg.engine.remote
    if remote.enabled and remote.url.startswith("kvmesh://"):
        cache = cacheserver_endpoint(remote.url)
    ep = Endpoints(
        controller=tcp_endpoint(local_host(c.host), c.port),
        lookup=tcp_endpoint(local_host(lk.host), lk.port),
        cacheserver=cache,
    )
    controller_http = c.http_port or c.metrics_port
    for name, host, port in (
        ("controller", c.host, controller_http),
        ("lookup", lk.host, lk.metrics_port),
        ("cacheserver", cs.host, cs.metrics_port),
    ):
        if port:
            ep.metrics[name] = f"http://{host_part(local_host(host))}:{port}/metrics"
    return ep


# -- gathering ----------------------------------------------------------------------------


async def timed(
    what: Callable[[], Awaitable[dict[str, Any]]],
    timeout_s: float,
    *,
    endpoint: str = "",
    curve: CurveKeys | None = None,
    secret_url: str = "",
) -> dict:
    """what()'s fields plus up/latency, or up=false and the error; never raises.
    secret_url: a URL with credentials the error may quote (hidden in it).

    With the ZMQ endpoint what() talks to, a failure also says what the connection
    and the CURVE handshake did (a refused client hears nothing, only a timeout):
    one more connection, at most HANDSHAKE_PROBE_S more."""
    t0 = time.perf_counter()
    try:
        async with asyncio.timeout(timeout_s):
            out = await what()
        out.update(up=True, latency_ms=round((time.perf_counter() - t0) * 1e3, 2))
        return out
    except TimeoutError:
        error = f"no answer in {timeout_s:g}s"
    except Exception as exc:  # any failure is "down, because ..."
        # Hidden before the cut: a cut copy of a URL is no longer found to hide.
        error = redact_text(f"{type(exc).__name__}: {exc}", secret_url)[:300]
    if endpoint:
        probe_s = min(timeout_s, HANDSHAKE_PROBE_S)
        # The probe only adds to the error: one it raises itself (an endpoint zmq
        # refuses, as "tcp://bad host:1") must not turn "down" into a traceback.
        with contextlib.suppress(Exception):
            why = await asyncio.to_thread(handshake_problem, endpoint, curve, probe_s)
            if why:
                error = f"{error}: {why}"
    return {"up": False, "error": error}


async def controller_view(url: str, timeout_s: float, curve: CurveKeys | None) -> dict[str, Any]:
    conn = ControllerConnection(url, timeout_s=timeout_s, client="cli-status", curve=curve)
    t0 = time.monotonic()
    try:
        await conn.connect()
        listed = await conn.request(proto.ListWorkers(conn.next_rid()), proto.ListWorkersReply)
        workers = [msgspec.structs.asdict(w) for w in listed.workers]
        # L1 bytes are only known to the workers: ask them, but a slow worker must not
        # hide the list, so a failed fan-out leaves the usage unknown.
        health: dict[str, dict[str, int]] = {}
        if workers:
            with contextlib.suppress(Exception):
                reply = await conn.request(
                    proto.Health(conn.next_rid(), uuid.uuid4().hex, ""),
                    proto.AdminReply,
                    # What is left of the deadline, less a margin for the reply's trip:
                    # past the caller's deadline the worker list would be lost too.
                    max(0.05, timeout_s * 0.9 - (time.monotonic() - t0)),
                )
                health = {r.worker_id: dict(r.detail) for r in reply.results if r.ok}
        for w in workers:
            w["health"] = health.get(w["worker_id"])
        return {"workers": workers}
    finally:
        await conn.close()


async def probe_controller(url: str, timeout_s: float, curve: CurveKeys | None) -> dict[str, Any]:
    """The controller's hello, nothing more (doctor's port and reachability checks)."""
    conn = ControllerConnection(url, timeout_s=timeout_s, client="cli-doctor", curve=curve)
    try:
        await conn.connect()
        return {}
    finally:
        await conn.close()


async def probe_lookup(url: str, timeout_s: float, curve: CurveKeys | None) -> dict[str, Any]:
    async with LookupServiceClient(url, timeout_s=timeout_s, name="cli-status", curve=curve) as c:
        hello = await c.hello()
    return {"name": getattr(hello, "server", "") or ""}


async def probe_cacheserver(url: str, timeout_s: float, curve: CurveKeys | None) -> dict[str, Any]:
    client = CacheServerClient(url, timeout_s=timeout_s, name="cli-status", curve=curve)
    try:
        await client.connect(timeout_s)
        s = await client.stats(timeout_s)
    finally:
        await client.close()
    looked = s.hits + s.misses
    return {
        "keys": s.keys,
        "memory_bytes": s.memory_bytes,
        "max_memory": s.max_memory,
        "spilled_keys": s.spilled_keys,
        "spilled_bytes": s.spilled_bytes,
        "hits": s.hits,
        "misses": s.misses,
        "hit_rate": round(s.hits / looked, 4) if looked else None,
        "evictions": s.evictions,
        "connections": s.connections,
        "uptime_s": round(s.uptime_s, 1),
    }


async def fetch_metrics(url: str, timeout_s: float) -> dict[str, Any]:
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with (
        aiohttp.ClientSession(timeout=timeout, trust_env=False) as session,
        session.get(url) as resp,
    ):
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}")
        text = await resp.text()
    samples = []
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            # NaN (a ratio of nothing yet) and +-Inf are valid on a /metrics page but
            # not in JSON, which --json must stay: left out, i.e. unknown.
            if s.name in _WANTED and math.isfinite(s.value):
                samples.append({"name": s.name, "labels": dict(s.labels), "value": s.value})
    return {"samples": samples}


async def gather(ep: Endpoints, timeout_s: float, curve: CurveKeys | None) -> dict[str, Any]:
    """Everything status shows, as one JSON-able dict; each part within timeout_s."""
    jobs: dict[str, Awaitable[dict[str, Any]]] = {
        "controller": timed(
            lambda: controller_view(ep.controller, timeout_s, curve),
            timeout_s,
            endpoint=ep.controller,
            curve=curve,
        ),
        "lookup": timed(
            lambda: probe_lookup(ep.lookup, timeout_s, curve),
            timeout_s,
            endpoint=ep.lookup,
            curve=curve,
        ),
        "cacheserver": timed(
            lambda: probe_cacheserver(ep.cacheserver, timeout_s, curve),
            timeout_s,
            endpoint=ep.cacheserver,
            curve=curve,
        ),
    }
    for name, url in ep.metrics.items():
        jobs[f"metrics:{name}"] = timed(lambda u=url: fetch_metrics(u, timeout_s), timeout_s)
    results = dict(zip(jobs, await asyncio.gather(*jobs.values()), strict=True))
    return summarize(ep, results)


def _sum(samples: list[dict[str, Any]], name: str, **labels: str) -> float | None:
    hit = [
        s["value"]
        for s in samples
        if s["name"] == name and all(s["labels"].get(k) == v for k, v in labels.items())
    ]
    return sum(hit) if hit else None


def summarize(ep: Endpoints, results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    ctl = results["controller"]
    workers = ctl.pop("workers", [])
    instances: dict[str, dict[str, Any]] = {}
    for w in workers:
        inst = instances.setdefault(
            w["instance_id"],
            {"instance_id": w["instance_id"], "world_size": w["world_size"], "ranks": [],
             "chunks": {}, "l1_used_bytes": 0},
        )  # fmt: skip
        inst["ranks"].append(w["rank"])
        for tier, n in w["chunks"].items():
            inst["chunks"][tier] = inst["chunks"].get(tier, 0) + n
        used = (w.get("health") or {}).get("l1_used_bytes")
        inst["l1_used_bytes"] = None if used is None or inst["l1_used_bytes"] is None else (
            inst["l1_used_bytes"] + used
        )  # fmt: skip
    services = {
        "controller": {"url": ep.controller, **ctl},
        "lookup": {"url": ep.lookup, **results["lookup"]},
        "cacheserver": {"url": ep.cacheserver, **results["cacheserver"]},
    }
    pages = {k.removeprefix("metrics:"): v for k, v in results.items() if k.startswith("metrics:")}
    for name in ("controller", "lookup"):
        page = pages.get(name)
        if page is None:
            continue
        samples = page.get("samples", [])
        if name == "controller":
            yes = _sum(samples, "kvmesh_controller_p2p_lookups_total", hit="yes") or 0.0
            no = _sum(samples, "kvmesh_controller_p2p_lookups_total", hit="no") or 0.0
            services[name]["p2p_hit_rate"] = round(yes / (yes + no), 4) if yes + no else None
            services[name]["chunks"] = _sum(samples, "kvmesh_controller_chunks")
        else:
            services[name]["index_in_sync"] = _sum(samples, "kvmesh_lookup_index_in_sync") == 1
            services[name]["index_chunks"] = _sum(samples, "kvmesh_lookup_index_chunks")
        services[name]["metrics"] = {"url": ep.metrics[name], "up": page["up"]}
        if not page["up"]:
            services[name]["metrics"]["error"] = page["error"]
    engines = [
        _engine(name, ep.metrics[name], page)
        for name, page in pages.items()
        if name not in ("controller", "lookup", "cacheserver")
    ]
    return {
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "services": services,
        "instances": sorted(instances.values(), key=lambda i: i["instance_id"]),
        "workers": workers,
        "engines": engines,
        "all_up": all(s["up"] for s in services.values()) and all(e["up"] for e in engines),
    }


def _engine(name: str, url: str, page: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"name": name, "url": url, "up": page["up"]}
    if not page["up"]:
        out["error"] = page["error"]
        return out
    samples = page["samples"]
    out["hit_rate"] = {
        s["labels"]["tier"]: round(s["value"], 4)
        for s in samples
        if s["name"] == "kvmesh_hit_rate" and "tier" in s["labels"]
    }
    out["l1_usage_bytes"] = _sum(samples, "kvmesh_l1_usage_bytes")
    out["l1_capacity_bytes"] = _sum(samples, "kvmesh_l1_capacity_bytes")
    return out


# -- rendering ----------------------------------------------------------------------------


def table(rows: list[tuple[str, ...]]) -> str:
    """Rows as left-aligned columns two spaces apart (the first row is the header)."""
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    return "\n".join(
        "  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip() for r in rows
    )


def human_size(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    return f"{n}"


def _pct(rate: float | None) -> str:
    return "-" if rate is None else f"{rate * 100:.1f}%"


def _service_detail(name: str, s: dict[str, Any], workers: int) -> str:
    if not s["up"]:
        return s["error"]
    if name == "controller":
        parts = [f"{workers} workers"]
        if s.get("chunks") is not None:
            parts.append(f"{s['chunks']:.0f} chunks")
        if "p2p_hit_rate" in s:
            parts.append(f"p2p hit rate {_pct(s['p2p_hit_rate'])}")
        return ", ".join(parts)
    if name == "lookup":
        if "index_in_sync" not in s:
            return "answering"
        sync = "index in sync" if s["index_in_sync"] else "index NOT in sync"
        return f"{sync}, {(s.get('index_chunks') or 0):.0f} chunks"
    return (
        f"{s['keys']} keys, {human_size(s['memory_bytes'])} of {human_size(s['max_memory'])}, "
        f"hit rate {_pct(s['hit_rate'])}, {s['connections']} connections"
    )


def render(view: dict[str, Any]) -> str:
    out = [f"kvmesh status at {view['time']}", ""]
    rows = [("SERVICE", "URL", "STATE", "DETAIL")]
    for name, s in view["services"].items():
        state = "up" if s["up"] else "DOWN"
        rows.append((name, s["url"], state, _service_detail(name, s, len(view["workers"]))))
    out.append(table(rows))
    tiers = sorted({t for i in view["instances"] for t in i["chunks"]})
    if view["instances"]:
        head = ("INSTANCE", "RANKS", *(f"{t.upper()} CHUNKS" for t in tiers), "L1 USED")
        rows = [head]
        for i in view["instances"]:
            ranks = f"{len(i['ranks'])}/{i['world_size']}"
            counts = tuple(str(i["chunks"].get(t, 0)) for t in tiers)
            rows.append((i["instance_id"], ranks, *counts, human_size(i["l1_used_bytes"])))
        out += ["", table(rows)]
        rows = [("WORKER", "INSTANCE", "RANK", "P2P", "SEEN")]
        for w in view["workers"]:
            seen = f"{w['seen_s_ago']:.1f}s ago" + (" (restored)" if w["restored"] else "")
            rows.append(
                (w["worker_id"], w["instance_id"], str(w["rank"]), w["p2p_endpoint"] or "-", seen)
            )
        out += ["", table(rows)]
    elif view["services"]["controller"]["up"]:
        out += ["", "no workers registered"]
    if view["engines"]:
        etiers = sorted({t for e in view["engines"] for t in e.get("hit_rate", {})})
        rows = [("ENGINE", "STATE", *(f"{t.upper()} HIT" for t in etiers), "L1 USED", "L1 SIZE")]
        for e in view["engines"]:
            if not e["up"]:
                rows.append((e["name"], "DOWN", *("-" for _ in etiers), "-", e["error"]))
                continue
            rates = tuple(_pct(e["hit_rate"].get(t)) for t in etiers)
            used, cap = human_size(e["l1_usage_bytes"]), human_size(e["l1_capacity_bytes"])
            rows.append((e["name"], "up", *rates, used, cap))
        out += ["", table(rows)]
    return "\n".join(out)


# -- the command --------------------------------------------------------------------------


def _zmq_url(_ctx: click.Context, _param: click.Parameter, url: str | None) -> str | None:
    # Refused before any socket exists, as `kvmesh admin --url` does: zmq would only
    # refuse it at connect time.
    if url is not None and not is_zmq_endpoint(url):
        raise click.BadParameter(f"expected {ZMQ_ENDPOINT_FORMS} (got {url!r})")
    return url


def _parse_metrics(values: tuple[str, ...]) -> dict[str, str]:
    out = {}
    for v in values:
        name, sep, url = v.partition("=")
        if not sep or not name or not url.startswith(("http://", "https://")):
            raise click.BadParameter(f"{v!r}: expected NAME=http://host:port/metrics")
        out[name] = url
    return out


@click.command("status")
@click.option(
    "--config",
    "config_file",
    type=click.Path(dir_okay=False, path_type=str),
    default=None,
    help="YAML config (default: $KVMESH_CONFIG): the services' endpoints and security.",
)
@click.option(
    "--controller", "controller_url", default=None, callback=_zmq_url, help="tcp://host:port"
)
@click.option(
    "--lookup-url", default=None, callback=_zmq_url, help="The lookup-server, tcp://host:port."
)
@click.option(
    "--cacheserver-url",
    default=None,
    callback=_zmq_url,
    help="The cache-server, tcp://host:port.",
)
@click.option(
    "--metrics",
    "metrics",
    multiple=True,
    help="NAME=URL of another /metrics page to read, e.g. a worker engine's "
    "(engine.metrics_port); repeatable.",
)
@click.option(
    "--timeout", "timeout_s", type=click.FloatRange(min=0), default=2.0, show_default=True
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON (one object per refresh).")
@click.option(
    "--watch",
    type=click.FloatRange(min=0),
    default=0.0,
    help="Refresh every SECONDS until ctrl-C (0: once).",
)
def status(
    config_file: str | None,
    controller_url: str | None,
    lookup_url: str | None,
    cacheserver_url: str | None,
    metrics: tuple[str, ...],
    timeout_s: float,
    as_json: bool,
    watch: float,
) -> None:
    """A live view of the mesh: services, instances, tiers, usage, hit rates."""
    cfg = load_service_config("status", config_file, {})
    curve, _token = load_security(cfg, client=True)
    ep = endpoints_from_config(cfg)
    ep.controller = controller_url or ep.controller
    ep.lookup = lookup_url or ep.lookup
    ep.cacheserver = cacheserver_url or ep.cacheserver
    ep.metrics.update(_parse_metrics(metrics))
    view: dict[str, Any] = {}
    try:
        while True:
            view = asyncio.run(gather(ep, timeout_s, curve))
            if as_json:
                click.echo(json.dumps(view))
            else:
                if watch and sys.stdout.isatty():
                    click.clear()
                click.echo(render(view))
                if watch and not sys.stdout.isatty():
                    click.echo("")  # a log of refreshes: one blank line between them
            if not watch:
                break
            time.sleep(watch)
    except KeyboardInterrupt:
        pass
    sys.exit(0 if view.get("all_up") else EXIT_DOWN)
